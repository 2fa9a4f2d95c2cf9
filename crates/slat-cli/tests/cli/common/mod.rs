//! Running the `slat` binary from the CLI tests.

#![allow(dead_code)] // each test file uses what it needs

pub mod schema;

use serde_json::Value;
use std::process::Command;

/// Runs `slat args`; returns (exit status, stdout, stderr), status -1 if killed by a signal.
pub fn slat(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_slat"))
        .args(args)
        .output()
        .expect("run slat");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs `args`, expects success, returns stdout.
pub fn ok(args: &[&str]) -> String {
    let (code, out, err) = slat(args);
    assert_eq!(code, 0, "slat {}:\n{out}\n{err}", args.join(" "));
    out
}

/// Runs `args` with `--json`, expects success and exactly one JSON document.
pub fn json(args: &[&str]) -> Value {
    let mut v = args.to_vec();
    v.push("--json");
    let out = ok(&v);
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("slat {}: {e}\n{out}", v.join(" ")))
}
