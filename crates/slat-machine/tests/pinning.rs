//! `TestMachine::pin_vcpus` really sets each vCPU thread's affinity: the kernel's own view in
//! `/proc/self/task/<tid>/status` (`Cpus_allowed_list`) names the one CPU it was pinned to,
//! and a pass still runs.

use slat_machine::{Machine, MachineConfig};
use slat_workload::cpus::allowed_cpus;
use slat_workload::TestMachine;
use slat_workload::{PassParams, RegionSpec};
use std::fs;

/// `Cpus_allowed_list` of this process's thread named `name`.
fn allowed_list_of(name: &str) -> Option<String> {
    for e in fs::read_dir("/proc/self/task").ok()? {
        let dir = e.ok()?.path();
        let comm = fs::read_to_string(dir.join("comm")).unwrap_or_default();
        if comm.trim() == name {
            let status = fs::read_to_string(dir.join("status")).ok()?;
            return status
                .lines()
                .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
                .map(|v| v.trim().to_string());
        }
    }
    None
}

#[test]
fn vcpu_threads_are_pinned() {
    let cpus = allowed_cpus().expect("affinity");
    let (a, b) = (*cpus.last().unwrap(), cpus[0]);
    let m = Machine::<slat::Ept>::new(MachineConfig {
        region: RegionSpec {
            vcpus: 2,
            bytes_per_vcpu: 1 << 20,
            ..RegionSpec::default()
        },
        ..MachineConfig::default()
    })
    .expect("machine");
    let got = m.pin_vcpus(&[a, b]).expect("pin");
    assert_eq!(got, vec![vec![a], vec![b]]);
    assert_eq!(
        allowed_list_of("vcpu0").as_deref(),
        Some(a.to_string().as_str())
    );
    assert_eq!(
        allowed_list_of("vcpu1").as_deref(),
        Some(b.to_string().as_str())
    );
    let r = m.run_pass(PassParams::default()).expect("pass");
    assert_eq!(r.vcpus.iter().map(|v| v.pages).sum::<u64>(), 512);
}
