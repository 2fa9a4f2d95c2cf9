//! One connection's receive state and its steps, a frame kind each.

use super::striped::StripedBatch;
use super::{protocol, send, DestReport};
use crate::error::{HelloError, MigrateError, PageError, ProtocolError, StreamError};
use crate::guest::{Guest, Memory};
use crate::state::StateBlob;
use crate::stream::{self, Batch, Msg, MAX_STATE_BLOBS, MAX_STATE_BYTES, PAGE_BYTES};
use crate::verify::{self, Digests, VerifyMode, VerifyReport, NEVER_RECEIVED, RANGE_PAGES};
use slat_addr::PageIndex;
use std::io::Write;
use std::time::Instant;

/// One connection's receive state after the handshake: where the protocol is, what arrived,
/// and the comparison of the hashes so far. Each frame kind the protocol allows is one step.
pub(super) struct Incoming<'g> {
    guest: &'g dyn Guest,
    verify_mode: VerifyMode,
    /// Per page, the digest of what was written into it (`Sent` mode; empty otherwise).
    pub(super) digests: Digests,
    /// The bound of every page index: what the machine mapped, not what the hello says.
    mem: Memory<'g>,
    /// Ranges of this guest's memory.
    nranges: u64,
    /// One flag per range (`nranges` follows from memory this side mapped).
    hashed: Vec<bool>,
    verdict: VerifyReport,
    pub(super) state: State,
    /// The batch due next.
    seq: u64,
    /// Pages the batches of the round in progress carried.
    round_pages: u64,
    /// One page, decoded.
    buf: Vec<u8>,
    /// One verification range, copied out of guest memory.
    range: Vec<u8>,
    /// Page streams' batches of a round after the one in progress (their stream ran ahead of
    /// the control connection's round end), applied when it ends.
    early: Vec<StripedBatch>,
    /// Device state so far.
    blobs: Vec<StateBlob>,
    /// Its bytes.
    blob_bytes: u64,
    report: DestReport,
    /// Post-copy's discard runs so far.
    pub(super) discards: Vec<(u64, u64)>,
    /// The welcome accepted delta pages.
    pub(super) delta: bool,
}

