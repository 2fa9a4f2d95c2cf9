//! The commands of the README and the user guides run as a reader would run them.
//!
//! Every line of every `sh` block in README.md and docs/guide-*.md is either a `slat …`
//! command (or `cargo run -p slat-cli -- …`, the same binary), run here in a scratch directory
//! and required to succeed, or a command listed in [`NOT_RUN_HERE`] with the reason. A line
//! that is neither fails the test, so a guide cannot gain a command nobody runs.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Commands the docs show that this test does not run, and why. Matched as line prefixes.
const NOT_RUN_HERE: &[(&str, &str)] = &[
    (
        "cargo test --workspace --profile ci",
        "the test command itself (.ci/run runs it)",
    ),
    (
        "cargo install --path crates/slat-cli",
        "installs the release binary into ~/.cargo/bin; this test runs the binary cargo built for it",
    ),
    (
        "cargo run --release -p slat-migrate --example minimal_vmm",
        "run by crates/slat-migrate/tests/migrate/example_vmm.rs",
    ),
    (
        "cargo run --release -p slat-dirty --example vmm",
        "a cargo build of another package; the example's harvest and reset are the crate's doctest and tests/dirty/kvm_snapshot.rs",
    ),
];

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The documents whose commands are checked.
fn documents() -> Vec<PathBuf> {
    let root = repo_root();
    let mut docs = vec![root.join("README.md")];
    let mut guides: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .expect("docs/")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("guide-") && n.ends_with(".md"))
        })
        .collect();
    guides.sort();
    docs.extend(guides);
    docs
}

/// The lines of the `sh` blocks of `text`, with their line numbers, comments and blank lines
/// dropped.
fn sh_lines(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut in_sh = false;
    for (n, line) in text.lines().enumerate() {
        let t = line.trim();
        if t.starts_with("```") {
            in_sh = !in_sh && t == "```sh";
            continue;
        }
        if !in_sh {
            continue;
        }
        let cmd = t.split(" # ").next().unwrap_or("").trim();
        let cmd = cmd.strip_suffix('#').unwrap_or(cmd).trim();
        if !cmd.is_empty() && !cmd.starts_with('#') {
            out.push((n + 1, cmd.to_string()));
        }
    }
    out
}

/// The `slat` arguments of a command line, or `None` if it is not a `slat` command.
fn slat_args(cmd: &str) -> Option<Vec<String>> {
    let words: Vec<String> = cmd.split_whitespace().map(String::from).collect();
    if words.first().map(String::as_str) == Some("slat") {
        return Some(words[1..].to_vec());
    }
    let is_cli_run =
        words.len() > 2 && words[0] == "cargo" && words[1] == "run" && cmd.contains("-p slat-cli");
    if is_cli_run {
        let sep = words.iter().position(|w| w == "--")?;
        return Some(words[sep + 1..].to_vec());
    }
    None
}

#[test]
fn every_command_of_the_readme_and_guides_runs() {
    let scratch = std::env::temp_dir().join(format!("slat-docs-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).expect("scratch dir");
    let mut ran = 0;
    for doc in documents() {
        let text = std::fs::read_to_string(&doc).expect("read doc");
        for (line, cmd) in sh_lines(&text) {
            let place = format!("{}:{line}", doc.display());
            if let Some((_, why)) = NOT_RUN_HERE.iter().find(|(p, _)| cmd.starts_with(p)) {
                eprintln!("{place}: not run here ({why}): {cmd}");
                continue;
            }
            let Some(args) = slat_args(&cmd) else {
                panic!("{place}: `{cmd}` is neither a slat command nor listed in NOT_RUN_HERE with a reason");
            };
            eprintln!("{place}: slat {}", args.join(" "));
            let out = Command::new(env!("CARGO_BIN_EXE_slat"))
                .args(&args)
                .current_dir(&scratch)
                .output()
                .expect("run slat");
            assert!(
                out.status.success(),
                "{place}: `{cmd}` exited {:?}\nstdout:\n{}\nstderr:\n{}",
                out.status.code(),
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            ran += 1;
        }
    }
    let _ = std::fs::remove_dir_all(&scratch);
    assert!(ran >= 5, "only {ran} documented commands ran");
}

#[test]
fn every_exception_is_still_in_a_document() {
    let all: Vec<String> = documents()
        .iter()
        .flat_map(|d| sh_lines(&std::fs::read_to_string(d).expect("read doc")))
        .map(|(_, c)| c)
        .collect();
    for (prefix, _) in NOT_RUN_HERE {
        assert!(
            all.iter().any(|c| c.starts_with(prefix)),
            "NOT_RUN_HERE lists `{prefix}`, which no document shows any more"
        );
    }
}
