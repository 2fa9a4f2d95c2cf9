//! The text reports of `migrate`, `migrate-perf` and `migrate-listen`.

use super::{when, CompressArg};
use crate::migrate_report::{Dest, Migration};
use crate::report::ts;
use slat_workload::format_size;

const MIB: f64 = (1 << 20) as f64;

/// The text report of one migration (source side).
pub fn print_report(mig: &Migration) {
    let (r, m) = (&mig.r, &mig.migration);
    println!("Guest: {}", mig.guest.describe());
    println!(
        "Migration: attempt {}{}, to a {} destination; max downtime {} ms{}{}{}",
        r.attempt,
        when(r.resumed, " (resumed the destination's kept memory)"),
        r.dest_backend,
        m.max_downtime,
        (m.bandwidth.map(|b| format!(", bandwidth cap {b} MiB/s"))).unwrap_or_default(),
        when(m.compress == CompressArg::Lz4, ", lz4"),
        when(
            r.connections > 1,
            &format!(", {} page streams", r.connections)
        ),
    );
    for x in &r.rounds {
        let (last, dirtied) = (x.stop_and_copy, x.dirtied.to_string());
        println!(
            "{} {}: {} pages ({} zero{}), {} in {} ({:.0} MiB/s); dirtied meanwhile: {}{}",
            if last { "Stop-and-copy round" } else { "Round" },
            x.round,
            x.pages,
            x.zero_pages,
            when(x.delta_pages > 0, &format!(", {} delta", x.delta_pages)),
            format_size(x.bytes),
            ts(x.time),
            x.bandwidth() / MIB,
            if last { "-" } else { &dirtied },
            match x.throttle {
                0 => String::new(),
                t => format!(", throttle {t}%"),
            },
        );
    }
    println!("Total migration time: {}", ts(r.total));
    if r.postcopy.is_some() {
        println!(
            "Downtime: {} (vCPUs paused to the guest's run on the destination, post-copy)",
            ts(r.downtime)
        );
    } else {
        println!(
            "Downtime: {} (vCPUs paused to verified switch-over: final harvest {}, final pages {}, verification {})",
            ts(r.downtime), ts(r.final_harvest), ts(r.final_send), ts(r.verify)
        );
    }
    println!(
        "Rounds: {} ({}; expected stop-and-copy transfer {})",
        r.rounds.len(),
        match (&r.postcopy, r.converged) {
            (Some(_), _) => "then post-copy",
            (None, true) => "converged",
            (None, false) => "did not converge: stopped at --max-rounds",
        },
        ts(r.expected_final)
    );
    println!(
        "Dirty rate: {:.0} pages/s harvested during pre-copy; guest writes {:.0}/s before migration, {:.0}/s during pre-copy",
        r.dirty_rate(), mig.before.0, r.write_rate()
    );
    println!(
        "Bandwidth: {:.0} MiB/s average ({} pages, {} sent)",
        r.bandwidth() / MIB,
        r.pages(),
        format_size(r.bytes())
    );
    print_delta(r);
    print_checks(mig);
}

/// What the delta cache did.
fn print_delta(r: &slat_migrate::MigrationReport) {
    if let Some(d) = &r.delta {
        println!(
            "Delta pages: {} sent as deltas, {} whole; cache {} of {} allocated{}",
            d.hits,
            d.misses,
            format_size(d.allocated),
            format_size(d.cache_bytes),
            when(
                d.refused > 0,
                &format!(", {} chunks refused by the host", d.refused)
            ),
        );
    }
}

/// Throttling, verification, device state and the destination's resume.
fn print_checks(mig: &Migration) {
    let r = &mig.r;
    print_postcopy(mig);
    if let Some(d) = &r.dirty_limit {
        let v: Vec<String> = (d.max_permille.iter().zip(&d.last_rates))
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
        let steps: Vec<String> = (r.throttle_changes.iter())
            .map(|(round, t)| format!("{t}% after round {round}"))
            .collect();
        println!(
            "Throttling: up to {}% ({}); vCPUs kept out of the guest {:.3}s in total",
            r.throttle_max,
            steps.join(", "),
            r.throttled.as_secs_f64()
        );
    }
    let ranges = format!(
        "{} ranges of {} pages ({})",
        r.verify_ranges,
        r.range_pages,
        format_size(r.verify_ranges * r.range_pages as u64 * 4096)
    );
    if r.one_way {
        println!("Verification: sent, {ranges}, for the reader to check");
    } else {
        println!(
            "Verification: OK, {ranges} match the source ({}: {} pages hashed with the vCPUs paused)",
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
pub fn print_dest(d: &Dest) {
    let r = &d.0;
    println!(
        "Incoming migration: {} guest from a {} source (attempt {}{}), onto {}",
        format_size(d.memory_bytes()),
        r.source_backend,
        r.attempt,
        when(r.resumed, ", resumed"),
        r.backend
    );
    println!(
        "Received: {} pages ({} zero) in {} rounds, {} of stream{}, in {}",
        r.pages,
        r.zero_pages,
        r.rounds,
        format_size(r.bytes),
        when(r.streams > 1, &format!(" over {} page streams", r.streams)),
        ts(r.total)
    );
    println!(
        "Verification: OK, {} ranges of {} pages match the source (hashing here took {})",
        r.verify.ranges,
        r.verify.range_pages,
        ts(r.verify_time)
    );
    if let Some(p) = &r.postcopy {
        print_faults(p);
    }
    let (pages, time) = r.run;
    println!("Guest resumed here: {pages} pages touched in {}", ts(time));
}

/// Post-copy's figures on both sides.
fn print_postcopy(mig: &Migration) {
    let r = &mig.r;
    if let Some(p) = &r.postcopy {
        println!(
            "Post-copy ({}, after {} rounds): {} pages on demand, {} in the background and {} on the preempt channel ({} requested, {} already sent); last page {:.3}s after the run; {} recoveries",
            p.trigger,
            p.after_rounds,
            p.discarded,
            p.background_pages,
            p.preempt_pages,
            p.requested,
            p.requests_already_sent,
            p.time_to_last_page.as_secs_f64(),
            p.recoveries
        );
    }
    if let Some(p) = mig.destination.as_ref().and_then(|d| d.0.postcopy.as_ref()) {
        print_faults(p);
    }
}

/// The destination's post-copy: faults and their latency (QEMU's blocktime).
fn print_faults(p: &slat_migrate::postcopy::PostcopyDestReport) {
    let b = &p.blocktime;
    println!(
        "Post-copy faults (destination): {} faults, blocktime p50 {:.3} ms, p99 {:.3} ms, max {:.3} ms; {} pages requested, {} placed from the background and {} from the preempt channel, last {:.3}s after the run; {} recoveries",
        b.faults,
        b.p50.as_secs_f64() * 1e3,
        b.p99.as_secs_f64() * 1e3,
        b.max.as_secs_f64() * 1e3,
        p.requested,
        p.background_pages,
        p.preempt_pages,
        p.time_to_last_page.as_secs_f64(),
        p.recoveries
    );
}
