//! Error paths: bad configurations (checked before KVM is opened, so these run everywhere),
//! a missing device, host limits, and misuse of the dirty-log calls.

use crate::common;

use common::{kvm_unavailable, machine_or_skip};
use slat_dirty::DirtyLogSource;
use slat_dirty::Error;
use slat_kvm::{KvmConfig, KvmError, KvmMachine};
use slat_workload::TestMachine;
use slat_workload::{DirtyConfig, PassParams, RegionSpec, INITIALLY_SET, MANUAL_PROTECT_ENABLE};

fn config_error(c: KvmConfig) -> String {
    match KvmMachine::new(c) {
        Err(KvmError::Config(m)) => m,
        Err(e) => panic!("expected a configuration error, got {e}"),
        Ok(_) => panic!("expected a configuration error, got a machine"),
    }
}

#[test]
fn bad_sizes_are_refused() {
    let base = KvmConfig {
        region: RegionSpec {
            bytes_per_vcpu: 1 << 20,
            ..RegionSpec::default()
        },
        ..KvmConfig::default()
    };
    let m = config_error(KvmConfig {
        region: RegionSpec {
            bytes_per_vcpu: 0,
            ..base.region
        },
        ..base.clone()
    });
    assert!(m.contains("multiple of 4 KiB"), "{m}");
    let m = config_error(KvmConfig {
        region: RegionSpec {
            bytes_per_vcpu: 4097,
            ..base.region
        },
        ..base.clone()
    });
    assert!(m.contains("multiple of 4 KiB"), "{m}");
    let m = config_error(KvmConfig {
        region: RegionSpec {
            vcpus: 0,
            ..base.region
        },
        ..base.clone()
    });
    assert!(m.contains("vCPU"), "{m}");
    let m = config_error(KvmConfig {
        region: RegionSpec {
            slots: 3,
            ..base.region
        },
        ..base.clone()
    });
    assert!(m.contains("3 memslots"), "{m}");
    let m = config_error(KvmConfig {
        region: RegionSpec {
            vcpus: usize::MAX,
            bytes_per_vcpu: 1 << 30,
            ..base.region
        },
        ..base.clone()
    });
    assert!(m.contains("overflows"), "{m}");
}

#[test]
fn bad_dirty_configurations_are_refused() {
    let base = KvmConfig {
        region: RegionSpec {
            bytes_per_vcpu: 1 << 20,
            ..RegionSpec::default()
        },
        ..KvmConfig::default()
    };
    for ring in [100, 128, 3000] {
        let m = config_error(KvmConfig {
            region: RegionSpec {
                dirty: DirtyConfig {
                    ring_entries: ring,
                    manual_protect: 0,
                    ..DirtyConfig::default()
                },
                ..base.region
            },
            ..base.clone()
        });
        assert!(m.contains("power of two"), "{m}");
    }
    let m = config_error(KvmConfig {
        region: RegionSpec {
            dirty: DirtyConfig {
                ring_entries: 0,
                manual_protect: INITIALLY_SET,
                ..DirtyConfig::default()
            },
            ..base.region
        },
        ..base.clone()
    });
    assert!(m.contains("MANUAL_PROTECT_ENABLE"), "{m}");
    let m = config_error(KvmConfig {
        region: RegionSpec {
            dirty: DirtyConfig {
                ring_entries: 1024,
                manual_protect: MANUAL_PROTECT_ENABLE,
                ..DirtyConfig::default()
            },
            ..base.region
        },
        ..base
    });
    assert!(m.contains("ring"), "{m}");
}

#[test]
fn missing_device_names_it_and_the_fix() {
    let e = KvmMachine::new(KvmConfig {
        region: RegionSpec {
            bytes_per_vcpu: 1 << 20,
            ..RegionSpec::default()
        },
        device: "/nonexistent/kvm".into(),
        ..KvmConfig::default()
    })
    .err()
    .expect("no such device");
    let msg = e.to_string();
    assert!(matches!(e, KvmError::DeviceUnavailable { .. }), "{msg}");
    assert!(
        msg.contains("/nonexistent/kvm") && msg.contains("modprobe"),
        "{msg}"
    );
}

#[test]
fn device_that_is_not_kvm_is_reported() {
    // A plain file opens, but is not KVM: the first KVM ioctl fails with a typed error.
    let path = std::env::temp_dir().join(format!("slat-kvm-not-kvm-{}", std::process::id()));
    std::fs::write(&path, b"not kvm").unwrap();
    let e = KvmMachine::new(KvmConfig {
        region: RegionSpec {
            bytes_per_vcpu: 1 << 20,
            ..RegionSpec::default()
        },
        device: path.to_string_lossy().into_owned(),
        ..KvmConfig::default()
    })
    .err()
    .expect("a plain file is not KVM");
    let _ = std::fs::remove_file(&path);
    assert!(matches!(e, KvmError::Ioctl { .. }), "{e}");
}

