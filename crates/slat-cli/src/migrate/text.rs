//! The text reports of `migrate`, `migrate-perf` and `migrate-listen`.

use super::{CompressArg, GuestArgs, MigrationArgs};
use crate::report::ts;
use slat_migrate::{DestReport, MigrationReport};
use slat_workload::format_size;

/// The text report of one migration (source side).
pub fn print_report(g: &GuestArgs, m: &MigrationArgs, r: &MigrationReport, baseline: f64) {
    println!("Guest: {}", g.describe());
    println!(
        "Migration: attempt {}{}, to a {} destination; max downtime {} ms{}{}",
        r.attempt,
        if r.resumed {
            " (resumed the destination's kept memory)"
        } else {
            ""
        },
        r.dest_backend,
        m.max_downtime,
        m.bandwidth
            .map(|b| format!(", bandwidth cap {b} MiB/s"))
            .unwrap_or_default(),
        if m.compress == CompressArg::Lz4 {
            ", lz4"
        } else {
            ""
        },
    );
    print_rounds(r);
    print_totals(r, baseline);
    print_checks(r);
}

/// One line per round.
fn print_rounds(r: &MigrationReport) {
    for x in &r.rounds {
        println!(
            "{} {}: {} pages ({} zero), {} in {} ({:.0} MiB/s); dirtied meanwhile: {}{}",
            if x.stop_and_copy {
                "Stop-and-copy round"
            } else {
                "Round"
            },
            x.round,
            x.pages,
            x.zero_pages,
            format_size(x.bytes),
            ts(x.time),
            x.bandwidth() / (1 << 20) as f64,
            if x.stop_and_copy {
                "-".to_string()
            } else {
                x.dirtied.to_string()
            },
            if x.throttle != 0 {
                format!(", throttle {}%", x.throttle)
            } else {
                String::new()
            },
        );
    }
}

/// Times, rounds, rates and throttling of the whole migration.
fn print_totals(r: &MigrationReport, baseline: f64) {
    println!("Total migration time: {}", ts(r.total));
    println!(
        "Downtime: {} (vCPUs paused to verified switch-over: final harvest {}, final pages {}, verification {})",
        ts(r.downtime),
        ts(r.final_harvest),
        ts(r.final_send),
        ts(r.verify)
    );
    println!(
        "Rounds: {} ({}; expected stop-and-copy transfer {})",
        r.rounds.len(),
        if r.converged {
            "converged"
        } else {
            "did not converge: stopped at --max-rounds"
        },
        ts(r.expected_final)
    );
    println!(
        "Dirty rate: {:.0} pages/s harvested during pre-copy; guest writes {:.0}/s before migration, {:.0}/s during pre-copy",
        r.dirty_rate(),
        baseline,
        r.write_rate()
    );
    println!(
        "Bandwidth: {:.0} MiB/s average ({} pages, {} sent)",
        r.bandwidth() / (1 << 20) as f64,
        r.pages(),
        format_size(r.bytes())
    );
    if let Some(d) = &r.dirty_limit {
        let v: Vec<String> = d
            .max_permille
            .iter()
            .zip(&d.last_rates)
            .map(|(t, x)| format!("max {:.1}% (last {x:.0} pages/s)", *t as f64 / 10.0))
            .collect();
        println!(
            "Dirty-limit: {} pages/s per vCPU, every {} ms, {} periods; per vCPU: {}",
            d.limit,
            d.period.as_millis(),
            d.periods,
            v.join(", ")
        );
    }
    if r.throttle_max == 0 {
        println!("Throttling: none");
    } else {
        let steps: Vec<String> = r
            .throttle_changes
            .iter()
            .map(|(round, t)| format!("{t}% after round {round}"))
            .collect();
        println!(
            "Throttling: up to {}% ({}); vCPUs kept out of the guest {:.3}s in total",
            r.throttle_max,
            steps.join(", "),
            r.throttled.as_secs_f64()
        );
    }
}

/// Verification, device state and the destination's resume.
fn print_checks(r: &MigrationReport) {
    if r.one_way {
        println!(
            "Verification: sent, {} ranges of {} pages ({}), for the reader to check",
            r.verify_ranges,
            r.range_pages,
            format_size(r.verify_ranges * r.range_pages as u64 * 4096)
        );
    } else {
        println!(
            "Verification: OK, {} ranges of {} pages ({}) match the source ({}: {} pages hashed with the vCPUs paused)",
            r.verify_ranges,
            r.range_pages,
            format_size(r.verify_ranges * r.range_pages as u64 * 4096),
            r.verify_mode.name(),
            r.paused_hashed_pages
        );
    }
    if r.state_blobs > 0 {
        println!(
            "Device state: {} blobs, {} bytes",
            r.state_blobs, r.state_bytes
        );
    }
    match r.dest_resumed {
        Some((n, d)) => println!(
            "Destination resumed the guest: {n} pages touched in {}",
            ts(d)
        ),
        None => println!("Destination resumed the guest: not reported"),
    }
}

/// The text report of one received migration.
pub fn print_dest(r: &DestReport) {
    let size = format_size(r.regions.iter().map(|x| x.pages).sum::<u64>() * 4096);
    println!(
        "Incoming migration: {size} guest from a {} source (attempt {}{}), onto {}",
        r.source_backend,
        r.attempt,
        if r.resumed { ", resumed" } else { "" },
        r.backend
    );
    println!(
        "Received: {} pages ({} zero) in {} rounds, {} of stream, in {}",
        r.pages,
        r.zero_pages,
        r.rounds,
        format_size(r.bytes),
        ts(r.total)
    );
    println!(
        "Verification: OK, {} ranges of {} pages match the source (hashing here took {})",
        r.verify.ranges,
        r.verify.range_pages,
        ts(r.verify_time)
    );
    println!(
        "Guest resumed here: {} pages touched in {}",
        r.run.0,
        ts(r.run.1)
    );
}
