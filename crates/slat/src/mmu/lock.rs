//! The MMU lock: a reader/writer lock (faults share it) or one mutex ([`MmuLockKind`]).

use crate::config::MmuLockKind;
use crate::sync::{self, Mutex, RwLock};

pub(crate) enum MmuLock {
    Rw(RwLock<()>),
    Mutex(Mutex<()>),
}

/// Held for a "read" (shared) MMU operation; exclusive under the mutex variant.
#[allow(dead_code)]
pub(crate) enum ReadGuard<'a> {
    Rw(sync::RwLockReadGuard<'a, ()>),
    Mutex(sync::MutexGuard<'a, ()>),
}

/// Held for an exclusive MMU operation.
pub(crate) enum WriteGuard<'a> {
    Rw(sync::RwLockWriteGuard<'a, ()>),
    Mutex(sync::MutexGuard<'a, ()>),
}

impl WriteGuard<'_> {
    /// Lets waiting faults run, then re-takes the lock.
    pub(crate) fn bump(&mut self) {
        match self {
            WriteGuard::Rw(g) => sync::bump_write(g),
            WriteGuard::Mutex(g) => sync::bump_mutex(g),
        }
    }
}

impl MmuLock {
    pub(crate) fn read(&self) -> ReadGuard<'_> {
        match self {
            MmuLock::Rw(l) => ReadGuard::Rw(sync::read(l)),
            MmuLock::Mutex(m) => ReadGuard::Mutex(sync::lock(m)),
        }
    }
    pub(crate) fn write(&self) -> WriteGuard<'_> {
        match self {
            MmuLock::Rw(l) => WriteGuard::Rw(sync::write(l)),
            MmuLock::Mutex(m) => WriteGuard::Mutex(sync::lock(m)),
        }
    }
}

impl MmuLock {
    pub(crate) fn new(kind: MmuLockKind) -> Self {
        match kind {
            MmuLockKind::RwLock => MmuLock::Rw(RwLock::new(())),
            MmuLockKind::Mutex => MmuLock::Mutex(Mutex::new(())),
        }
    }
}