impl<'g> Incoming<'g> {
    /// `digests`: those kept with the session (empty for a new one).
    pub(super) fn new(
        guest: &'g dyn Guest,
        report: DestReport,
        verify_mode: VerifyMode,
        mut digests: Digests,
    ) -> Result<Incoming<'g>, MigrateError> {
        let mem = Memory::new(guest).map_err(|e| HelloError::Build(e.into()))?;
        let nranges = verify::ranges(mem.pages(), RANGE_PAGES);
        let pages = usize::try_from(mem.pages()).unwrap_or(usize::MAX);
        if verify_mode == VerifyMode::Full {
            digests = Digests::default();
        } else if digests.len() != pages {
            // A new session: nothing received yet. The map was checked against this host's
            // memory, and a digest is 16 bytes per 4 KiB page.
            digests = Digests::new(pages, NEVER_RECEIVED);
        }
        Ok(Incoming {
            guest,
            verify_mode,
            digests,
            mem,
            nranges,
            hashed: vec![false; nranges as usize],
            verdict: VerifyReport {
                ranges: nranges,
                range_pages: RANGE_PAGES,
                ..VerifyReport::default()
            },
            state: State::Rounds,
            seq: 0,
            round_pages: 0,
            buf: vec![0u8; PAGE_BYTES],
            range: vec![0u8; RANGE_PAGES as usize * PAGE_BYTES],
            early: Vec::new(),
            blobs: Vec::new(),
            blob_bytes: 0,
            report,
            discards: Vec::new(),
            delta: false,
        })
    }

    /// How the source verifies.
    pub(super) fn verify_mode(&self) -> VerifyMode {
        self.verify_mode
    }

    /// The source's session.
    pub(super) fn session_id(&self) -> u64 {
        self.report.session
    }

    /// The source's attempt.
    pub(super) fn attempt(&self) -> u32 {
        self.report.attempt
    }

    /// Pages of this guest.
    pub(super) fn guest_pages(&self) -> u64 {
        self.mem.pages()
    }

    /// Post-copy's discard runs: after the rounds, before the run, bounded by the guest.
    pub(super) fn discard(
        &mut self,
        runs: Vec<(u64, u64)>,
        phase: &str,
    ) -> Result<(), MigrateError> {
        let pages = self.mem.pages();
        let bad = runs
            .iter()
            .find(|&&(a, n)| n == 0 || a.checked_add(n).is_none_or(|e| e > pages));
        if let Some(&(page, _)) = bad {
            return Err(MigrateError::stream(
                phase,
                StreamError::Page {
                    offset: 0,
                    err: PageError::OutOfRange { page, pages },
                },
            ));
        }
        // More runs than pages cannot be a real discard set: bounds what a source makes this
        // side hold.
        if self.discards.len() + runs.len() > pages as usize {
            return Err(protocol(
                phase,
                ProtocolError::Overflow {
                    what: "discard run",
                },
            ));
        }
        self.discards.extend(runs);
        Ok(())
    }

    /// Where the protocol is, for error messages.
    pub(super) fn phase(&self) -> String {
        match self.state {
            State::Rounds => format!("receiving round {}", self.report.rounds),
            State::Device => "receiving the device state".to_string(),
            State::Restored => "restoring the device state".to_string(),
            State::Hashes => "receiving the verification hashes".to_string(),
            State::Verified => "waiting for the commit".to_string(),
        }
    }

    /// A batch of pages: checks its sequence, round and every index, writes its pages and
    /// acknowledges it. `offset` is the stream offset, for errors.
    pub(super) fn pages(
        &mut self,
        b: &Batch,
        phase: &str,
        offset: u64,
        out: &mut Option<Box<dyn Write + Send>>,
    ) -> Result<(), MigrateError> {
        let (seq, pages) = (self.seq, self.mem.pages());
        if b.seq != seq {
            return Err(protocol(
                phase,
                ProtocolError::BatchOrder {
                    got: b.seq,
                    want: seq,
                },
            ));
        }
        if b.round != self.report.rounds {
            return Err(protocol(
                phase,
                ProtocolError::BatchRound {
                    seq,
                    got: b.round,
                    want: self.report.rounds,
                },
            ));
        }
        let page_error = |err| MigrateError::stream(phase, StreamError::Page { offset, err });
        // Every index first: nothing of a batch is written unless all of it fits.
        if let Some(&(page, _, _)) = b.entries.iter().find(|e| e.0 >= pages) {
            return Err(page_error(PageError::OutOfRange { page, pages }));
        }
        for (i, &(p, enc, ref r)) in b.entries.iter().enumerate() {
            // A raw page goes from the frame to guest memory; the others are decoded first, a
            // delta into the copy this side holds, whose changed words alone are stored back.
            let (data, zero) = match b.raw_page(i) {
                Some(d) => (d, self.mem.stopped_write_page_zero(PageIndex::new(p), d)?),
                None if enc == stream::Encoding::Delta => {
                    self.base(p, page_error)?;
                    b.patch_into(i, &mut self.buf).map_err(page_error)?;
                    let delta = b.data.get(r.clone()).unwrap_or_default();
                    for run in stream::delta::runs(delta) {
                        let words = run.start / 8..run.end.div_ceil(8);
                        self.mem
                            .stopped_write_words(PageIndex::new(p), &self.buf, words)?;
                    }
                    (&self.buf[..], self.buf.iter().all(|&x| x == 0))
                }
                None => {
                    b.page_into(i, &mut self.buf).map_err(page_error)?;
                    let z = self
                        .mem
                        .stopped_write_page_zero(PageIndex::new(p), &self.buf)?;
                    (&self.buf[..], z)
                }
            };
            if !self.digests.is_empty() {
                // The digest of the bytes written, not of a read-back: reading the page back
                // through the same address straight after the store could only show a broken
                // store loop, and cost a third of this path (docs/design/migration.md).
                self.digests.set(p, verify::page_digest_known(data, zero));
            }
            self.report.pages += 1;
            self.report.zero_pages += (enc == stream::Encoding::Zero) as u64;
        }
        // At most MAX_BATCH_PAGES per batch: the sums cannot overflow before the sequence
        // number would.
        self.round_pages += b.entries.len() as u64;
        send(out, &Msg::Ack { seq }, phase)?;
        self.seq = seq
            .checked_add(1)
            .ok_or_else(|| protocol(phase, ProtocolError::Overflow { what: "batch" }))?;
        Ok(())
    }

    /// Reads page `p` as this side holds it into the page buffer, the base of a delta: only
    /// if the welcome accepted deltas and the page arrived in this session (its digest says
    /// so when digests are kept).
    fn base(
        &mut self,
        p: u64,
        page_error: impl Fn(PageError) -> MigrateError,
    ) -> Result<(), MigrateError> {
        use stream::delta::DeltaError;
        let err = if !self.delta {
            Some(DeltaError::NotOffered)
        } else if !self.digests.is_empty() && self.digests.get(p) == Some(NEVER_RECEIVED) {
            Some(DeltaError::NoBase)
        } else {
            None
        };
        if let Some(err) = err {
            return Err(page_error(PageError::Delta { page: p, err }));
        }
        let at = PageIndex::new(p);
        let end = PageIndex::new(p.saturating_add(1));
        self.mem.stopped_read(at, end, &mut self.buf)?;
        Ok(())
    }

    /// Nothing of this connection's rounds has arrived: page streams may still be set up.
    pub(super) fn fresh(&self) -> bool {
        self.state == State::Rounds
            && self.seq == 0
            && self.report.rounds == 0
            && self.round_pages == 0
            && self.early.is_empty()
    }

    /// The guest received into.
    pub(super) fn guest(&self) -> &'g dyn Guest {
        self.guest
    }

    /// Page digests are kept ([`VerifyMode::Sent`]).
    pub(super) fn wants_digests(&self) -> bool {
        !self.digests.is_empty()
    }

    /// The source's session and attempt.
    pub(super) fn session(&self) -> (u64, u32) {
        (self.report.session, self.report.attempt)
    }

    /// Page streams in use (their pages arrive through [`Incoming::striped`]).
    pub(super) fn set_streams(&mut self, n: u32) {
        self.report.streams = n;
    }

    /// Most batches held for a later round: a window of batches per stream, and no more.
    const MAX_EARLY: usize = 16 * 1024;

    /// A page stream's batch, already checked, written and hashed on its thread: counted in
    /// its round and its digests kept. A batch of a later round waits for that round.
    pub(super) fn striped(&mut self, b: StripedBatch, phase: &str) -> Result<(), MigrateError> {
        let want = self.report.rounds;
        if self.state != State::Rounds || b.round < want {
            return Err(protocol(
                phase,
                ProtocolError::StreamRound { got: b.round, want },
            ));
        }
        if b.round > want {
            if self.early.len() >= Self::MAX_EARLY {
                return Err(protocol(
                    phase,
                    ProtocolError::StreamRound { got: b.round, want },
                ));
            }
            self.early.push(b);
            return Ok(());
        }
        for &(p, d) in &b.digests {
            self.digests.set(p, d);
        }
        self.report.pages += b.pages;
        self.report.zero_pages += b.zero;
        self.round_pages += b.pages;
        Ok(())
    }

    /// Whether page-stream batches of a later round are held (nothing but that round's end
    /// may come on the control connection then).
    pub(super) fn holds_early(&self) -> bool {
        !self.early.is_empty()
    }

    /// The end of a round: it must be the round in progress and count the pages its batches
    /// carried.
    pub(super) fn round_end(
        &mut self,
        round: u32,
        announced: u64,
        phase: &str,
    ) -> Result<(), MigrateError> {
        if round != self.report.rounds {
            return Err(protocol(
                phase,
                ProtocolError::RoundOrder {
                    got: round,
                    want: self.report.rounds,
                },
            ));
        }
        if announced != self.round_pages {
            return Err(protocol(
                phase,
                ProtocolError::RoundPages {
                    round,
                    announced,
                    received: self.round_pages,
                },
            ));
        }
        self.report.rounds = self
            .report
            .rounds
            .checked_add(1)
            .ok_or_else(|| protocol(phase, ProtocolError::Overflow { what: "round" }))?;
        self.round_pages = 0;
        // Range hashes of what this round wrote; the source paused only for the last one.
        self.digests.refresh();
        // Page streams' batches of the round now in progress.
        for b in std::mem::take(&mut self.early) {
            self.striped(b, phase)?;
        }
        Ok(())
    }

    /// A device-state blob: after a round ended, its id new, the guest's state bounded.
    pub(super) fn state_blob(&mut self, b: StateBlob, phase: &str) -> Result<(), MigrateError> {
        if self.round_pages != 0 {
            return Err(protocol(
                phase,
                ProtocolError::StateMidRound {
                    round: self.report.rounds,
                },
            ));
        }
        self.state = State::Device;
        if self.blobs.iter().any(|x| x.id == b.id) {
            return Err(protocol(phase, ProtocolError::StateTwice { id: b.id }));
        }
        // Each blob is at most a frame: the sum cannot overflow before the bound trips.
        self.blob_bytes += b.data.len() as u64;
        if self.blobs.len() >= MAX_STATE_BLOBS as usize || self.blob_bytes > MAX_STATE_BYTES {
            return Err(protocol(phase, ProtocolError::StateTooMuch));
        }
        self.blobs.push(b);
        Ok(())
    }

    /// The end of the device state: it must count what arrived; the guest restores it (and
    /// may refuse it, before the switch-over).
    pub(super) fn state_end(
        &mut self,
        blobs: u32,
        bytes: u64,
        phase: &str,
    ) -> Result<(), MigrateError> {
        if self.round_pages != 0 {
            return Err(protocol(
                phase,
                ProtocolError::StateMidRound {
                    round: self.report.rounds,
                },
            ));
        }
        let got_blobs = self.blobs.len() as u32;
        if blobs != got_blobs || bytes != self.blob_bytes {
            return Err(protocol(
                phase,
                ProtocolError::StateCount {
                    blobs,
                    bytes,
                    got_blobs,
                    got_bytes: self.blob_bytes,
                },
            ));
        }
        self.report.state_blobs = got_blobs;
        self.report.state_bytes = self.blob_bytes;
        self.guest.restore_state(std::mem::take(&mut self.blobs))?;
        self.state = State::Restored;
        Ok(())
    }

    /// Hashes of ranges `first..`: each range inside the guest and hashed once, compared
    /// with this side's memory.
    pub(super) fn hashes(
        &mut self,
        first: u64,
        hashes: &[[u8; 32]],
        phase: &str,
    ) -> Result<(), MigrateError> {
        if self.round_pages != 0 {
            return Err(protocol(
                phase,
                ProtocolError::HashesMidRound {
                    round: self.report.rounds,
                },
            ));
        }
        self.state = State::Hashes;
        let t = Instant::now();
        let count = hashes.len() as u64;
        let end = first.checked_add(count);
        if end.is_none_or(|e| e > self.nranges) {
            return Err(protocol(
                phase,
                ProtocolError::HashRange {
                    first,
                    count,
                    ranges: self.nranges,
                },
            ));
        }
        let pages = self.mem.pages();
        for (k, h) in hashes.iter().enumerate() {
            // `first + k < end <= nranges`: no overflow, and the index is in bounds.
            let i = first + k as u64;
            let seen = &mut self.hashed[i as usize];
            if *seen {
                return Err(protocol(phase, ProtocolError::HashTwice { range: i }));
            }
            *seen = true;
            let (a, b) = verify::range_pages(i, RANGE_PAGES, pages);
            let ours = if self.verify_mode == VerifyMode::Sent {
                // One digest per page (`new`), `i < nranges`: the range exists.
                self.digests.range(i).unwrap_or([0; 32])
            } else {
                // `b - a <= RANGE_PAGES`: the range fits the buffer.
                let bytes = &mut self.range[..(b - a) as usize * PAGE_BYTES];
                self.mem
                    .stopped_read(PageIndex::new(a), PageIndex::new(b), bytes)?;
                verify::hash_range(i, bytes)
            };
            if &ours != h {
                self.verdict.mismatched += 1;
                if self.verdict.first.len() < 8 {
                    self.verdict.first.push(i);
                }
            }
        }
        self.report.verify_time += t.elapsed();
        Ok(())
    }

    /// The verification request: it must name this guest's ranges; a range without a hash
    /// counts as differing. Answers the source, and fails unless everything matched.
    pub(super) fn verify(
        &mut self,
        ranges: u64,
        range_pages: u32,
        phase: &str,
        out: &mut Option<Box<dyn Write + Send>>,
    ) -> Result<(), MigrateError> {
        if ranges != self.nranges || range_pages != RANGE_PAGES {
            return Err(protocol(
                phase,
                ProtocolError::VerifyLayout {
                    ranges,
                    range_pages,
                    want_ranges: self.nranges,
                    want_range_pages: RANGE_PAGES,
                },
            ));
        }
        let missing = self.hashed.iter().filter(|h| !**h).count() as u64;
        self.verdict.mismatched += missing;
        send(
            out,
            &Msg::Verified {
                ranges: self.nranges,
                mismatched: self.verdict.mismatched,
                first: self.verdict.first.clone(),
            },
            phase,
        )?;
        if !self.verdict.ok() {
            return Err(MigrateError::Verification {
                ranges: self.nranges,
                mismatched: self.verdict.mismatched,
                range_pages: RANGE_PAGES,
                first: self.verdict.describe_first(),
            });
        }
        self.state = State::Verified;
        Ok(())
    }

    /// The report at the commit: `t0` was the preamble, `bytes` the stream read.
    pub(super) fn finish(self, t0: Instant, bytes: u64) -> DestReport {
        DestReport {
            total: t0.elapsed(),
            verify: self.verdict,
            bytes,
            ..self.report
        }
    }
}

/// Where the receive loop is in the protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum State {
    /// Pre-copy and stop-and-copy rounds: batches and round ends.
    Rounds,
    /// Device-state blobs.
    Device,
    /// The device state is restored; hashes may come.
    Restored,
    /// Verification hashes (no more pages).
    Hashes,
    /// Verified: only the commit may follow.
    Verified,
}
