//! Progress of a migration on stderr: `[slat]` text lines, or with `--progress json` one JSON
//! object per event (its `event` field names it).

use super::{when, ProgressArg};
use serde_json::{json, Value};
use slat_migrate::Event;
use slat_workload::format_size;

/// A `[slat]` line, unless quiet.
pub(super) fn progress(q: bool, s: &str) {
    if !q {
        eprintln!("[slat] {s}");
    }
}

/// Progress lines for the source's events.
pub(super) fn on_event(q: bool, mode: ProgressArg) -> impl FnMut(Event<'_>) {
    move |e| {
        let (event, text, fields) = describe(&e);
        if mode == ProgressArg::Json {
            // `event` first, where a reader looks for it (the other keys follow in order);
            // every event has fields, so the object is never empty.
            eprintln!("{{\"event\":\"{event}\",{}", &fields.to_string()[1..]);
        } else if let Some(text) = text {
            progress(q, &text);
        }
    }
}

/// The connected event: the destination answered (over `connections` page streams).
fn connected(
    resume: bool,
    backend: &str,
    connections: u32,
) -> (&'static str, Option<String>, Value) {
    let text = format!(
        "connected to a {backend} destination{}{}",
        when(
            connections > 1,
            &format!(" over {connections} page streams")
        ),
        when(resume, " that kept this guest's memory: resuming")
    );
    let fields = json!({ "resume": resume, "backend": backend, "connections": connections });
    ("connected", Some(text), fields)
}

/// An event's name, its text line (none where the text lines already say it) and its fields.
fn describe(e: &Event<'_>) -> (&'static str, Option<String>, Value) {
    match e {
        Event::Connected {
            resume,
            backend,
            connections,
        } => connected(*resume, backend, *connections),
        Event::Round(r) => (
            "round",
            Some(format!(
                "{} {}: {} pages ({} zero), {} in {:.3}s ({:.0} MiB/s), throttle {}%",
                if r.stop_and_copy {
                    "stop-and-copy"
                } else {
                    "round"
                },
                r.round,
                r.pages,
                r.zero_pages,
                format_size(r.bytes),
                r.time.as_secs_f64(),
                r.bandwidth() / (1 << 20) as f64,
                r.throttle
            )),
            json!({ "round": r.round, "stop_and_copy": r.stop_and_copy, "pages": r.pages,
                "zero_pages": r.zero_pages, "delta_pages": r.delta_pages, "bytes": r.bytes, "seconds": r.time.as_secs_f64(),
                "bytes_per_second": r.bandwidth(), "throttle_percent": r.throttle }),
        ),
        Event::Throttle(t) => (
            "throttle",
            Some(format!("auto-converge: throttle {t}%")),
            json!({ "percent": t }),
        ),
        Event::Paused(n) => (
            "paused",
            Some(format!("vCPUs paused; {n} pages to send")),
            json!({ "pages_to_send": n }),
        ),
        Event::Postcopy { discarded } => postcopy(*discarded),
        Event::DirtyLimit {
            limit,
            rates,
            throttles,
        } => {
            let v: Vec<String> = (rates.iter().zip(throttles.iter()))
                .map(|(r, t)| format!("{r:.0}/s -> {:.1}%", *t as f64 / 10.0))
                .collect();
            (
                "dirty_limit",
                Some(format!(
                    "dirty-limit {limit} pages/s per vCPU: {}",
                    v.join(", ")
                )),
                json!({ "limit_pages_per_s": limit, "vcpu_dirty_pages_per_s": rates,
                    "vcpu_throttle_permille": throttles }),
            )
        }
        Event::Progress(p) => {
            let mut f = json!({ "round": p.round, "pages_sent": p.pages_sent,
                "pages_remaining": p.pages_remaining, "dirtied_pages": p.dirtied,
                "bytes_per_second": p.bandwidth,
                "expected_downtime_seconds": p.expected_downtime.as_secs_f64(),
                "throttle_percent": p.throttle, "vcpu_throttle_permille": p.vcpu_throttle_permille,
                "paused": p.paused, "elapsed_seconds": p.elapsed.as_secs_f64() });
            if p.vcpu_throttle_permille.is_empty() {
                if let Value::Object(m) = &mut f {
                    m.remove("vcpu_throttle_permille");
                }
            }
            ("progress", None, f)
        }
    }
}

/// The switch to post-copy.
fn postcopy(discarded: u64) -> (&'static str, Option<String>, Value) {
    let text =
        format!("post-copy: the guest runs on the destination; {discarded} pages follow on demand");
    (
        "postcopy",
        Some(text),
        json!({ "pages_to_send": discarded }),
    )
}