#[test]
fn ring_larger_than_the_host_allows_is_unsupported() {
    if kvm_unavailable() {
        return;
    }
    let caps = slat_kvm::host_caps(slat_kvm::DEFAULT_DEVICE).unwrap();
    // Twice the host's largest ring (or any ring, on a host without one).
    let entries = if caps.dirty_ring_max_bytes == 0 {
        4096
    } else {
        caps.dirty_ring_max_bytes / 16 * 2
    };
    let e = KvmMachine::new(KvmConfig {
        region: RegionSpec {
            bytes_per_vcpu: 1 << 20,
            dirty: DirtyConfig {
                ring_entries: entries,
                manual_protect: 0,
                ..DirtyConfig::default()
            },
            ..RegionSpec::default()
        },
        ..KvmConfig::default()
    })
    .err()
    .expect("ring too large");
    let msg = e.to_string();
    assert!(matches!(e, KvmError::Unsupported { .. }), "{msg}");
    assert!(
        msg.starts_with("KVM_CAP_DIRTY_LOG_RING not supported by this host kernel"),
        "{msg}"
    );
}

#[test]
fn too_much_memory_for_the_guest_address_space_is_refused() {
    if kvm_unavailable() {
        return;
    }
    // 1 TiB does not fit below 2^39; the check comes before any memory is mapped.
    let m = config_error(KvmConfig {
        region: RegionSpec {
            vcpus: 2,
            bytes_per_vcpu: 512 << 30,
            ..RegionSpec::default()
        },
        ..KvmConfig::default()
    });
    assert!(m.contains("physical address limit"), "{m}");
}

#[test]
fn dirty_log_misuse_is_refused() {
    let Some(m) = machine_or_skip(KvmConfig {
        region: RegionSpec {
            bytes_per_vcpu: 1 << 20,
            ..RegionSpec::default()
        },
        ..KvmConfig::default()
    }) else {
        return;
    };
    let words = m.pages_per_slot().div_ceil(64) as usize;
    let mut buf = vec![0u64; words];
    // Logging off.
    assert!(matches!(
        m.dirty_log().get_log(0, &mut buf),
        Err(KvmError::DirtyLog(_))
    ));
    m.set_dirty_logging(true).unwrap();
    // A slot index past the test region's one memslot, short bitmap.
    assert!(matches!(
        m.dirty_log().get_log(1, &mut buf),
        Err(KvmError::Config(_))
    ));
    assert!(matches!(
        m.dirty_log().get_log(usize::MAX, &mut buf),
        Err(KvmError::Config(_))
    ));
    assert!(matches!(
        m.dirty_log().get_log(0, &mut buf[..words - 1]),
        Err(KvmError::Dirty(Error::BitmapLength { .. }))
    ));
    m.dirty_log().get_log(0, &mut buf).unwrap();
    // CLEAR without manual protect, ring ops without rings.
    assert!(matches!(
        m.dirty_log()
            .clear_log(0, slat_addr::PageIndex::new(0), 64, &buf),
        Err(KvmError::DirtyLog(_))
    ));
    assert!(matches!(
        m.dirty_log().reset_rings(),
        Err(KvmError::DirtyLog(_))
    ));
    assert_eq!(m.dirty_log().collect_ring(&mut |_, _| {}).unwrap(), 0);
    // Out-of-range pass parameters.
    assert!(matches!(
        m.run_pass(PassParams {
            write_percent: 101,
            ..PassParams::default()
        }),
        Err(KvmError::Config(_))
    ));
    // The machine still works.
    m.run_pass(PassParams::default()).unwrap();
}

#[test]
fn machine_can_be_shared_between_threads() {
    fn shareable<T: Send + Sync>() {}
    shareable::<KvmMachine>();
    shareable::<KvmError>();
}

#[test]
fn kvm_statistics_count_the_sync_exits() {
    let Some(m) = machine_or_skip(KvmConfig {
        region: RegionSpec {
            vcpus: 2,
            bytes_per_vcpu: 1 << 20,
            ..RegionSpec::default()
        },
        ..KvmConfig::default()
    }) else {
        return;
    };
    let before = match m.vcpu_stats(None) {
        Ok(s) => s,
        Err(e @ KvmError::Unsupported { .. }) => {
            eprintln!("skipping: {e}");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    m.run_pass(PassParams::default()).unwrap();
    m.run_pass(PassParams::default()).unwrap();
    let d = slat_kvm::stats::delta(&before, &m.vcpu_stats(None).unwrap());
    let exits = d.iter().find(|s| s.name == "exits").map(|s| s.value);
    // Two passes on two vCPUs: at least the four sync exits.
    assert!(exits.is_some_and(|e| e >= 4), "{d:?}");
    assert!(m.vm_stats().unwrap().iter().any(|s| s.name.contains("tlb")));
    assert!(m.vcpu_stats(Some(2)).is_err());
}
