use super::encode::seal;
use super::*;
use crate::error::StreamError;
use slat_addr::PageIndex;
use std::time::Duration;

fn hello() -> Hello {
    Hello {
        session: 7,
        attempt: 1,
        one_way: false,
        regions: vec![
            Region {
                gpa: Gpa::ZERO,
                pages: 256,
                read_only: false,
            },
            Region {
                gpa: Gpa::new(1 << 30),
                pages: 16,
                read_only: true,
            },
        ],
        machine: vec![1, 2, 3],
        verify: crate::verify::VerifyMode::Sent,
        compression: Compression::Lz4,
        delta: true,
        range_pages: 64,
        backend: "sim".into(),
    }
}

fn roundtrip(m: &Msg) -> Msg {
    let bytes = frame(m);
    FrameReader::new(&bytes[..], Duration::from_secs(1))
        .read_msg("test")
        .unwrap()
}

#[test]
fn messages_roundtrip() {
    for m in [
        Msg::Hello(hello()),
        Msg::Welcome {
            resume: true,
            backend: "kvm".into(),
            delta: true,
        },
        Msg::Refuse("no".into()),
        Msg::Ack { seq: 9 },
        Msg::RoundEnd { round: 2, pages: 5 },
        Msg::Hashes {
            first: 4,
            hashes: vec![[1; 32], [2; 32]],
        },
        Msg::Verify {
            ranges: 8,
            range_pages: 64,
        },
        Msg::Verified {
            ranges: 8,
            mismatched: 1,
            first: vec![3],
        },
        Msg::Commit,
        Msg::Resumed {
            touched: 1,
            micros: 2,
        },
        Msg::State(StateBlob {
            id: "vcpu0".into(),
            version: 3,
            data: vec![9; 100],
        }),
        Msg::StateEnd {
            blobs: 1,
            bytes: 100,
        },
        Msg::Streams { count: 2 },
        Msg::StreamHello {
            session: 7,
            attempt: 2,
            index: 1,
        },
    ] {
        assert_eq!(roundtrip(&m), m);
    }
}

#[test]
fn batches_roundtrip_every_encoding() {
    let mut b = BatchBuilder::new(Compression::Lz4);
    b.start(5, 1);
    let zero = vec![0u8; PAGE_BYTES];
    let mut sparse = vec![0u8; PAGE_BYTES];
    sparse[0] = 42;
    let noise: Vec<u8> = (0..PAGE_BYTES as u64)
        .map(|i| crate::guest::splitmix(i) as u8)
        .collect();
    b.push(PageIndex::new(1), &zero);
    b.push(PageIndex::new(2), &sparse);
    b.push(PageIndex::new(3), &noise);
    let bytes = b.frame().to_vec();
    let Msg::Pages(batch) = FrameReader::new(&bytes[..], Duration::from_secs(1))
        .read_msg("test")
        .unwrap()
    else {
        panic!("not pages")
    };
    assert_eq!((batch.seq, batch.round), (5, 1));
    let encs: Vec<Encoding> = batch.entries.iter().map(|e| e.1).collect();
    assert_eq!(encs, [Encoding::Zero, Encoding::Lz4, Encoding::Raw]);
    let mut out = vec![1u8; PAGE_BYTES];
    for (i, want) in [&zero, &sparse, &noise].into_iter().enumerate() {
        batch.page_into(i, &mut out).unwrap();
        assert_eq!(&out, want);
    }
}

#[test]
fn every_flipped_bit_and_every_truncation_is_an_error() {
    let bytes = frame(&Msg::Hello(hello()));
    for i in 0..bytes.len() {
        for bit in [0, 3, 7] {
            let mut b = bytes.clone();
            b[i] ^= 1 << bit;
            assert!(FrameReader::new(&b[..], Duration::from_secs(1))
                .read_msg("test")
                .is_err());
        }
        let r = FrameReader::new(&bytes[..i], Duration::from_secs(1)).read_msg("test");
        match r {
            Err(StreamError::Truncated { .. }) => assert!(i > 0),
            Err(StreamError::Closed { .. }) => assert_eq!(i, 0),
            other => panic!("{i}: {other:?}"),
        }
    }
}

#[test]
fn preamble_checks_magic_version_and_page_size() {
    let ok = preamble(VERSION);
    assert!(FrameReader::new(&ok[..], Duration::ZERO)
        .read_preamble()
        .is_ok());
    let v = preamble(VERSION + 1);
    assert!(matches!(
        FrameReader::new(&v[..], Duration::ZERO).read_preamble(),
        Err(StreamError::Version { found, .. }) if found == VERSION + 1
    ));
    let mut m = ok;
    m[0] = b'X';
    assert!(matches!(
        FrameReader::new(&m[..], Duration::ZERO).read_preamble(),
        Err(StreamError::BadMagic { .. })
    ));
    let mut p = ok;
    p[13] = 0x20;
    assert!(matches!(
        FrameReader::new(&p[..], Duration::ZERO).read_preamble(),
        Err(StreamError::PageSize { .. })
    ));
    assert!(matches!(
        FrameReader::new(&ok[..5], Duration::ZERO).read_preamble(),
        Err(StreamError::Truncated { .. })
    ));
}

#[test]
fn memory_maps_are_checked() {
    let r = |gpa, pages, read_only| Region {
        gpa: Gpa::new(gpa),
        pages,
        read_only,
    };
    assert_eq!(
        check_regions(&[r(0, 16, false), r(1 << 20, 4, true)]),
        Ok(20)
    );
    assert!(matches!(check_regions(&[]), Err(MapError::Count(0))));
    assert!(matches!(
        check_regions(&[r(0, 0, false)]),
        Err(MapError::Empty { .. })
    ));
    assert!(matches!(
        check_regions(&[r(5, 1, false)]),
        Err(MapError::Unaligned { .. })
    ));
    assert!(matches!(
        check_regions(&[r(0, 16, false), r(4096, 1, false)]),
        Err(MapError::Overlap { .. })
    ));
    assert!(matches!(
        check_regions(&[r(!4095, u64::MAX, false)]),
        Err(MapError::Beyond { .. })
    ));
    assert!(matches!(
        check_regions(&[r(0, 1 << 40, false)]),
        Err(MapError::Beyond { .. }) | Err(MapError::TooBig { .. })
    ));
}

#[test]
fn garbage_never_panics() {
    // A deterministic sweep of junk frames with valid checksums: decode must only error.
    let mut x = 0x1234_5678_9abc_def0u64;
    for _ in 0..20_000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let ty = (x % 15) as u8;
        let len = ((x >> 8) % 64) as usize;
        let mut f = vec![0u8; HEADER_LEN];
        for i in 0..len {
            f.push((x >> (i % 56)) as u8);
        }
        seal(&mut f, ty);
        let _ = FrameReader::new(&f[..], Duration::ZERO).read_msg("test");
    }
}
