//! Hostile values and frames: structurally valid frames carrying hostile field values.

use super::*;

pub(crate) fn edge_u64() -> impl Strategy<Value = u64> {
    prop_oneof![
        4 => 0u64..80,
        1 => Just(u64::MAX),
        1 => Just(u64::MAX / 4096),
        1 => Just(u64::MAX - 4095),
        1 => Just(4_611_686_018_427_392_000u64),
        1 => (0u32..64).prop_map(|s| 1u64 << s),
        1 => (0u32..64).prop_map(|s| (1u64 << s).wrapping_sub(1)),
        2 => any::<u64>(),
    ]
}

pub(crate) fn edge_u32() -> impl Strategy<Value = u32> {
    prop_oneof![
        4 => 0u32..80,
        1 => Just(u32::MAX),
        1 => Just(MAX_BATCH_PAGES),
        1 => Just(MAX_BATCH_PAGES + 1),
        1 => (0u32..32).prop_map(|s| 1u32 << s),
        2 => any::<u32>(),
    ]
}

pub(crate) fn small_bytes(max: usize) -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(any::<u8>(), 0..=max)
}

/// A shape: often small and valid (so the stream goes on), often at the edges.
pub(crate) fn hostile_shape() -> impl Strategy<Value = Shape> {
    let vcpus = prop_oneof![3 => 1u32..=4, 1 => Just(0u32), 1 => 500u32..=520, 1 => edge_u32()];
    let bpv = prop_oneof![
        3 => (1u64..=64).prop_map(|k| k * 4096),
        1 => edge_u64(),
        1 => Just(1u64 << 40),
    ];
    let slots =
        prop_oneof![3 => 1u32..=4, 1 => Just(0u32), 1 => 31_999u32..=32_001, 1 => edge_u32()];
    (vcpus, bpv, slots, any::<bool>()).prop_map(|(vcpus, bytes_per_vcpu, slots, overlap)| Shape {
        vcpus,
        bytes_per_vcpu,
        slots,
        overlap,
    })
}

#[derive(Debug, Clone)]
pub(crate) enum RegionList {
    /// As the shape gives it (wrapping arithmetic, as a careless peer would compute it).
    Derived,
    /// Any entries: (gpa, pages, read-only byte).
    Listed(Vec<(u64, u64, u8)>),
    /// A count that claims more entries than follow.
    Claimed(u32),
}

#[derive(Debug, Clone)]
pub(crate) enum Entry {
    Zero,
    Raw(u8),
    /// A real LZ4 block of a noise page.
    Lz4(u64),
    /// A block of any bytes (length as it is).
    Lz4Bytes(Vec<u8>),
    /// A length field that lies.
    Lz4Len(u32, Vec<u8>),
    /// A delta of runs (skip, len, bytes given), its length as written.
    Delta(Vec<(u16, u16, u8)>),
    /// A delta whose length field lies.
    DeltaLen(u32, Vec<u8>),
    /// An unknown encoding byte.
    Encoding(u8),
}

#[derive(Debug, Clone)]
pub(crate) enum Hostile {
    Hello {
        shape: Shape,
        regions: RegionList,
        one_way: bool,
        machine: Option<Vec<u8>>,
        compression: u8,
        range_pages: u32,
        verify: u8,
        backend: Vec<u8>,
    },
    State {
        id: Vec<u8>,
        version: u32,
        claimed: Option<u32>,
        data: Vec<u8>,
    },
    StateEnd {
        blobs: u32,
        bytes: u64,
    },
    Pages {
        seq: u64,
        round: u32,
        claimed: Option<u32>,
        entries: Vec<(u64, Entry)>,
    },
    RoundEnd {
        round: u32,
        pages: u64,
    },
    Hashes {
        first: u64,
        claimed: Option<u32>,
        count: u8,
    },
    Verify {
        ranges: u64,
        range_pages: u32,
    },
    Commit,
    /// Page streams announced (a count at the edges, the destination's bound around 2..16).
    Streams {
        count: u32,
    },
    /// A page stream's header where only the control frames belong.
    StreamHello {
        session: u64,
        attempt: u32,
        index: u32,
    },
    /// A post-copy frame (`ty` 32-39) with hostile runs, counts and values.
    Postcopy {
        ty: u8,
        claimed: Option<u32>,
        runs: Vec<(u64, u64)>,
        value: u64,
    },
    /// Any type byte (known or not) around any payload.
    Raw {
        ty: u8,
        payload: Vec<u8>,
    },
    /// A header whose length lies about the payload, checksummed as if honest.
    Lying {
        ty: u8,
        payload: Vec<u8>,
        len: u32,
    },
}

