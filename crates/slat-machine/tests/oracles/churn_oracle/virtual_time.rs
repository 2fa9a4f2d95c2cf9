//! The churn oracle in virtual time: the same test bodies on each format with the virtual
//! clock (`Timed<F, slat_vt::Virtual>`), as `virtual_time::ept::…` and
//! `virtual_time::stage2::…`, and the check that a seed replays the same round.

use super::*;
use std::process::Command;

/// A round with every kind of churn and four vCPUs, from `seed` (its write-protect variant
/// too, or `SLAT_TEST_WRPROT`'s): what the determinism test replays. Until the models forgot
/// freed blocks (slat-vt's `freed.rs`), the same seed gave different rounds in fresh
/// processes: a block allocated where another had been freed inherited its lines' history,
/// and which addresses came back depended on the heap (the thread's malloc arena).
fn busy_round<F: PteFormat>(seed: u64) -> RoundCfg {
    let mut cfg = RoundCfg::random::<F>(seed, Duration::MAX);
    cfg.vcpus = 4;
    cfg.churn = Churn {
        toggle: true,
        zap: true,
        age: true,
        aux: true,
        move_checked: true,
        ro_slots: true,
    };
    cfg
}

/// What [`replay_one_round`] prints before the round's counters.
const REPLAY_MARK: &str = "churn-replay: ";

/// Virtual time is deterministic: a round with every kind of churn, run from the same seed in
/// two fresh processes, does the same: every counter of the host, the churn thread and the
/// vCPUs, the virtual time it took, and the simulation's scheduler calls and baton switches.
///
/// Fresh processes, whose heaps and address spaces differ; each also runs the round twice
/// in itself, the second time on the heap the first left ([`replay_one_round`]). `test` is
/// [`replay_one_round`]'s name for this format.
fn the_same_seed_replays_the_same_round<F: PteFormat>(test: &str) {
    let _serial = lock(&SERIAL);
    let (seed, name) = (base_seed(), run_name::<F>());
    let cfg = busy_round::<F>(seed);
    let replay = || {
        let exe = std::env::current_exe().expect("the test binary");
        let out = Command::new(exe)
            .args([
                test,
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("SLAT_TEST_SEED", format!("{seed:#x}"))
            .output()
            .expect("the test binary runs");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let counters = stdout
            .lines()
            .find_map(|l| l.split_once(REPLAY_MARK).map(|p| p.1))
            .map(str::to_string);
        match (out.status.success(), counters) {
            (true, Some(c)) => c,
            _ => panic!(
                "churn_oracle[{name}]: the replay of SLAT_TEST_SEED={seed:#x} failed ({}):\n{stdout}\n{}\n  config: {cfg}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            ),
        }
    };
    let (a, b) = (replay(), replay());
    assert_eq!(
        a, b,
        "churn_oracle[{name}]: the same round twice differs (SLAT_TEST_SEED={seed:#x}; config: {cfg})"
    );
    println!("churn_oracle[{name}] seed={seed:#x}: the same twice: {a}");
}

/// One [`busy_round`] of `SLAT_TEST_SEED`, its counters printed after [`REPLAY_MARK`] (run by
/// [`the_same_seed_replays_the_same_round`] in a process of its own).
fn replay_one_round<F: PteFormat>() {
    let _serial = lock(&SERIAL);
    let seed = base_seed();
    let cfg = busy_round::<F>(seed);
    let round = || {
        run_round::<F>(&cfg, 0).unwrap_or_else(|f| {
            panic!(
                "churn_oracle[{}]: {f}\n  SLAT_TEST_SEED={seed:#x}\n  config: {cfg}",
                run_name::<F>()
            )
        })
    };
    let first = round();
    assert!(first.sim.hooks > 0, "not a simulation");
    let out = format!("{first:?}");
    let again = format!("{:?}", round());
    assert_eq!(
        out, again,
        "churn_oracle[{}]: the same round twice in one process differs (SLAT_TEST_SEED={seed:#x}; config: {cfg})",
        run_name::<F>()
    );
    println!("{REPLAY_MARK}{out}");
}

macro_rules! in_virtual_time {
    ($module:ident: $fmt:ident) => {
        mod $module {
            type F = slat::Timed<slat::$fmt, slat_vt::Virtual>;

            #[test]
            fn no_page_is_lost_under_random_churn() {
                super::no_page_is_lost_under_random_churn::<F>()
            }

            #[test]
            fn a_harvest_without_its_flush_is_caught_under_churn() {
                super::a_harvest_without_its_flush_is_caught_under_churn::<F>()
            }

            #[test]
            fn the_same_seed_replays_the_same_round() {
                // The test's name without the binary's.
                let path = module_path!().split_once("::").map_or("", |p| p.1);
                super::the_same_seed_replays_the_same_round::<F>(&format!(
                    "{path}::replay_one_round"
                ))
            }

            #[test]
            #[ignore = "the determinism test runs it, in a process of its own"]
            fn replay_one_round() {
                super::replay_one_round::<F>()
            }
        }
    };
}

in_virtual_time!(ept: Ept);
in_virtual_time!(stage2: Stage2);
