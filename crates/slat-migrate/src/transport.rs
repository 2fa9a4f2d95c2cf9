//! Where a migration stream goes: any `Read + Write` byte stream, and the four kinds the
//! command line names in QEMU's URI forms — `tcp:HOST:PORT` (or a bare `HOST:PORT`),
//! `unix:PATH`, `fd:N` (an inherited descriptor) and `file:PATH`.
//!
//! A [`Channel`] is the two halves the ends need: a reader (the source reads the
//! destination's acknowledgements on a thread of its own, so it needs a second handle to the
//! same stream — `try_clone` for sockets, or whatever the caller's own transport provides),
//! a writer, and a way to break the stream off (to unblock that reader thread). A channel
//! with only a writer or only a reader is *one-way*: a file, or a pipe. Over a one-way
//! channel nothing is acknowledged: the source counts a page delivered once it is written,
//! the hello says so ([`crate::stream::Hello::one_way`]), and the reader verifies on its own
//! (a snapshot is a migration into a file; a restore is the destination reading it back).

use crate::error::{Cause, MigrateError, StreamError};
use std::fs::File;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Where to send a migration, or where to receive one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// A TCP address, `HOST:PORT`.
    Tcp(String),
    /// A UNIX stream socket's path.
    Unix(PathBuf),
    /// An inherited file descriptor: a connected stream socket, a pipe or a file.
    Fd(RawFd),
    /// A file: the source writes the whole migration into it, the destination reads it back.
    File(PathBuf),
}

/// Why an endpoint's text cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EndpointError {
    /// An unknown `scheme:`.
    #[error("`{0}`: expected tcp:HOST:PORT, unix:PATH, fd:N, file:PATH or HOST:PORT")]
    Scheme(String),
    /// `tcp:` or a bare address without a port.
    #[error("`{0}`: a TCP address is HOST:PORT")]
    Tcp(String),
    /// An empty path.
    #[error("`{0}`: the path is empty")]
    Path(String),
    /// `fd:` without a descriptor number, or stdin/stdout/stderr.
    #[error("`{0}`: fd:N takes an inherited descriptor number of 3 or more")]
    Fd(String),
}

impl std::str::FromStr for Endpoint {
    type Err = EndpointError;

    fn from_str(s: &str) -> Result<Endpoint, EndpointError> {
        let tcp = |a: &str| {
            // HOST:PORT with a numeric port (an IPv6 host is bracketed).
            match a.rsplit_once(':') {
                Some((h, p)) if !h.is_empty() && p.parse::<u16>().is_ok() => {
                    Ok(Endpoint::Tcp(a.to_string()))
                }
                _ => Err(EndpointError::Tcp(s.to_string())),
            }
        };
        let path = |p: &str, f: fn(PathBuf) -> Endpoint| {
            if p.is_empty() {
                Err(EndpointError::Path(s.to_string()))
            } else {
                Ok(f(PathBuf::from(p)))
            }
        };
        match s.split_once(':') {
            Some(("tcp", rest)) => tcp(rest),
            Some(("unix", rest)) => path(rest, Endpoint::Unix),
            Some(("file", rest)) => path(rest, Endpoint::File),
            Some(("fd", rest)) => match rest.parse::<RawFd>() {
                Ok(n) if n > 2 => Ok(Endpoint::Fd(n)),
                _ => Err(EndpointError::Fd(s.to_string())),
            },
            Some((scheme, _))
                if !scheme.is_empty()
                    && scheme.chars().all(|c| c.is_ascii_alphabetic())
                    && s.rsplit_once(':')
                        .is_some_and(|(_, p)| p.parse::<u16>().is_err()) =>
            {
                Err(EndpointError::Scheme(s.to_string()))
            }
            _ => tcp(s),
        }
    }
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Endpoint::Tcp(a) => write!(f, "tcp:{a}"),
            Endpoint::Unix(p) => write!(f, "unix:{}", p.display()),
            Endpoint::Fd(n) => write!(f, "fd:{n}"),
            Endpoint::File(p) => write!(f, "file:{}", p.display()),
        }
    }
}