pub(crate) fn entry() -> impl Strategy<Value = Entry> {
    prop_oneof![
        3 => Just(Entry::Zero),
        2 => any::<u8>().prop_map(Entry::Raw),
        2 => any::<u64>().prop_map(Entry::Lz4),
        1 => small_bytes(64).prop_map(Entry::Lz4Bytes),
        1 => (edge_u32(), small_bytes(32)).prop_map(|(l, b)| Entry::Lz4Len(l, b)),
        2 => proptest::collection::vec(
            (prop_oneof![3 => 0u16..64, 1 => 4000u16..=4096, 1 => any::<u16>()],
             prop_oneof![3 => 1u16..16, 1 => Just(0u16), 1 => 4000u16..=4097],
             any::<u8>()),
            0..5,
        ).prop_map(Entry::Delta),
        1 => (edge_u32(), small_bytes(32)).prop_map(|(l, b)| Entry::DeltaLen(l, b)),
        1 => (4u8..=255).prop_map(Entry::Encoding),
    ]
}

pub(crate) fn hostile() -> impl Strategy<Value = Hostile> {
    let region_list = prop_oneof![
        3 => Just(RegionList::Derived),
        1 => proptest::collection::vec((edge_u64(), edge_u64(), 0u8..=2), 0..6).prop_map(RegionList::Listed),
        1 => edge_u32().prop_map(RegionList::Claimed),
    ];
    prop_oneof![
        2 => (
            hostile_shape(),
            region_list,
            prop_oneof![6 => Just(false), 1 => Just(true)],
            prop_oneof![4 => Just(None), 1 => small_bytes(24).prop_map(Some)],
            prop_oneof![4 => 0u8..=1, 1 => any::<u8>()],
            prop_oneof![4 => Just(64u32), 1 => edge_u32()],
            prop_oneof![4 => 0u8..=1, 1 => any::<u8>()],
            small_bytes(24),
        )
            .prop_map(|(shape, regions, one_way, machine, compression, range_pages, verify, backend)| {
                Hostile::Hello { shape, regions, one_way, machine, compression, range_pages, verify, backend }
            }),
        2 => (
            prop_oneof![3 => small_bytes(8), 1 => small_bytes(300), 1 => Just(b"slat.workload".to_vec())],
            prop_oneof![3 => 0u32..3, 1 => edge_u32()],
            prop_oneof![4 => Just(None), 1 => prop_oneof![edge_u32(), Just(MAX_STATE_BLOB + 1)].prop_map(Some)],
            small_bytes(40),
        )
            .prop_map(|(id, version, claimed, data)| Hostile::State { id, version, claimed, data }),
        1 => (prop_oneof![3 => 0u32..3, 1 => edge_u32()], prop_oneof![3 => 0u64..64, 1 => edge_u64()])
            .prop_map(|(blobs, bytes)| Hostile::StateEnd { blobs, bytes }),
        4 => (
            prop_oneof![3 => 0u64..8, 1 => edge_u64()],
            prop_oneof![3 => 0u32..4, 1 => edge_u32()],
            prop_oneof![4 => Just(None), 1 => edge_u32().prop_map(Some)],
            proptest::collection::vec(
                (prop_oneof![3 => 0u64..80, 1 => edge_u64()], entry()),
                0..6,
            ),
        )
            .prop_map(|(seq, round, claimed, entries)| Hostile::Pages { seq, round, claimed, entries }),
        2 => (prop_oneof![3 => 0u32..4, 1 => edge_u32()], edge_u64())
            .prop_map(|(round, pages)| Hostile::RoundEnd { round, pages }),
        2 => (
            edge_u64(),
            prop_oneof![4 => Just(None), 1 => edge_u32().prop_map(Some)],
            0u8..6,
        )
            .prop_map(|(first, claimed, count)| Hostile::Hashes { first, claimed, count }),
        1 => (edge_u64(), prop_oneof![2 => Just(64u32), 1 => edge_u32()])
            .prop_map(|(ranges, range_pages)| Hostile::Verify { ranges, range_pages }),
        1 => Just(Hostile::Commit),
        1 => prop_oneof![2 => 0u32..=18, 1 => edge_u32()].prop_map(|count| Hostile::Streams { count }),
        1 => (edge_u64(), edge_u32(), edge_u32())
            .prop_map(|(session, attempt, index)| Hostile::StreamHello { session, attempt, index }),
        3 => (
            wire::ty::POSTCOPY_FIRST..=wire::ty::POSTCOPY_LAST,
            prop_oneof![4 => Just(None), 1 => edge_u32().prop_map(Some)],
            proptest::collection::vec(
                (prop_oneof![3 => 0u64..80, 1 => edge_u64()], prop_oneof![3 => 0u64..80, 1 => edge_u64()]),
                0..6,
            ),
            prop_oneof![3 => 0u64..300, 1 => edge_u64()],
        )
            .prop_map(|(ty, claimed, runs, value)| Hostile::Postcopy { ty, claimed, runs, value }),
        2 => (any::<u8>(), small_bytes(80)).prop_map(|(ty, payload)| Hostile::Raw { ty, payload }),
        1 => (prop_oneof![1u8..=13, 20u8..=21, wire::ty::POSTCOPY_FIRST..=wire::ty::POSTCOPY_LAST], small_bytes(40), edge_u32())
            .prop_map(|(ty, payload, len)| Hostile::Lying { ty, payload, len }),
    ]
}

