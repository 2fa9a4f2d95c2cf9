//! slat's own guests over the other transports: the simulated machine over a UNIX socket and
//! into a file and back, and a `/dev/kvm` guest snapshotted into a file and restored on the
//! simulated machine (skipped, saying so, without /dev/kvm).

use crate::common;

use common::*;
use slat_harness::migrate::{BackendKind, LogMode};
use slat_migrate::transport::{Endpoint, Listener};
use slat_migrate::Destination;
use std::time::Duration;

fn temp(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("slat-transports-{}-{name}", std::process::id()))
}

fn over(backend: BackendKind, to: Endpoint) {
    let g = source_guest(backend, shape(4), LogMode::Clear);
    let mut src = start_source(
        &g,
        work(if backend == BackendKind::Kvm {
            0
        } else {
            5_000
        }),
        source_config(),
    );
    std::thread::sleep(Duration::from_millis(20));
    let file = matches!(to, Endpoint::File(_));
    let serve = |mut l: Listener| {
        move || {
            let c = l.accept(Duration::from_secs(10)).unwrap();
            let mut d = Destination::new(factory(BackendKind::Sim), dest_config());
            d.serve_channel(c).map(|r| (r, d))
        }
    };
    let (r, (d, dest)) = if file {
        // A snapshot: written whole, then read back.
        let r = src.migrate_to(&to, &mut |_| {}).unwrap();
        (r, serve(Listener::bind(&to).unwrap())().unwrap())
    } else {
        let h = std::thread::spawn(serve(Listener::bind(&to).unwrap()));
        let r = src.migrate_to(&to, &mut |_| {}).unwrap();
        (r, h.join().unwrap().unwrap())
    };
    assert_eq!(r.one_way, file);
    assert!(d.verify.ok());
    assert_eq!(d.state_blobs, 1, "the workload travels as device state");
    assert_same_memory(g.as_dyn(), &**dest.guest().unwrap());
}

#[test]
fn sim_over_a_unix_socket() {
    let p = temp("sock");
    let _ = std::fs::remove_file(&p);
    over(BackendKind::Sim, Endpoint::Unix(p));
}

#[test]
fn sim_into_a_file_and_back() {
    let p = temp("sim.snap");
    over(BackendKind::Sim, Endpoint::File(p.clone()));
    let _ = std::fs::remove_file(p);
}

#[test]
fn kvm_into_a_file_and_back_onto_sim() {
    if let Err(e) = slat_kvm::host_caps(slat_kvm::DEFAULT_DEVICE) {
        eprintln!("skipping: /dev/kvm unavailable: {e}");
        return;
    }
    let p = temp("kvm.snap");
    over(BackendKind::Kvm, Endpoint::File(p.clone()));
    let _ = std::fs::remove_file(p);
}
