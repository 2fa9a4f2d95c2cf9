//! The errors of this crate's own operations (not of a machine's).

/// A request this crate refuses before touching any machine.
#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    /// A configuration value is out of range, or does not fit the machine.
    #[error("{0}")]
    Config(String),
    /// A native-baseline thread could not be started.
    #[error("cannot start a native baseline thread: {0}")]
    Thread(#[source] std::io::Error),
}