/// Breaks a stream off: unblocks a reader waiting on it.
pub type Closer = Arc<dyn Fn() + Send + Sync>;

/// One migration's byte stream: a reader and a writer of the same stream (either may be
/// missing on a one-way channel), and how to break it off.
pub struct Channel {
    pub(crate) reader: Option<Box<dyn Read + Send>>,
    pub(crate) writer: Option<Box<dyn Write + Send>>,
    pub(crate) closer: Option<Closer>,
    /// Where it leads, for messages.
    pub peer: String,
}

impl Channel {
    /// A two-way channel over the halves of any stream: `reader` and `writer` must be the
    /// two directions of one connection, and `close` must make a blocked read of `reader`
    /// return (e.g. `shutdown(2)`). Set the read timeout on the stream first: a read that
    /// blocks forever holds the end that waits on it.
    pub fn duplex(
        reader: Box<dyn Read + Send>,
        writer: Box<dyn Write + Send>,
        close: Closer,
        peer: String,
    ) -> Channel {
        Channel {
            reader: Some(reader),
            writer: Some(writer),
            closer: Some(close),
            peer,
        }
    }

    /// A one-way channel the source writes (a file, a pipe).
    pub fn writer(w: Box<dyn Write + Send>, peer: String) -> Channel {
        Channel {
            reader: None,
            writer: Some(w),
            closer: None,
            peer,
        }
    }

    /// A one-way channel the destination reads (a file, a pipe).
    pub fn reader(r: Box<dyn Read + Send>, peer: String) -> Channel {
        Channel {
            reader: Some(r),
            writer: None,
            closer: None,
            peer,
        }
    }

    /// Nothing comes back over it.
    pub fn one_way(&self) -> bool {
        self.reader.is_none() || self.writer.is_none()
    }

    /// A connected TCP stream, with `timeout` on reads and writes.
    pub fn tcp(s: TcpStream, timeout: Duration) -> std::io::Result<Channel> {
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(timeout))?;
        s.set_write_timeout(Some(timeout))?;
        let peer = s
            .peer_addr()
            .map_or_else(|_| "tcp".to_string(), |a| format!("tcp:{a}"));
        Channel::socket(s, peer)
    }

    /// A connected UNIX stream socket (or any stream socket: its calls are the same), with
    /// `timeout` on reads and writes.
    pub fn unix(s: UnixStream, timeout: Duration, peer: String) -> std::io::Result<Channel> {
        s.set_read_timeout(Some(timeout))?;
        s.set_write_timeout(Some(timeout))?;
        Channel::socket(s, peer)
    }

    /// A two-way channel over a stream socket: one clone reads, another shuts the socket
    /// down to close the channel.
    fn socket<S: Socket>(s: S, peer: String) -> std::io::Result<Channel> {
        let r = s.try_clone_socket()?;
        let c = s.try_clone_socket()?;
        Ok(Channel::duplex(
            Box::new(r),
            Box::new(s),
            Arc::new(move || c.shutdown_both()),
            peer,
        ))
    }

    /// An inherited descriptor: a stream socket becomes a two-way channel; anything else (a
    /// pipe, a file) a one-way one, written by a source (`write`) or read by a destination.
    pub fn fd(fd: OwnedFd, timeout: Duration, write: bool) -> std::io::Result<Channel> {
        let peer = format!("fd:{}", std::os::fd::AsRawFd::as_raw_fd(&fd));
        // `read(2)`, `write(2)`, `shutdown(2)` and the timeout options are the same calls on
        // every stream socket, so a `UnixStream` drives a TCP socket too. A descriptor that is
        // not a socket refuses the timeout (ENOTSOCK).
        let s = UnixStream::from(fd);
        match s.set_read_timeout(Some(timeout)) {
            Ok(()) => Channel::unix(s, timeout, peer),
            Err(e) if e.raw_os_error() == Some(88) => {
                let f = File::from(OwnedFd::from(s));
                Ok(if write {
                    Channel::writer(Box::new(f), peer)
                } else {
                    Channel::reader(Box::new(f), peer)
                })
            }
            Err(e) => Err(e),
        }
    }
}

