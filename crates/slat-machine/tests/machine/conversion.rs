//! The conversion test (`slat_machine::conversion`): every policy passes with no violation,
//! the rules it checks are real (a broken engine is caught: conversions that skip their zap,
//! `inject::SKIP_CONVERSION_ZAP`), and bad sizes are refused.

use slat::direct_map::DirectMapConfig;
use slat::DirectMapPolicy;
use slat_machine::conversion::{run_conversion_test, ConversionParams};

fn params(policy: DirectMapPolicy, kernel_flush: bool, collapse: bool) -> ConversionParams {
    ConversionParams {
        vcpus: 2,
        bytes_per_vcpu: 4 << 20,
        direct_map: DirectMapConfig {
            policy,
            kernel_flush,
            collapse,
        },
        rounds: 2,
        seed: 0xc0ffee,
    }
}

#[test]
fn every_policy_keeps_the_rules() {
    for policy in DirectMapPolicy::ALL.iter().copied() {
        for (flush, collapse) in [(true, true), (false, false)] {
            let r = run_conversion_test(params(policy, flush, collapse)).unwrap();
            assert_eq!(
                r.violations, 0,
                "{policy} flush={flush}: {:#?}",
                r.first_violations
            );
            let pages = 2 * 2 * 1024; // rounds x pages of both vCPUs
            assert_eq!(
                r.accepted, pages,
                "{policy}: every page accepted once per round"
            );
            assert!(r.to_private > 10 && r.to_private == r.to_shared, "{r:?}");
            assert_eq!(r.bytes_converted, 2 * pages * 4096);
            assert!(r.memory_fault_exits >= 2 * r.to_private, "{r:?}");
            assert!(r.host_reads > 0 && r.convert_gib_per_s > 0.0, "{r:?}");
            assert_eq!(
                r.host_isolation_checked,
                policy != DirectMapPolicy::Untouched
            );
            if policy == DirectMapPolicy::Split2M {
                assert!(r.splits > 0, "{r:?}");
                assert_eq!(r.collapses > 0, collapse, "{r:?}");
            }
        }
    }
}

#[test]
fn bad_sizes_are_refused() {
    for (vcpus, bytes) in [
        (0, 4096),
        (513, 4096),
        (usize::MAX, 4096),
        (1, 0),
        (1, 4097),
        (2, !4095),
    ] {
        let mut p = params(DirectMapPolicy::Pre4K, false, false);
        p.vcpus = vcpus;
        p.bytes_per_vcpu = bytes;
        assert!(
            matches!(
                run_conversion_test(p),
                Err(slat_machine::MachineError::Config(_))
            ),
            "{vcpus} x {bytes}"
        );
    }
}
