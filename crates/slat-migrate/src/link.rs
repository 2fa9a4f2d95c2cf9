//! The source's sending side of the connection: a bandwidth cap, a byte count, and the
//! fault injection the tests use to cut or corrupt a stream at a chosen byte.

use crate::transport::Closer;
use std::io::{self, Write};
use std::time::{Duration, Instant};

/// Deliberate faults, for tests: a cut connection, a corrupted byte, a wrong protocol
/// version, and a broken source that skips the final harvest or forgets harvested pages when
/// an attempt fails. Never set outside tests and demonstrations.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Faults {
    /// Shut the connection down once this many stream bytes were written.
    pub cut_after: Option<u64>,
    /// Flip the bits of the stream byte at this offset.
    pub corrupt_at: Option<u64>,
    /// Send this protocol version instead of ours.
    pub version: Option<u32>,
    /// Skip the harvest after the vCPUs stop (pages dirtied in the last round stay behind).
    pub skip_final_harvest: bool,
    /// On failure, drop the pages harvested but not acknowledged instead of keeping them
    /// owed (Firecracker issue #4545's bug).
    pub skip_merge_back: bool,
    /// Wait this long between the decision to stop pre-copy and the pause, with the guest
    /// still writing: widens the window only the final harvest covers (harmless for a
    /// correct source).
    pub pause_delay: Option<std::time::Duration>,
    /// Cut the connection this many bytes into the device state.
    pub cut_in_state: Option<u64>,
    /// Cut the connection this many bytes into the stop-and-copy round.
    pub cut_in_final_round: Option<u64>,
    /// Cut page stream `.0` once this many of its bytes were written.
    pub cut_stream: Option<(u32, u64)>,
    /// Cut post-copy's preempt channel once this many bytes were written on it.
    pub cut_preempt_after: Option<u64>,
}

/// Writes to the destination with an optional bandwidth cap.
pub(crate) struct Link {
    s: Box<dyn Write + Send>,
    /// Breaks the stream off (for an injected cut).
    close: Option<Closer>,
    written: u64,
    /// Bytes per second (0: unlimited).
    cap: u64,
    /// Start of the cap's accounting window, and bytes sent in it.
    window: (Instant, u64),
    faults: Faults,
}

/// Idle time after which the cap's window starts again.
const IDLE: Duration = Duration::from_millis(10);

/// The cap is enforced per chunk of this size, so a big frame does not go out in one burst.
const CHUNK: usize = 64 << 10;

impl Link {
    pub(crate) fn new(
        s: Box<dyn Write + Send>,
        close: Option<Closer>,
        cap: u64,
        faults: Faults,
    ) -> Link {
        Link {
            s,
            close,
            written: 0,
            cap,
            window: (Instant::now(), 0),
            faults,
        }
    }

    /// Bytes written so far.
    pub(crate) fn written(&self) -> u64 {
        self.written
    }

    /// Cuts the connection `n` bytes from here (a test fault).
    pub(crate) fn cut_in(&mut self, n: u64) {
        self.faults.cut_after = Some(self.written + n);
    }

    fn pace(&mut self, n: usize) {
        if self.cap == 0 {
            return;
        }
        // A window whose bytes were all due a while ago (the link sat idle: the setup before
        // round 0, the wait for a round's last acknowledgements) starts again here, so the
        // idle time is not banked as a burst above the cap.
        let (t0, sent) = self.window;
        let caught_up = Duration::from_secs_f64(sent as f64 / self.cap as f64);
        if t0.elapsed() > caught_up + IDLE {
            self.window = (Instant::now(), 0);
        }
        let (t0, sent) = self.window;
        let due = Duration::from_secs_f64((sent + n as u64) as f64 / self.cap as f64);
        let elapsed = t0.elapsed();
        if due > elapsed {
            std::thread::sleep(due - elapsed);
        }
        // Restart the window now and then so an idle period does not bank a burst.
        if elapsed > Duration::from_secs(1) {
            self.window = (Instant::now(), 0);
        } else {
            self.window.1 += n as u64;
        }
    }
}

impl Write for Link {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        // Uncapped, a frame goes in one write: 64 KiB writes cost a syscall per 16 pages.
        let mut n = if self.cap == 0 {
            buf.len()
        } else {
            buf.len().min(CHUNK)
        };
        if let Some(cut) = self.faults.cut_after {
            if self.written >= cut {
                if let Some(c) = &self.close {
                    c();
                }
                return Err(io::Error::new(
                    io::ErrorKind::ConnectionAborted,
                    format!("connection cut after {cut} bytes (injected)"),
                ));
            }
            n = n.min((cut - self.written) as usize);
        }
        self.pace(n);
        let w = match self.faults.corrupt_at {
            Some(at) if at >= self.written && at < self.written + n as u64 => {
                let mut copy = buf[..n].to_vec();
                copy[(at - self.written) as usize] ^= 0xff;
                self.s.write(&copy)?
            }
            _ => self.s.write(&buf[..n])?,
        };
        self.written += w as u64;
        Ok(w)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.s.flush()
    }
}