/// The stream sockets a channel is made of (TCP and UNIX): the same two calls on each.
trait Socket: Read + Write + Send + Sync + Sized + 'static {
    fn try_clone_socket(&self) -> std::io::Result<Self>;
    /// Shuts both directions down; a socket already shut is fine.
    fn shutdown_both(&self);
}

impl Socket for TcpStream {
    fn try_clone_socket(&self) -> std::io::Result<Self> {
        self.try_clone()
    }
    fn shutdown_both(&self) {
        let _ = self.shutdown(Shutdown::Both);
    }
}

impl Socket for UnixStream {
    fn try_clone_socket(&self) -> std::io::Result<Self> {
        self.try_clone()
    }
    fn shutdown_both(&self) {
        let _ = self.shutdown(Shutdown::Both);
    }
}

/// Takes ownership of inherited descriptor `n` (for `fd:N`).
///
/// # Safety
///
/// `n` must be an open descriptor that nothing else in this process owns, uses or closes
/// (one the process inherited for this purpose): the returned `OwnedFd` closes it when
/// dropped.
pub unsafe fn inherited_fd(n: RawFd) -> std::io::Result<OwnedFd> {
    // An fd that is not open would make `OwnedFd` close a number a later `open` reuses.
    if n < 0 || std::fs::metadata(format!("/proc/self/fd/{n}")).is_err() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("descriptor {n} is not open"),
        ));
    }
    // SAFETY: the caller owns `n` (this function's contract), and it is open.
    Ok(unsafe { OwnedFd::from_raw_fd(n) })
}

/// Opens a source's channel to `to` (not `fd:N`, which needs [`inherited_fd`] and
/// [`Channel::fd`]). `file:PATH` is created or truncated.
pub fn connect(to: &Endpoint, timeout: Duration) -> Result<Channel, MigrateError> {
    let err = |e: std::io::Error| MigrateError::Connect {
        addr: to.to_string(),
        why: Cause::new(e),
    };
    match to {
        Endpoint::Tcp(addr) => {
            let addrs: Vec<_> = addr.to_socket_addrs().map_err(err)?.collect();
            let mut last = std::io::Error::other("no address");
            for a in addrs {
                match TcpStream::connect_timeout(&a, timeout) {
                    Ok(s) => return Channel::tcp(s, timeout).map_err(err),
                    Err(e) => last = e,
                }
            }
            Err(err(last))
        }
        Endpoint::Unix(p) => {
            let s = UnixStream::connect(p).map_err(err)?;
            Channel::unix(s, timeout, to.to_string()).map_err(err)
        }
        Endpoint::File(p) => {
            let f = File::create(p).map_err(err)?;
            Ok(Channel::writer(Box::new(SyncOnFlush(f)), to.to_string()))
        }
        Endpoint::Fd(_) => Err(err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "an inherited descriptor is opened with inherited_fd and Channel::fd",
        ))),
    }
}

/// A file whose flush reaches the disk: a snapshot is complete only once it is durable.
struct SyncOnFlush(File);

impl Write for SyncOnFlush {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.write(b)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.0.sync_data()
    }
}

/// Accepts a destination's extra connections of one migration (its page streams, post-copy's
/// preempt channel): the next connection from the source.
pub type Acceptor = Box<dyn FnMut() -> Result<Channel, MigrateError> + Send>;

/// Opens a source's extra connections of one migration (its page streams, post-copy's
/// preempt channel): a new connection to the same destination.
pub type Connector = Box<dyn FnMut() -> Result<Channel, MigrateError> + Send>;

/// Where a destination takes incoming migrations from.
pub enum Listener {
    /// A TCP listening socket.
    Tcp(TcpListener),
    /// A UNIX listening socket (its file is removed when this is dropped).
    Unix(UnixListener, PathBuf),
    /// One inherited descriptor: one migration.
    Fd(Option<OwnedFd>),
    /// A file to restore from (read afresh on every accept).
    File(PathBuf),
}

