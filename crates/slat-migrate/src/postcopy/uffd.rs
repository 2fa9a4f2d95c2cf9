//! The destination's demand paging: guest memory discarded (`MADV_DONTNEED`) and registered
//! with a userfaultfd in MISSING mode, so the first touch of a page that has not arrived —
//! a simulated vCPU thread's load or store, or KVM resolving a guest fault on the host
//! mapping — blocks in the kernel until `UFFDIO_COPY` places it.
//!
//! Driven through `libc` rather than the `userfaultfd` crate: that crate's `-sys` part runs
//! `bindgen` (libclang) at every build, which this project's build machines and CI do not
//! have, and pulls in `bindgen`, `cc` and `nix` for five ioctls.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

const UFFD_API: u64 = 0xAA;
const UFFDIO_API: u64 = 0xC018_AA3F;
const UFFDIO_REGISTER: u64 = 0xC020_AA00;
const UFFDIO_WAKE: u64 = 0x8010_AA02;
const UFFDIO_COPY: u64 = 0xC028_AA03;
const UFFDIO_REGISTER_MODE_MISSING: u64 = 1;
const UFFD_EVENT_PAGEFAULT: u8 = 0x12;
/// `sizeof(struct uffd_msg)`.
const MSG_SIZE: usize = 32;
const PAGE: u64 = slat_addr::PAGE_SIZE;

#[repr(C)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct UffdioRange {
    start: u64,
    len: u64,
}

#[repr(C)]
struct UffdioRegister {
    range: UffdioRange,
    mode: u64,
    ioctls: u64,
}

#[repr(C)]
struct UffdioCopy {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    copy: i64,
}

/// One userfaultfd (non-blocking, closed on exec).
#[derive(Debug)]
pub(crate) struct Uffd {
    fd: OwnedFd,
}

impl Uffd {
    /// A new userfaultfd with the API handshake done.
    pub(crate) fn new() -> io::Result<Uffd> {
        // SAFETY: the syscall takes one integer flags argument and returns a new fd or -1.
        let fd =
            unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | libc::O_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned to us and is owned by nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        let mut api = UffdioApi {
            api: UFFD_API,
            features: 0,
            ioctls: 0,
        };
        // SAFETY: UFFDIO_API reads and writes a `struct uffdio_api`, which `api` is.
        let rc = unsafe { libc::ioctl(fd.as_raw_fd(), UFFDIO_API as _, &mut api) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Uffd { fd })
    }

    /// Registers `[start, start + len)` (page aligned) for missing-page faults.
    pub(crate) fn register(&self, start: u64, len: u64) -> io::Result<()> {
        let mut r = UffdioRegister {
            range: UffdioRange { start, len },
            mode: UFFDIO_REGISTER_MODE_MISSING,
            ioctls: 0,
        };
        // SAFETY: UFFDIO_REGISTER reads and writes a `struct uffdio_register`; the kernel
        // checks the range against this process's mappings.
        let rc = unsafe { libc::ioctl(self.fd.as_raw_fd(), UFFDIO_REGISTER as _, &mut r) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Places one page at `dst` (page aligned, registered) with the bytes of `src` (one page)
    /// and wakes whoever waits for it. `Ok(false)`: the page was already there (placed before,
    /// or never missing) and is left as it is.
    pub(crate) fn copy(&self, dst: u64, src: &[u8]) -> io::Result<bool> {
        if src.len() as u64 != PAGE || dst % PAGE != 0 {
            return Err(io::Error::from(io::ErrorKind::InvalidInput));
        }
        loop {
            let mut c = UffdioCopy {
                dst,
                src: src.as_ptr() as u64,
                len: PAGE,
                mode: 0,
                copy: 0,
            };
            // SAFETY: UFFDIO_COPY reads one page from `src` (a live slice of that length)
            // and writes a `struct uffdio_copy`; the kernel installs the page atomically in
            // the registered range, so no thread of ours sees it half written.
            let rc = unsafe { libc::ioctl(self.fd.as_raw_fd(), UFFDIO_COPY as _, &mut c) };
            if rc == 0 {
                return Ok(true);
            }
            match io::Error::last_os_error().raw_os_error() {
                Some(libc::EEXIST) => return Ok(false),
                // The address space changed meanwhile: try again.
                Some(libc::EAGAIN) => continue,
                _ => return Err(io::Error::last_os_error()),
            }
        }
    }

    /// Wakes the threads waiting on the page at `addr` (it arrived before their fault was read).
    pub(crate) fn wake(&self, addr: u64) {
        let mut r = UffdioRange {
            start: addr & !(PAGE - 1),
            len: PAGE,
        };
        // SAFETY: UFFDIO_WAKE reads a `struct uffdio_range`. A failure leaves nobody waiting
        // that a later copy would not wake.
        let _ = unsafe { libc::ioctl(self.fd.as_raw_fd(), UFFDIO_WAKE as _, &mut r) };
    }

    /// Waits up to `timeout` for faults and appends their addresses to `out`.
    pub(crate) fn faults(&self, timeout: Duration, out: &mut Vec<u64>) -> io::Result<()> {
        let mut p = libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: one valid `pollfd`.
        let rc = unsafe { libc::poll(&mut p, 1, ms) };
        if rc <= 0 {
            return Ok(());
        }
        let mut buf = [0u8; MSG_SIZE * 64];
        loop {
            // SAFETY: reads at most `buf.len()` bytes into `buf`.
            let n = unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            if n < 0 {
                let e = io::Error::last_os_error();
                return match e.kind() {
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(()),
                    _ => Err(e),
                };
            }
            if n == 0 {
                return Ok(());
            }
            for m in buf[..n as usize].chunks_exact(MSG_SIZE) {
                if m[0] == UFFD_EVENT_PAGEFAULT {
                    // `struct uffd_msg`: event u8, 7 reserved bytes, then the pagefault's
                    // flags u64 and address u64.
                    let mut a = [0u8; 8];
                    a.copy_from_slice(&m[16..24]);
                    out.push(u64::from_ne_bytes(a));
                }
            }
        }
    }
}

/// Drops the pages of `[start, start + len)` (page aligned) so their next touch is a missing
/// page (anonymous private memory).
///
/// # Safety
///
/// The range is guest memory the caller owns that nothing may read until it is refilled
/// (by [`Uffd::copy`] after a registration): its contents are gone.
pub(crate) unsafe fn discard(start: u64, len: u64) -> io::Result<()> {
    // SAFETY: the caller's contract; MADV_DONTNEED keeps the mapping, only its pages go.
    let rc = unsafe {
        libc::madvise(
            start as *mut libc::c_void,
            len as usize,
            libc::MADV_DONTNEED,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