impl Hostile {
    pub(crate) fn frame(&self) -> Vec<u8> {
        match self {
            Hostile::Hello {
                shape,
                regions,
                one_way,
                machine,
                compression,
                range_pages,
                verify,
                backend,
            } => {
                let machine = machine.clone().unwrap_or_else(|| shape.encode());
                match regions {
                    RegionList::Derived | RegionList::Listed(_) => wire::hello_payload(
                        9,
                        1,
                        *one_way,
                        &region_list(regions, shape),
                        &machine,
                        *compression,
                        *range_pages,
                        *verify,
                        backend,
                    )
                    .frame(ty::HELLO),
                    RegionList::Claimed(n) => short_hello(*one_way, *n),
                }
            }
            Hostile::State {
                id,
                version,
                claimed,
                data,
            } => Payload::default()
                .text(id)
                .u32(*version)
                .u32(claimed.unwrap_or(data.len() as u32))
                .bytes(data)
                .frame(ty::STATE),
            Hostile::StateEnd { blobs, bytes } => Payload::default()
                .u32(*blobs)
                .u64(*bytes)
                .frame(ty::STATE_END),
            Hostile::Pages {
                seq,
                round,
                claimed,
                entries,
            } => pages_frame(*seq, *round, *claimed, entries),
            Hostile::RoundEnd { round, pages } => Payload::default()
                .u32(*round)
                .u64(*pages)
                .frame(ty::ROUND_END),
            Hostile::Hashes {
                first,
                claimed,
                count,
            } => hashes_frame(*first, *claimed, *count),
            Hostile::Verify {
                ranges,
                range_pages,
            } => Payload::default()
                .u64(*ranges)
                .u32(*range_pages)
                .frame(ty::VERIFY),
            Hostile::Commit => Payload::default().frame(ty::COMMIT),
            Hostile::Streams { count } => Payload::default().u32(*count).frame(ty::STREAMS),
            Hostile::StreamHello {
                session,
                attempt,
                index,
            } => Payload::default()
                .u64(*session)
                .u32(*attempt)
                .u32(*index)
                .frame(ty::STREAM_HELLO),
            Hostile::Postcopy {
                ty,
                claimed,
                runs,
                value,
            } => postcopy_frame(*ty, *claimed, runs, *value),
            Hostile::Raw { ty, payload } => wire::seal(*ty, payload),
            Hostile::Lying { ty, payload, len } => wire::seal_len(*ty, payload, *len),
        }
    }
}