impl Listener {
    /// Binds `at` (a `unix:` path must not exist yet; `fd:N` needs [`Listener::Fd`] built with
    /// [`inherited_fd`]).
    pub fn bind(at: &Endpoint) -> std::io::Result<Listener> {
        match at {
            Endpoint::Tcp(a) => TcpListener::bind(a).map(Listener::Tcp),
            Endpoint::Unix(p) => UnixListener::bind(p).map(|l| Listener::Unix(l, p.clone())),
            Endpoint::File(p) => {
                // Fail now, not at the first accept, if it cannot be read.
                File::open(p)?;
                Ok(Listener::File(p.clone()))
            }
            Endpoint::Fd(_) => Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "an inherited descriptor is opened with inherited_fd",
            )),
        }
    }

    /// Where it listens (a TCP port 0 resolved; TCP as a bare HOST:PORT).
    pub fn describe(&self) -> String {
        match self {
            Listener::Tcp(l) => l
                .local_addr()
                .map_or_else(|_| "tcp".into(), |a| a.to_string()),
            Listener::Unix(_, p) => format!("unix:{}", p.display()),
            Listener::Fd(_) => "an inherited descriptor".into(),
            Listener::File(p) => format!("file:{}", p.display()),
        }
    }

    /// The next incoming migration's channel, with `timeout` on its reads and writes.
    pub fn accept(&mut self, timeout: Duration) -> Result<Channel, MigrateError> {
        let io = |e: std::io::Error| {
            MigrateError::stream("accepting a connection", StreamError::Io(Cause::new(e)))
        };
        match self {
            Listener::Tcp(l) => {
                let (s, _) = l.accept().map_err(io)?;
                Channel::tcp(s, timeout).map_err(io)
            }
            Listener::Unix(l, p) => {
                let (s, _) = l.accept().map_err(io)?;
                Channel::unix(s, timeout, format!("unix:{}", p.display())).map_err(io)
            }
            Listener::Fd(fd) => {
                let fd = fd.take().ok_or_else(|| {
                    io(std::io::Error::other(
                        "the inherited descriptor carried its one migration",
                    ))
                })?;
                Channel::fd(fd, timeout, false).map_err(io)
            }
            Listener::File(p) => {
                let f = File::open(&*p).map_err(io)?;
                Ok(Channel::reader(
                    Box::new(std::io::BufReader::with_capacity(1 << 20, f)),
                    format!("file:{}", p.display()),
                ))
            }
        }
    }
}

impl Listener {
    /// The acceptor of the extra connections that come to this listener (a clone of its
    /// socket, taking each within `timeout`); `None` for a descriptor or a file, which carry
    /// one stream, or a socket that cannot be cloned.
    pub fn acceptor(&self, timeout: Duration) -> Option<Acceptor> {
        match self {
            Listener::Tcp(l) => {
                let l = l.try_clone().ok()?;
                Some(Box::new(move || accept_tcp_within(&l, timeout, timeout)))
            }
            Listener::Unix(l, p) => {
                let (l, peer) = (l.try_clone().ok()?, format!("unix:{}", p.display()));
                Some(Box::new(move || {
                    let io = |e: std::io::Error| {
                        MigrateError::stream(
                            "accepting a connection",
                            StreamError::Io(Cause::new(e)),
                        )
                    };
                    let s = poll_accept(|nb| l.set_nonblocking(nb), || l.accept(), timeout)
                        .map_err(io)?;
                    Channel::unix(s, timeout, peer.clone()).map_err(io)
                }))
            }
            Listener::Fd(_) | Listener::File(_) => None,
        }
    }

