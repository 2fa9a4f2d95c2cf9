//! `slat migrate`, `migrate-listen` and `migrate-perf` through the binary, with small guests:
//! reports, JSON, one-line failures and exit codes, a cut connection resumed across
//! processes, a broken source caught by verification.

use crate::common;

use common::slat;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

/// Lines of stderr that are not progress lines.
fn errors(err: &str) -> Vec<&str> {
    err.lines().filter(|l| !l.starts_with("[slat]")).collect()
}

/// Starts `slat migrate-listen` on a free port; returns the child and its address.
fn listen(extra: &[&str]) -> (Child, String, BufReader<std::process::ChildStderr>) {
    let mut c = Command::new(env!("CARGO_BIN_EXE_slat"))
        .args([
            "migrate-listen",
            "--listen",
            "127.0.0.1:0",
            "--resume-ms",
            "20",
        ])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run slat migrate-listen");
    let mut err = BufReader::new(c.stderr.take().expect("stderr"));
    let mut line = String::new();
    err.read_line(&mut line).expect("first line");
    let addr = line
        .split_whitespace()
        .find(|w| w.starts_with("127.0.0.1:"))
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .to_string();
    (c, addr, err)
}

fn finish(mut c: Child, mut err: BufReader<std::process::ChildStderr>) -> (i32, String, String) {
    let mut rest = String::new();
    let _ = std::io::Read::read_to_string(&mut err, &mut rest);
    let code = c.wait().expect("wait").code().unwrap_or(-1);
    let mut out = String::new();
    if let Some(mut o) = c.stdout.take() {
        let _ = std::io::Read::read_to_string(&mut o, &mut out);
    }
    (code, out, rest)
}

const SMALL: [&str; 6] = ["-v", "2", "-b", "8M", "--warmup", "30"];

/// Runs `slat` with the words of `cmd`, then [`SMALL`]'s.
fn small(cmd: &str) -> (i32, String, String) {
    let args: Vec<&str> = cmd.split_whitespace().chain(SMALL).collect();
    slat(&args)
}

#[test]
fn migrate_perf_reports_every_figure() {
    let (code, out, err) = small("migrate-perf --resume-ms 20 --log ring");
    assert_eq!(code, 0, "{out}\n{err}");
    for line in [
        "Total migration time:",
        "Downtime:",
        "Rounds:",
        "Round 0: 4096 pages",
        "Dirty rate:",
        "Bandwidth:",
        "Throttling:",
        "Verification: OK, 64 ranges",
        "Destination resumed the guest:",
    ] {
        assert!(out.contains(line), "{line}\n{out}");
    }
    let (code, out, err) = small("migrate-perf --json --compress lz4");
    assert_eq!(code, 0, "{err}");
    let doc: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(doc["verification"]["ok"], true);
    assert_eq!(doc["destination"]["verification"]["ok"], true);
    assert!(doc["downtime_s"].as_f64().unwrap() > 0.0);
    assert!(doc["rounds"][0]["pages"].as_u64() == Some(4096));
}

#[test]
fn migrate_perf_vary_prints_one_table() {
    let (code, out, err) =
        small("migrate-perf --resume-ms 0 --vary log=get,clear --vary fast-pf=on,off");
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("downtime (ms)"), "{out}");
    assert_eq!(out.matches(" ok").count(), 4, "{out}");
}

#[test]
fn migrate_perf_varies_the_page_streams() {
    let (code, out, err) = small("migrate-perf --resume-ms 0 --vary connections=1,2");
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("| connections |"), "{out}");
    assert_eq!(out.matches(" ok").count(), 2, "{out}");
    let (code, out, err) = small("migrate-perf --resume-ms 0 --connections 3 --json");
    assert_eq!(code, 0, "{err}");
    let doc: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(doc["connections"], 3);
    assert_eq!(doc["config"]["connections"], 3);
    assert_eq!(doc["destination"]["streams"], 3);
    assert!(doc["destination_resumed"].is_object(), "{out}");
    assert_eq!(doc["verification"]["ok"], true);
}

#[test]
fn page_streams_migrate_across_processes() {
    let (dest, addr, derr) = listen(&[]);
    let (code, out, err) = small(&format!("migrate --to {addr} --connections 2"));
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("2 page streams"), "{out}");
    assert!(out.contains("Verification: OK"), "{out}");
    let (dcode, dout, derr) = finish(dest, derr);
    assert_eq!(dcode, 0, "{derr}");
    assert!(dout.contains("over 2 page streams"), "{dout}");
    assert!(dout.contains("Verification: OK"), "{dout}");
}

