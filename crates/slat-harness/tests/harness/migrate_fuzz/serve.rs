//! The destination side: a live destination served mutated streams, and the checks on it.

use super::*;
use slat_addr::PageIndex;

/// A factory that fails the case if asked for a machine the destination should have refused.
pub(crate) fn guarded_factory(asked: Arc<Mutex<Vec<Vec<Region>>>>) -> slat_migrate::Factory {
    let mut inner = migrate::factory(GuestSpec {
        prefault: false,
        ..GuestSpec::sim(common::shape(1), LogMode::Get)
    });
    Box::new(move |r: &[Region], m: &[u8]| {
        asked.lock().unwrap().push(r.to_vec());
        let pages = check_regions(r)
            .unwrap_or_else(|e| panic!("the destination built a machine for a bad map {r:?}: {e}"));
        assert!(
            pages * 4096 <= MAX_MEMORY,
            "the destination built a machine of {pages} pages beyond its limit for {r:?}"
        );
        inner(r, m)
    })
}

pub(crate) type Served = (
    Vec<Result<slat_migrate::DestReport, MigrateError>>,
    Option<Vec<u8>>,
);

/// Serves `streams` one connection each on a fresh destination; checks everything a hostile
/// source must not be able to break.
pub(crate) fn serve(
    v: &ValidStream,
    streams: &[Vec<Mutation>],
    outcomes: &Mutex<std::collections::BTreeMap<&'static str, usize>>,
) -> Result<(), TestCaseError> {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().unwrap().to_string();
    let asked = Arc::new(Mutex::new(Vec::new()));
    let cfg = DestConfig {
        resume_for: Duration::ZERO,
        timeout: Duration::from_secs(5),
        max_memory: MAX_MEMORY,
        max_streams: 16,
        delta: true,
    };
    let (h, rx) = spawn_destination(
        Destination::new(guarded_factory(asked.clone()), cfg),
        l,
        streams.len(),
    );
    let t = Instant::now();
    let mut replies = Vec::new();
    for muts in streams {
        replies.push(wire::exchange_all(
            &addr,
            mutate(v, muts),
            Duration::from_secs(10),
        ));
    }
    let served = rx.recv_timeout(CASE_LIMIT.saturating_sub(t.elapsed()));
    let Ok((results, image)) = served else {
        if h.is_finished() {
            let p = h.join().err().map(|p| {
                p.downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default()
            });
            return Err(TestCaseError::fail(format!(
                "the destination panicked: {p:?}"
            )));
        }
        return Err(TestCaseError::fail(format!(
            "the destination did not finish within {CASE_LIMIT:?}"
        )));
    };
    prop_assert!(h.join().is_ok());
    let mut succeeded = false;
    for r in &results {
        *outcomes.lock().unwrap().entry(outcome(r)).or_insert(0) += 1;
    }
    for (k, (r, muts)) in results.iter().zip(streams).enumerate() {
        match r {
            Ok(report) => {
                succeeded = true;
                check_success(report, &replies[k])?;
            }
            Err(e) => check_failure(e, muts, succeeded, k)?,
        }
    }
    if succeeded {
        let image = image.unwrap_or_default();
        prop_assert!(
            image == v.image,
            "a successful migration left memory that differs from the stream's image"
        );
    }
    Ok(())
}

/// Runs `d` on a thread of its own for `conns` connections from `l`; it sends back their
/// results and the guest memory it ended with.
pub(crate) fn spawn_destination(
    mut d: Destination,
    l: TcpListener,
    conns: usize,
) -> (std::thread::JoinHandle<()>, mpsc::Receiver<Served>) {
    let (tx, rx) = mpsc::channel::<Served>();
    let h = std::thread::spawn(move || {
        let mut results = Vec::new();
        for _ in 0..conns {
            results.push(d.accept(&l));
        }
        let image = d.guest().map(|g: &Arc<dyn Guest>| {
            let m = Memory::new(&**g).expect("memory map");
            m.stopped_range(PageIndex::new(0), PageIndex::new(m.pages()))
                .unwrap_or_default()
        });
        let _ = tx.send((results, image));
    });
    (h, rx)
}

/// A connection the destination reports a success: it verified every range, and said so
/// to the source unless a reset cut the replies short.
pub(crate) fn check_success(
    report: &slat_migrate::DestReport,
    reply: &(Vec<u8>, bool),
) -> Result<(), TestCaseError> {
    // The destination's own account: it verified every range before the commit.
    prop_assert!(
        report.verify.ok() && report.verify.mismatched == 0,
        "a success without a verification: {:?}",
        report.verify
    );
    // And what it told the source, when a reset did not cut that short (a stream
    // that goes on after its commit leaves bytes unread, and the close resets).
    let (raw, clean) = reply;
    let msgs = wire::replies(raw);
    prop_assert!(
        !clean
            || msgs
                .iter()
                .any(|m| matches!(m, Msg::Verified { mismatched: 0, .. })),
        "a success without a verification sent: {msgs:?}"
    );
    prop_assert!(
        !msgs
            .iter()
            .any(|m| matches!(m, Msg::Verified { mismatched, .. } if *mismatched != 0)),
        "a success after a failed verification: {msgs:?}"
    );
    Ok(())
}

/// A connection that failed: one typed line, never stopped by guest memory's own check,
/// and not an untouched stream's (unless an earlier connection already succeeded).
pub(crate) fn check_failure(
    e: &MigrateError,
    muts: &[Mutation],
    succeeded: bool,
    k: usize,
) -> Result<(), TestCaseError> {
    let s = e.to_string();
    prop_assert_eq!(s.lines().count(), 1, "{}", s);
    // `Memory` is the backstop: a bad index must be stopped by the destination's
    // own checks first.
    prop_assert!(
        !matches!(e, MigrateError::Memory(_)),
        "a bad index reached guest memory: {}",
        s
    );
    // An untouched stream succeeds (unless an earlier one already did).
    prop_assert!(
        !muts.is_empty() || succeeded,
        "connection {} of an unmutated stream failed: {}",
        k,
        s
    );
    Ok(())
}

/// What a connection came to, coarsely: which check stopped it.
pub(crate) fn outcome(r: &Result<slat_migrate::DestReport, MigrateError>) -> &'static str {
    match r {
        Ok(_) => "migrated",
        Err(MigrateError::Rejected(_)) => "hello refused",
        Err(MigrateError::Verification { .. }) => "verification failed",
        Err(MigrateError::Refused { .. }) => "source refused",
        Err(MigrateError::Stream { err, .. }) => match err {
            StreamError::Protocol(_) => "protocol error",
            StreamError::Page { .. } => "bad page",
            StreamError::Corrupt { .. } => "corrupt frame",
            StreamError::Truncated { .. } | StreamError::Closed { .. } => "cut short",
            StreamError::BadMagic { .. }
            | StreamError::Version { .. }
            | StreamError::PageSize { .. } => "bad preamble",
            _ => "connection",
        },
        Err(_) => "other",
    }
}