/// A hello's region list: the one listed, or one derived from `shape` (equal slots, at most
/// 64, with wrapping arithmetic so hostile shapes still make a list).
pub(crate) fn region_list(regions: &RegionList, shape: &Shape) -> Vec<Region> {
    match regions {
        RegionList::Listed(l) => l
            .iter()
            .map(|&(gpa, pages, ro)| Region {
                gpa: slat_addr::Gpa::new(gpa),
                pages,
                read_only: ro == 1,
            })
            .collect(),
        _ => {
            let pages = shape.bytes_per_vcpu.wrapping_mul(shape.vcpus as u64) / 4096;
            let pps = pages / shape.slots.max(1) as u64;
            (0..shape.slots.min(64) as u64)
                .map(|s| Region {
                    gpa: slat_addr::Gpa::new(s.wrapping_mul(pps).wrapping_mul(4096)),
                    pages: pps,
                    read_only: false,
                })
                .collect()
        }
    }
}

/// A hello with its fixed fields, then a region count `n` with fewer entries than it says.
pub(crate) fn short_hello(one_way: bool, n: u32) -> Vec<u8> {
    Payload::default()
        .u64(9)
        .u32(1)
        .u8(one_way as u8)
        .u32(n)
        .u64(0)
        .u64(1)
        .u8(0)
        .frame(ty::HELLO)
}

/// A hashes frame of `count` hashes, its count `claimed` when given (a lie) or true.
pub(crate) fn hashes_frame(first: u64, claimed: Option<u32>, count: u8) -> Vec<u8> {
    let mut p = Payload::default()
        .u64(first)
        .u32(claimed.unwrap_or(count as u32));
    for k in 0..count {
        p = p.bytes(&[k; 32]);
    }
    p.frame(ty::HASHES)
}

/// A batch frame of `entries`, its count `claimed` when given (a lie) or true.
pub(crate) fn pages_frame(
    seq: u64,
    round: u32,
    claimed: Option<u32>,
    entries: &[(u64, Entry)],
) -> Vec<u8> {
    let mut p = Payload::default()
        .u64(seq)
        .u32(round)
        .u32(claimed.unwrap_or(entries.len() as u32));
    for (page, e) in entries {
        p = p.u64(*page);
        p = match e {
            Entry::Zero => p.u8(0),
            Entry::Raw(b) => p.u8(1).bytes(&[*b; 4096]),
            Entry::Lz4(s) => {
                let img = wire::image(1, 100, *s);
                let block = lz4_flex::block::compress(&img);
                p.u8(2).u32(block.len() as u32).bytes(&block)
            }
            Entry::Lz4Bytes(b) => p.u8(2).u32(b.len() as u32).bytes(b),
            Entry::Lz4Len(l, b) => p.u8(2).u32(*l).bytes(b),
            Entry::Delta(runs) => {
                let mut d = Vec::new();
                for &(skip, len, b) in runs {
                    d.extend(skip.to_le_bytes());
                    d.extend(len.to_le_bytes());
                    // At most a page of bytes: a run longer than that is cut short.
                    d.extend(std::iter::repeat_n(b, (len as usize).min(4096)));
                }
                p.u8(3).u32(d.len() as u32).bytes(&d)
            }
            Entry::DeltaLen(l, b) => p.u8(3).u32(*l).bytes(b),
            Entry::Encoding(x) => p.u8(*x),
        };
    }
    p.frame(ty::PAGES)
}

/// A post-copy frame of type `t`: runs (discard, lacking), pages (request), or one value
/// (run, end, lacking end with a flag, preempt with an attempt); `claimed` lies about the
/// count.
pub(crate) fn postcopy_frame(
    t: u8,
    claimed: Option<u32>,
    runs: &[(u64, u64)],
    value: u64,
) -> Vec<u8> {
    let n = claimed.unwrap_or(runs.len() as u32);
    let p = Payload::default();
    match t {
        32 | 37 => runs
            .iter()
            .fold(p.u32(n), |p, &(a, len)| p.u64(a).u64(len))
            .frame(t),
        34 => runs.iter().fold(p.u32(n), |p, &(a, _)| p.u64(a)).frame(t),
        36 => p.frame(t),
        38 => p.u64(value).u8((value % 3) as u8).frame(t),
        39 => p.u64(value).u32(n).frame(t),
        _ => p.u64(value).frame(t),
    }
}
