//! The `--help` of `slat` and of every subcommand against its snapshot in `tests/help/`: a
//! flag added, removed or redocumented without its snapshot (and so its docs) fails here.
//! After a deliberate change, rewrite the snapshots with `SNAPSHOTS=overwrite cargo test
//! --profile ci -p slat-cli --test cli help::` and review the diff.

use snapbox::cmd::Command;
use std::path::Path;

const SUBCOMMANDS: [&str; 14] = [
    "demand-paging",
    "dirty-log-perf",
    "dirty-log-test",
    "access-tracking-perf",
    "page-table-test",
    "migrate",
    "migrate-listen",
    "migrate-perf",
    "snapshot-perf",
    "dirty-rate",
    "private-mem-perf",
    "private-mem-test",
    "reproduce",
    "calibrate",
];

fn check(args: &[&str], snapshot: &str) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/help")
        .join(format!("{snapshot}.txt"));
    Command::new(env!("CARGO_BIN_EXE_slat"))
        .args(args)
        // Help wraps at the terminal's width; a fixed one keeps the snapshots stable.
        .env("COLUMNS", "100")
        .assert()
        .success()
        .stdout_eq(snapbox::Data::read_from(&path, None));
}

#[test]
fn the_top_level_help_matches_its_snapshot() {
    check(&["--help"], "slat");
}

#[test]
fn every_subcommand_help_matches_its_snapshot() {
    for sub in SUBCOMMANDS {
        check(&[sub, "--help"], sub);
    }
}

/// Every subcommand has a snapshot, and every snapshot a subcommand.
#[test]
fn the_snapshots_cover_every_subcommand() {
    let out = Command::new(env!("CARGO_BIN_EXE_slat"))
        .arg("--help")
        .output()
        .expect("slat --help");
    let text = String::from_utf8_lossy(&out.stdout);
    let listed: Vec<&str> = text
        .lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        // A command's name is indented by two; its wrapped description by more.
        .filter(|l| !l[2..].starts_with(' '))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .collect();
    assert_eq!(listed, SUBCOMMANDS, "{text}");
}
