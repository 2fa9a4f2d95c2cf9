//! `slat migrate-listen`: receive migrations, verify them and run the guests.

use super::*;

/// `slat migrate-listen`: receives one migration, or `--repeat N` one after the other.
pub fn run_listen(a: &ListenArgs) -> CliResult {
    a.machine
        .format
        .check_backends(&[a.backend])
        .map_err(CliError::bad)?;
    check_backends(&[a.backend], &a.machine.engine_only()).map_err(CliError::bad)?;
    check_backing(&[a.backend], a.backing).map_err(CliError::bad)?;
    if a.out.plot.is_some() {
        return Err(CliError::bad(
            "--plot: migrate-listen has nothing to draw (the source's `slat migrate --plot` draws the migration)",
        ));
    }
    if matches!(a.listen, Endpoint::Fd(_)) && (a.out.repeat > 1 || a.retries > 0) {
        return Err(CliError::bad(
            "--listen fd:N carries one migration: --repeat and --retries need tcp: or unix:",
        ));
    }
    let q = quiet(a.out.json);
    let mut listener = match &a.listen {
        Endpoint::Fd(n) => Listener::Fd(Some(claim_fd(&a.listen, *n)?)),
        at => Listener::bind(at).map_err(|err| RunError::Listen {
            addr: a.listen.to_string(),
            err,
        })?,
    };
    let local = listener.describe();
    progress(
        q,
        &format!(
            "listening on {local} for a migration ({} machine)",
            a.backend.name()
        ),
    );
    let mut docs = Vec::new();
    for n in 0..a.out.repeat {
        if a.out.repeat > 1 {
            progress(q, &format!("migration {}/{}", n + 1, a.out.repeat));
        }
        let r = receive_one(a, &mut listener, &local, q)?;
        if !a.out.json {
            print_dest(&r);
        }
        docs.push(DestinationDoc::new(&r));
    }
    if docs.len() > 1 {
        let rep = Repeated::new("migrate-listen", DEST_METRICS, docs);
        if a.out.json {
            return print_json(&rep, &[a.backend]);
        }
        rep.print();
        return Ok(());
    }
    if a.out.json {
        print_json(&docs[0], &[a.backend])?;
    }
    Ok(())
}

/// Serves connections on `listener` until one migration completes, into a destination of its
/// own, surviving `--retries` failed ones.
pub(super) fn receive_one(
    a: &ListenArgs,
    listener: &mut Listener,
    local: &str,
    q: bool,
) -> Result<DestReport, RunError> {
    let cfg = DestConfig {
        resume_for: Duration::from_millis(a.resume_ms),
        timeout: Duration::from_secs(a.timeout),
        max_memory: a.max_memory.unwrap_or(0),
    };
    let mut dest = Destination::new(factory(a), cfg);
    let mut failures = 0;
    loop {
        let c = listener
            .accept(Duration::from_secs(a.timeout))
            .map_err(|err| RunError::Accept {
                addr: local.to_string(),
                err,
            })?;
        let peer = c.peer.clone();
        progress(q, &format!("incoming migration from {peer}"));
        let err = match dest.serve_channel(c) {
            Ok(r) => return Ok(r),
            Err(err) => err,
        };
        failures += 1;
        if failures > a.retries {
            return Err(RunError::Incoming { peer, err });
        }
        progress(q, &format!(
            "incoming migration from {peer} failed: {err}; {} waiting for the source to retry ({failures} of {})",
            if dest.holds_session() { "keeping the guest's memory and" } else { "" },
            a.retries
        ));
    }
}

/// Builds a machine of each incoming guest's shape with migrate-listen's settings.
pub(super) fn factory(a: &ListenArgs) -> slat_migrate::Factory {
    // The shape is the source's (from the hello's machine description); the rest is ours.
    bench::factory(GuestSpec {
        backend: kind(a.backend),
        shape: Shape {
            vcpus: 1,
            bytes_per_vcpu: 4096,
            slots: 1,
            overlap: false,
        },
        backing: a.backing,
        log: LogMode::Get,
        ring_entries: 65536,
        vm: a.machine.vm_config(),
        stage2: a.machine.format == FormatArg::Stage2,
        tlb_entries: a.machine.tlb_entries,
        pcpus: a.machine.pcpus.unwrap_or(0),
        prefault: !a.machine.no_prefault,
    })
}

/// The figures `migrate-listen --repeat` summarizes, from the destination's report.
pub(super) const DEST_METRICS: &[Metric<DestinationDoc>] = &[
    Metric {
        name: "total migration time",
        unit: "s",
        better: Better::Lower,
        get: |d| Some(d.total.as_secs_f64()),
    },
    Metric {
        name: "setup",
        unit: "s",
        better: Better::Lower,
        get: |d| Some(d.setup.as_secs_f64()),
    },
    Metric {
        name: "verification hashing",
        unit: "s",
        better: Better::Lower,
        get: |d| Some(d.verify_time.as_secs_f64()),
    },
    Metric {
        name: "stream received",
        unit: "bytes",
        better: Better::Lower,
        get: |d| Some(d.bytes as f64),
    },
];