#[test]
fn bad_flags_exit_2_with_one_line() {
    for cmd in [
        "migrate --to 127.0.0.1:1 -b 12Q",
        "migrate --to 127.0.0.1:1 --log sometimes",
        "migrate-perf --vary log=foo",
        "migrate-perf --dirty-rate fast",
        "migrate-perf --converge dirty-limit",
        "migrate-perf --converge dirty-limit --log clear",
        "migrate --to 127.0.0.1:1 --converge dirty-limit",
        "migrate-perf --log ring --converge dirty-limit --dirty-limit 0",
        "migrate-perf --dirty-limit 2000m",
        "migrate-perf --dirty-limit 99999999999999999999",
        "migrate-perf --dirty-limit-period 5",
        "migrate-perf --converge sometimes",
        "migrate-perf --vary converge=auto,dirty-limit",
        "migrate-perf --dirty-rate-vcpu0 0",
        "migrate-perf --backend kvm --dirty-rate-vcpu0 5k",
        "migrate-perf --connections 0",
        "migrate-perf --connections 17",
        "migrate-perf --vary connections=1,99",
        "migrate --to fd:5 --connections 2",
        "migrate --to file:/tmp/x --connections 2",
        "migrate-listen --listen 127.0.0.1:0 --connections 0",
        "migrate-perf --postcopy --verify full",
        "migrate-perf --postcopy-after 1001",
        "migrate-perf --vary postcopy-after=x",
    ] {
        let args: Vec<&str> = cmd.split_whitespace().collect();
        let (code, out, err) = slat(&args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(out.is_empty());
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
    }
}

#[test]
fn unreachable_destination_fails_with_one_line_and_the_guest_running() {
    let (code, _, err) = small("migrate --to 127.0.0.1:1");
    assert_eq!(code, 1, "{err}");
    let e = errors(&err);
    assert_eq!(e.len(), 1, "{err}");
    assert!(
        e[0].contains("cannot connect") && e[0].contains("keeps running on the source"),
        "{err}"
    );
}

#[test]
fn wrong_version_fails_both_ends_with_one_line() {
    let (dest, addr, derr) = listen(&[]);
    let (code, _, err) = small(&format!("migrate --to {addr} --inject version=9"));
    assert_eq!(code, 1, "{err}");
    assert_eq!(errors(&err).len(), 1, "{err}");
    assert!(err.contains("version 9"), "{err}");
    let (dcode, dout, derr) = finish(dest, derr);
    assert_eq!(dcode, 1, "{derr}");
    assert!(dout.is_empty(), "no partial success: {dout}");
    let e = errors(&derr);
    assert_eq!(e.len(), 1, "{derr}");
    assert!(e[0].contains("stream version 9 is not supported"), "{derr}");
}

#[test]
fn a_cut_connection_is_resumed_across_processes() {
    let (dest, addr, derr) = listen(&["--retries", "1"]);
    let (code, out, err) = small(&format!(
        "migrate --to {addr} --inject cut-after=1000000 --retries 1 --retry-delay 100"
    ));
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(err.contains("attempt 1 failed"), "{err}");
    assert!(out.contains("attempt 2 (resumed"), "{out}");
    assert!(out.contains("Verification: OK"), "{out}");
    let (dcode, dout, derr) = finish(dest, derr);
    assert_eq!(dcode, 0, "{derr}");
    assert!(dout.contains("resumed"), "{dout}");
    assert!(dout.contains("Verification: OK"), "{dout}");
}

/// Pure post-copy between two processes, its link cut in the middle: both ends pause, the
/// retry recovers (the destination says which pages it lacks) and the guest verifies.
#[test]
fn a_cut_postcopy_recovers_across_processes() {
    let (dest, addr, derr) = listen(&["--retries", "1"]);
    let (code, out, err) = small(&format!(
        "migrate --to {addr} --postcopy-after 0 --inject cut-after=4000000 --retries 1 --retry-delay 100"
    ));
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(err.contains("post-copy paused"), "{err}");
    assert!(out.contains("1 recoveries"), "{out}");
    assert!(out.contains("Verification: OK"), "{out}");
    let (dcode, dout, derr) = finish(dest, derr);
    assert_eq!(dcode, 0, "{derr}");
    assert!(dout.contains("Verification: OK"), "{dout}");
}

#[test]
fn a_broken_source_is_caught_by_verification() {
    // A dirty log that misses writes: only the full check is independent of it.
    let (code, out, err) = small("migrate-perf --break skip-final-harvest --verify full");
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(!out.contains("Verification: OK"), "{out}");
    let e = errors(&err);
    assert_eq!(e.len(), 1, "{err}");
    assert!(e[0].contains("verification failed"), "{err}");
}

#[test]
fn migrate_perf_on_kvm() {
    if std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_err()
    {
        eprintln!("skipping: /dev/kvm cannot be opened on this host");
        return;
    }
    let (code, out, err) = small("migrate-perf --backend kvm --resume-ms 20");
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("Verification: OK"), "{out}");
    assert!(out.contains("to a kvm destination"), "{out}");
}

