//! The text reports of `migrate`, `migrate-perf` and `migrate-listen`.

use super::{when, CompressArg, GuestArgs, MigrationArgs};
use crate::migrate_report::{DestinationDoc, Migration};
use crate::report::ts;
use slat_workload::format_size;

const MIB: f64 = (1 << 20) as f64;

/// The text report of one migration (source side).
pub fn print_report(g: &GuestArgs, m: &MigrationArgs, r: &Migration) {
    println!("Guest: {}", g.describe());
    println!(
        "Migration: attempt {}{}, to a {} destination; max downtime {} ms{}{}",
        r.attempt,
        when(r.resumed, " (resumed the destination's kept memory)"),
        r.destination_backend,
        m.max_downtime,
        (m.bandwidth.map(|b| format!(", bandwidth cap {b} MiB/s"))).unwrap_or_default(),
        when(m.compress == CompressArg::Lz4, ", lz4"),
    );
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
            x.bandwidth() / MIB,
            if x.stop_and_copy {
                "-".to_string()
            } else {
                x.dirtied.to_string()
            },
            match x.throttle_percent {
                0 => String::new(),
                t => format!(", throttle {t}%"),
            },
        );
    }
    println!("Total migration time: {}", ts(r.total));
    println!(
        "Downtime: {} (vCPUs paused to verified switch-over: final harvest {}, final pages {}, verification {})",
        ts(r.downtime), ts(r.final_harvest), ts(r.final_send), ts(r.verify)
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
        r.dirty_pages_per_s, r.guest_writes_per_s_before, r.guest_writes_per_s_during
    );
    println!(
        "Bandwidth: {:.0} MiB/s average ({} pages, {} sent)",
        r.bandwidth_bytes_per_s / MIB,
        r.pages,
        format_size(r.bytes)
    );
    print_checks(r);
}

/// Throttling, verification, device state and the destination's resume.
fn print_checks(r: &Migration) {
    if let Some(d) = &r.dirty_limit {
        let v: Vec<String> = (d.vcpu_max_throttle_permille.iter())
            .zip(&d.vcpu_last_dirty_pages_per_s)
            .map(|(t, x)| format!("max {:.1}% (last {x:.0} pages/s)", *t as f64 / 10.0))
            .collect();
        println!(
            "Dirty-limit: {} pages/s per vCPU, every {} ms, {} periods; per vCPU: {}",
            d.limit_pages_per_s,
            d.period.as_millis(),
            d.periods,
            v.join(", ")
        );
    }
    let t = &r.throttle;
    if t.max_percent == 0 {
        println!("Throttling: none");
    } else {
        let steps: Vec<String> = (t.changes.iter())
            .map(|c| format!("{}% after round {}", c.percent, c.after_round))
            .collect();
        println!(
            "Throttling: up to {}% ({}); vCPUs kept out of the guest {:.3}s in total",
            t.max_percent,
            steps.join(", "),
            t.vcpu_time.as_secs_f64()
        );
    }
    let v = &r.verification;
    let ranges = format!(
        "{} ranges of {} pages ({})",
        v.ranges,
        v.range_pages,
        format_size(v.ranges * v.range_pages as u64 * 4096)
    );
    if r.one_way {
        println!("Verification: sent, {ranges}, for the reader to check");
    } else {
        println!(
            "Verification: OK, {ranges} match the source ({}: {} pages hashed with the vCPUs paused)",
            v.mode.unwrap_or_default(),
            v.paused_hashed_pages.unwrap_or_default()
        );
    }
    if r.device_state_blobs > 0 {
        println!(
            "Device state: {} blobs, {} bytes",
            r.device_state_blobs, r.device_state_bytes
        );
    }
    match &r.destination_resumed {
        Some(d) => println!(
            "Destination resumed the guest: {} pages touched in {}",
            d.pages_touched,
            ts(d.time)
        ),
        None => println!("Destination resumed the guest: not reported"),
    }
}

/// The text report of one received migration.
pub fn print_dest(r: &DestinationDoc) {
    println!(
        "Incoming migration: {} guest from a {} source (attempt {}{}), onto {}",
        format_size(r.memory_bytes),
        r.source_backend,
        r.attempt,
        when(r.resumed, ", resumed"),
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
        r.verification.ranges,
        r.verification.range_pages,
        ts(r.verify_time)
    );
    let run = &r.run;
    println!(
        "Guest resumed here: {} pages touched in {}",
        run.pages_touched,
        ts(run.time)
    );
}