    /// [`Listener::accept`] for a connection due now (a page stream its source announced):
    /// one that does not come within `within` fails, so a source that announces streams and
    /// never opens them cannot hold the destination. Polls a non-blocking socket; the
    /// listener is blocking again afterwards.
    pub fn accept_within(
        &mut self,
        timeout: Duration,
        within: Duration,
    ) -> Result<Channel, MigrateError> {
        let io = |e: std::io::Error| {
            MigrateError::stream("accepting a page stream", StreamError::Io(Cause::new(e)))
        };
        match self {
            Listener::Tcp(l) => {
                let s =
                    poll_accept(|nb| l.set_nonblocking(nb), || l.accept(), within).map_err(io)?;
                Channel::tcp(s, timeout).map_err(io)
            }
            Listener::Unix(l, p) => {
                let s =
                    poll_accept(|nb| l.set_nonblocking(nb), || l.accept(), within).map_err(io)?;
                Channel::unix(s, timeout, format!("unix:{}", p.display())).map_err(io)
            }
            _ => self.accept(timeout),
        }
    }
}

/// A TCP connection accepted on `l` within `within` (see [`Listener::accept_within`]).
pub fn accept_tcp_within(
    l: &TcpListener,
    timeout: Duration,
    within: Duration,
) -> Result<Channel, MigrateError> {
    let io = |e: std::io::Error| {
        MigrateError::stream("accepting a page stream", StreamError::Io(Cause::new(e)))
    };
    let s = poll_accept(|nb| l.set_nonblocking(nb), || l.accept(), within).map_err(io)?;
    Channel::tcp(s, timeout).map_err(io)
}

/// A socket that can go back to blocking mode.
trait Blocking {
    fn set_blocking(&self) -> std::io::Result<()>;
}

impl Blocking for TcpStream {
    fn set_blocking(&self) -> std::io::Result<()> {
        self.set_nonblocking(false)
    }
}

impl Blocking for UnixStream {
    fn set_blocking(&self) -> std::io::Result<()> {
        self.set_nonblocking(false)
    }
}

/// Polls `accept` on a listener made non-blocking by `set_nb` until a connection comes or
/// `within` passes; the listener and the connection are blocking afterwards.
fn poll_accept<S: Blocking, A>(
    set_nb: impl Fn(bool) -> std::io::Result<()>,
    accept: impl Fn() -> std::io::Result<(S, A)>,
    within: Duration,
) -> std::io::Result<S> {
    let deadline = std::time::Instant::now() + within;
    set_nb(true)?;
    let r = loop {
        match accept() {
            Ok((s, _)) => break s.set_blocking().map(|()| s),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if std::time::Instant::now() >= deadline {
                    break Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!("no connection within {within:?}"),
                    ));
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => break Err(e),
        }
    };
    let back = set_nb(false);
    let s = r?;
    back.map(|()| s)
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Listener::Unix(_, p) = self {
            let _ = std::fs::remove_file(p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris_parse_as_qemu_writes_them() {
        let p = |s: &str| s.parse::<Endpoint>();
        assert_eq!(
            p("tcp:127.0.0.1:7000"),
            Ok(Endpoint::Tcp("127.0.0.1:7000".into()))
        );
        assert_eq!(
            p("localhost:7000"),
            Ok(Endpoint::Tcp("localhost:7000".into()))
        );
        assert_eq!(p("[::1]:7000"), Ok(Endpoint::Tcp("[::1]:7000".into())));
        assert_eq!(
            p("unix:/tmp/m.sock"),
            Ok(Endpoint::Unix("/tmp/m.sock".into()))
        );
        assert_eq!(p("file:/tmp/snap"), Ok(Endpoint::File("/tmp/snap".into())));
        assert_eq!(p("fd:5"), Ok(Endpoint::Fd(5)));
        assert!(matches!(p("fd:1"), Err(EndpointError::Fd(_))));
        assert!(matches!(p("fd:x"), Err(EndpointError::Fd(_))));
        assert!(matches!(p("unix:"), Err(EndpointError::Path(_))));
        assert!(matches!(p("exec:cat"), Err(EndpointError::Scheme(_))));
        assert!(matches!(p("tcp:host"), Err(EndpointError::Tcp(_))));
        assert!(matches!(p("nonsense"), Err(EndpointError::Tcp(_))));
        assert!(matches!(p(""), Err(EndpointError::Tcp(_))));
        for e in ["tcp:1.2.3.4:5", "unix:/a", "fd:7", "file:/b"] {
            assert_eq!(p(e).unwrap().to_string(), e);
        }
    }
}
