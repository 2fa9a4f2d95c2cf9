//! Valid streams to start from: synthetic ones, and one recorded from a real source.

use super::*;
use slat_addr::PageIndex;

/// A small guest for a synthetic stream.
#[derive(Debug, Clone)]
pub(crate) struct Synth {
    pub(crate) vcpus: u32,
    pub(crate) pages_per_vcpu: u64,
    /// Index into the divisors of the page count: the memslot count.
    pub(crate) slot_pick: usize,
    pub(crate) lz4: bool,
    pub(crate) batch: usize,
    /// Rounds after the first, each resending pages chosen by these seeds.
    pub(crate) resend: Vec<u64>,
    pub(crate) fill: u64,
    pub(crate) seed: u64,
}

impl Synth {
    pub(crate) fn shape(&self) -> Shape {
        let pages = self.pages_per_vcpu * self.vcpus as u64;
        let divisors: Vec<u64> = (1..=pages).filter(|d| pages % d == 0).collect();
        Shape {
            vcpus: self.vcpus,
            bytes_per_vcpu: self.pages_per_vcpu * 4096,
            slots: divisors[self.slot_pick % divisors.len()] as u32,
            overlap: self.seed % 2 == 0,
        }
    }

    pub(crate) fn stream(&self) -> ValidStream {
        let shape = self.shape();
        let pages = self.pages_per_vcpu * self.vcpus as u64;
        let img = wire::image(pages, self.fill, self.seed);
        let resend: Vec<Vec<u64>> = self
            .resend
            .iter()
            .map(|&s| (0..pages).filter(|p| splitmix(s ^ p) % 3 == 0).collect())
            .collect();
        let comp = if self.lz4 {
            Compression::Lz4
        } else {
            Compression::None
        };
        wire::valid_stream(shape, &img, comp, self.batch, &resend)
    }
}

pub(crate) fn synth() -> impl Strategy<Value = Synth> {
    (
        1u32..=3,
        1u64..=24,
        0usize..8,
        any::<bool>(),
        1usize..=40,
        proptest::collection::vec(any::<u64>(), 0..=2),
        0u64..=100,
        any::<u64>(),
    )
        .prop_map(
            |(vcpus, pages_per_vcpu, slot_pick, lz4, batch, resend, fill, seed)| Synth {
                vcpus,
                pages_per_vcpu,
                slot_pick,
                lz4,
                batch,
                resend,
                fill,
                seed,
            },
        )
}

/// A stream recorded from a real source migrating a running guest (once per test binary).
pub(crate) fn recorded() -> &'static ValidStream {
    static R: OnceLock<ValidStream> = OnceLock::new();
    R.get_or_init(record)
}

/// Migrates a small running guest through a recording proxy to a destination; returns the
/// source's bytes and the memory it left.
pub(crate) fn record() -> ValidStream {
    let shape = Shape {
        vcpus: 2,
        bytes_per_vcpu: 64 << 10,
        slots: 2,
        overlap: false,
    };
    let g = common::source_guest(migrate::BackendKind::Sim, shape, LogMode::Clear);
    let mut src = common::start_source(
        &g,
        common::work(5_000),
        SourceConfig {
            batch_pages: 7,
            compression: Compression::Lz4,
            ..common::source_config()
        },
    );
    let (dest_addr, dest) = common::spawn_dest(
        Destination::new(
            common::factory(migrate::BackendKind::Sim),
            common::dest_config(),
        ),
        1,
    );
    let proxy = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
    let proxy_addr = proxy.local_addr().unwrap().to_string();
    let tape = Arc::new(Mutex::new(Vec::new()));
    let t = tape.clone();
    let p = std::thread::spawn(move || {
        let (mut from_src, _) = proxy.accept().expect("source connects");
        let mut to_dest = TcpStream::connect(&dest_addr).expect("connect to the destination");
        let (mut back_from, mut back_to) =
            (to_dest.try_clone().unwrap(), from_src.try_clone().unwrap());
        let back = std::thread::spawn(move || {
            let _ = std::io::copy(&mut back_from, &mut back_to);
            let _ = back_to.shutdown(Shutdown::Write);
        });
        let mut buf = vec![0u8; 64 << 10];
        loop {
            match from_src.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    t.lock().unwrap().extend_from_slice(&buf[..n]);
                    if to_dest.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            }
        }
        let _ = to_dest.shutdown(Shutdown::Write);
        let _ = back.join();
    });
    src.migrate(&proxy_addr, &mut |_| {})
        .expect("the recorded migration succeeds");
    let (results, _) = dest.join().expect("destination thread");
    assert!(results.last().is_some_and(|r| r.is_ok()), "{results:?}");
    let _ = p.join();
    let mem = Memory::new(g.as_dyn()).expect("memory map");
    let image = mem
        .stopped_range(PageIndex::new(0), PageIndex::new(mem.pages()))
        .expect("source memory")
        .to_vec();
    let bytes = tape.lock().unwrap().clone();
    let (preamble, frames) = wire::split(&bytes);
    ValidStream {
        preamble,
        frames,
        image,
    }
}

#[derive(Debug, Clone)]
pub(crate) enum Base {
    Synthetic(Synth),
    Recorded,
}

impl Base {
    pub(crate) fn stream(&self) -> ValidStream {
        match self {
            Base::Synthetic(s) => s.stream(),
            Base::Recorded => recorded().clone(),
        }
    }
}

pub(crate) fn base() -> impl Strategy<Value = Base> {
    prop_oneof![
        4 => synth().prop_map(Base::Synthetic),
        1 => Just(Base::Recorded),
    ]
}
