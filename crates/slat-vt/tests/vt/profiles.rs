//! The shipped cost profiles (`profiles/*.toml`): each parses and validates, every number has
//! a non-empty source saying where it came from, and the built-in profile is this host's
//! calibrated file.

use slat_vt::Profile;
use std::path::Path;

fn shipped() -> Vec<(String, Profile)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("profiles");
    let mut out = Vec::new();
    for entry in std::fs::read_dir(&dir).expect("profiles/") {
        let path = entry.expect("a directory entry").path();
        if path.extension().and_then(|e| e.to_str()) != Some("toml") {
            continue;
        }
        let p = Profile::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        out.push((path.display().to_string(), p));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

#[test]
fn every_shipped_profile_parses_validates_and_has_sources() {
    let all = shipped();
    assert!(!all.is_empty(), "no profile shipped");
    for (file, p) in &all {
        assert!(!p.name.trim().is_empty(), "{file}: no name");
        for (name, e) in &p.costs {
            assert!(
                !e.source.trim().is_empty(),
                "{file}: costs.{name} has no source"
            );
        }
        let m = &p.model;
        for (name, e) in [
            ("rmw_local", &m.rmw_local),
            ("line_transfer", &m.line_transfer),
            ("invalidate", &m.invalidate),
            ("dram_miss", &m.dram_miss),
            ("handoff", &m.handoff),
            ("fair_every", &m.fair_every),
            ("retention", &m.retention),
            ("ipi_latency", &m.ipi_latency),
            ("lookahead", &m.lookahead),
        ] {
            assert!(
                !e.source.trim().is_empty(),
                "{file}: model.{name} has no source"
            );
        }
        if let Some(e) = &m.dram_stream {
            assert!(
                !e.source.trim().is_empty(),
                "{file}: model.dram_stream has no source"
            );
        }
        assert!(
            !m.lock_policy.source.trim().is_empty(),
            "{file}: lock_policy"
        );
    }
}

#[test]
fn the_built_in_profile_is_the_calibrated_host_file() {
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("profiles/host-2core-nested.toml");
    let p = Profile::load(&file).expect("the host profile");
    assert_eq!(Profile::host_default(), p);
    assert_eq!(p.name, "host-2core-nested");
    assert!(p
        .costs
        .values()
        .all(|e| e.source.starts_with("slat calibrate:") || e.source.starts_with("proxy:")));
}
