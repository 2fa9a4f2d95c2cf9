//! Progress lines of a migration on stderr.

use super::*;

pub(super) fn progress(q: bool, s: &str) {
    if !q {
        eprintln!("[slat] {s}");
    }
}

/// Progress lines for the source's events.
pub(super) fn on_event(q: bool, mode: ProgressArg) -> impl FnMut(Event<'_>) {
    move |e| {
        if mode == ProgressArg::Json {
            // A line that cannot be serialised has nothing in it to lose; none can fail.
            if let Ok(line) = serde_json::to_string(&ProgressLine::of(&e)) {
                eprintln!("{line}");
            }
            return;
        }
        if q {
            return;
        }
        match e {
            Event::Connected { resume, backend } => eprintln!(
                "[slat] connected to a {backend} destination{}",
                if resume {
                    " that kept this guest's memory: resuming"
                } else {
                    ""
                }
            ),
            Event::Round(r) => eprintln!(
                "[slat] {} {}: {} pages ({} zero), {} in {:.3}s ({:.0} MiB/s), throttle {}%",
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
            ),
            Event::Throttle(t) => eprintln!("[slat] auto-converge: throttle {t}%"),
            Event::DirtyLimit {
                limit,
                rates,
                throttles,
            } => {
                let v: Vec<String> = rates
                    .iter()
                    .zip(throttles)
                    .map(|(r, t)| format!("{r:.0}/s -> {:.1}%", *t as f64 / 10.0))
                    .collect();
                eprintln!(
                    "[slat] dirty-limit {limit} pages/s per vCPU: {}",
                    v.join(", ")
                )
            }
            Event::Paused(n) => eprintln!("[slat] vCPUs paused; {n} pages to send"),
            // The text lines above already say where the migration stands.
            Event::Progress(_) => {}
        }
    }
}