#[test]
fn migrate_repeat_moves_n_guests_to_a_listen_repeat() {
    let (dest, addr, derr) = listen(&["--repeat", "2"]);
    let (code, out, err) = small(&format!("migrate --to {addr} --repeat 2 --json"));
    assert_eq!(code, 0, "{out}\n{err}");
    let doc: serde_json::Value = serde_json::from_str(&out).expect("one JSON document");
    assert_eq!(doc["benchmark"], "migrate");
    assert_eq!(doc["repeat"], 2);
    assert_eq!(doc["runs"].as_array().map(Vec::len), Some(2));
    for run in doc["runs"].as_array().unwrap() {
        assert_eq!(run["verification"]["ok"], true);
    }
    let downtime = doc["summary"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["metric"] == "downtime")
        .expect("a downtime summary");
    assert_eq!(downtime["runs"], 2);
    assert!(downtime["min"].as_f64() <= downtime["max"].as_f64());
    let (dcode, dout, derr) = finish(dest, derr);
    assert_eq!(dcode, 0, "{derr}");
    assert_eq!(dout.matches("Verification: OK").count(), 2, "{dout}");
    assert!(dout.contains("Summary over 2 runs"), "{dout}");
}

#[test]
fn bad_uris_exit_2_with_one_line() {
    for cmd in [
        "migrate --to exec:cat",
        "migrate --to fd:1",
        "migrate --to unix:",
        "migrate --to tcp:nohost",
        "migrate-listen --listen file:",
        "migrate-listen --listen fd:x",
        "migrate --to fd:9 --repeat 2",
    ] {
        let args: Vec<&str> = cmd.split_whitespace().collect();
        let (code, out, err) = slat(&args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(out.is_empty());
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
    }
}

#[test]
fn migrate_over_a_unix_socket_between_processes() {
    let path = std::env::temp_dir().join(format!("slat-cli-mig-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let uri = format!("unix:{}", path.display());
    let mut c = Command::new(env!("CARGO_BIN_EXE_slat"))
        .args(["migrate-listen", "--listen", &uri, "--resume-ms", "20"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run slat migrate-listen");
    let mut err = BufReader::new(c.stderr.take().expect("stderr"));
    let mut line = String::new();
    err.read_line(&mut line).expect("first line");
    assert!(line.contains(&uri), "{line}");
    let mut args = vec!["migrate", "--to", &uri];
    args.extend(SMALL);
    let (code, out, e) = slat(&args);
    assert_eq!(code, 0, "{out}\n{e}");
    assert!(out.contains("Verification: OK"), "{out}");
    let (dcode, dout, derr) = finish(c, err);
    assert_eq!(dcode, 0, "{derr}");
    assert!(dout.contains("Verification: OK"), "{dout}");
    assert!(!path.exists(), "the socket file is removed");
}

#[test]
fn a_snapshot_to_a_file_restores_with_migrate_listen() {
    let path = std::env::temp_dir().join(format!("slat-cli-snap-{}", std::process::id()));
    let uri = format!("file:{}", path.display());
    let mut args = vec!["migrate", "--to", &uri];
    args.extend(SMALL);
    let (code, out, err) = slat(&args);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("Verification: sent"), "{out}");
    let (code, out, err) = slat(&["migrate-listen", "--listen", &uri, "--resume-ms", "20"]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("Verification: OK"), "{out}");
    let (code, out, err) = slat(&["migrate-listen", "--listen", &uri, "--json"]);
    assert_eq!(code, 0, "{out}\n{err}");
    let doc: serde_json::Value = serde_json::from_str(&out).expect("one JSON document");
    let errs = common::schema::def_errors("migrate.json", "destination", &doc);
    assert!(errs.is_empty(), "{}\n{doc:#}", errs.join("\n"));
    let (code, _, err) = slat(&["migrate-listen", "--listen", "file:/nonexistent/snap"]);
    assert_eq!(code, 1, "{err}");
    assert_eq!(errors(&err).len(), 1, "{err}");
    let _ = std::fs::remove_file(&path);
}

#[test]
fn migrate_over_inherited_descriptors() {
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    let (a, b) = std::os::unix::net::UnixStream::pair().expect("socketpair");
    let with_fd3 = |cmd: &mut Command, s: &std::os::unix::net::UnixStream| {
        let fd = s.as_raw_fd();
        // SAFETY: between fork and exec the child only calls dup2 and fcntl, which are
        // async-signal safe; `fd` stays open in the parent until the child has started.
        unsafe {
            cmd.pre_exec(move || {
                // dup2 onto itself keeps close-on-exec: clear it instead.
                let r = if fd == 3 {
                    libc::fcntl(3, libc::F_SETFD, 0)
                } else {
                    libc::dup2(fd, 3)
                };
                if r < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    };
    let mut l = Command::new(env!("CARGO_BIN_EXE_slat"));
    l.args(["migrate-listen", "--listen", "fd:3", "--resume-ms", "20"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    with_fd3(&mut l, &b);
    let dest = l.spawn().expect("run slat migrate-listen");
    let mut m = Command::new(env!("CARGO_BIN_EXE_slat"));
    m.args(["migrate", "--to", "fd:3"]).args(SMALL);
    with_fd3(&mut m, &a);
    let out = m.output().expect("run slat migrate");
    drop((a, b));
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert_eq!(out.status.code(), Some(0), "{so}\n{se}");
    assert!(so.contains("Verification: OK"), "{so}");
    let d = dest.wait_with_output().expect("wait");
    let dout = String::from_utf8_lossy(&d.stdout);
    assert_eq!(d.status.code(), Some(0), "{dout}");
    assert!(dout.contains("Verification: OK"), "{dout}");
}

#[test]
fn progress_json_is_one_object_per_line() {
    let (code, out, err) = small("migrate-perf --progress json --json --resume-ms 10");
    assert_eq!(code, 0, "{out}\n{err}");
    serde_json::from_str::<serde_json::Value>(&out).expect("the report is still one document");
    let lines: Vec<serde_json::Value> = err
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    let progress: Vec<_> = lines.iter().filter(|l| l["event"] == "progress").collect();
    assert!(progress.len() >= 2, "{err}");
    for p in &progress {
        for k in [
            "round",
            "pages_remaining",
            "bytes_per_second",
            "expected_downtime_seconds",
            "throttle_percent",
        ] {
            assert!(p.get(k).is_some(), "{k} missing: {p}");
        }
    }
    let last = progress.last().unwrap();
    assert_eq!(last["paused"], true);
    assert_eq!(last["pages_remaining"], 0);
    assert!(lines.iter().any(|l| l["event"] == "round"));
}

#[test]
fn dirty_limit_and_auto_converge_side_by_side() {
    let (code, out, err) = small(
        "migrate-perf --resume-ms 0 --log ring --dirty-rate 40k --dirty-limit 2k \
         --dirty-limit-period 200 --vary converge=auto,dirty-limit",
    );
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("throughput lost"), "{out}");
    assert!(out.contains("dirty-limit"), "{out}");
    assert!(out.contains("dl "), "{out}");
    assert_eq!(out.matches(" ok").count(), 2, "{out}");
}

#[test]
fn dirty_limit_throttles_the_vcpus_that_outrun_it_and_reports_live() {
    // 128 MiB/s carries 32k pages/s: the guest rewrites all of its 4096 pages faster than a
    // round sends them until it is limited (to 16k pages/s in all).
    let (code, out, err) = small(
        "migrate-perf --json --progress json --resume-ms 0 --log ring --dirty-rate 200k \
         --converge dirty-limit --dirty-limit 8k --dirty-limit-period 100 --bandwidth 128 \
         --max-downtime 50",
    );
    assert_eq!(code, 0, "{out}\n{err}");
    let doc: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(doc["config"]["converge"], "dirty-limit");
    assert_eq!(doc["config"]["dirty_limit_pages_per_s"], 8000);
    assert_eq!(doc["converged"], true, "{out}");
    let dl = &doc["dirty_limit"];
    assert_eq!(dl["limit_pages_per_s"], 8000);
    assert!(dl["periods"].as_u64().unwrap() > 0, "{dl}");
    for t in dl["vcpu_max_throttle_permille"].as_array().unwrap() {
        assert!(
            t.as_u64().unwrap() > 500,
            "both vCPUs outran the limit: {dl}"
        );
    }
    assert_eq!(
        dl["vcpu_max_throttle_permille"].as_array().unwrap().len(),
        2
    );
    assert_eq!(doc["vcpu_writes_per_s_during"].as_array().unwrap().len(), 2);
    assert_eq!(
        doc["throttle"]["max_percent"], 0,
        "auto-converge stayed off"
    );
    // The limiter reports live, one line per period, with a throttle per vCPU.
    let lines: Vec<serde_json::Value> = err
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    if let Some(l) = lines.iter().find(|l| l["event"] == "dirty_limit") {
        assert_eq!(
            l["vcpu_throttle_permille"].as_array().unwrap().len(),
            2,
            "{l}"
        );
    }
}
