//! The CLI's errors. Every subcommand returns [`CliError`]; `main` alone turns one into a line
//! on stderr and an exit status: 2 for input the command refuses (nothing was run, or the
//! settings cannot work together), 1 for a failure while running (a machine error, a lost
//! dirty page, a failed migration).

use thiserror::Error;

/// Why a subcommand stopped.
#[derive(Debug, Clone, Error)]
pub enum CliError {
    /// The flags cannot run: the message names the flag and what to change. Exit status 2.
    #[error("{0}")]
    BadInput(String),
    /// The run failed. Exit status 1.
    #[error("error: {0}")]
    Runtime(String),
}

impl CliError {
    /// A refusal of the given flags (exit status 2).
    pub fn bad(msg: impl std::fmt::Display) -> CliError {
        CliError::BadInput(msg.to_string())
    }

    /// What went wrong, without the `error: ` a runtime failure's line starts with: for an
    /// error reported inside another message (a table row that failed), which must not
    /// repeat the prefix.
    pub fn message(&self) -> &str {
        match self {
            CliError::BadInput(m) | CliError::Runtime(m) => m,
        }
    }

    /// The exit status `main` uses for this error.
    pub fn exit_code(&self) -> i32 {
        match self {
            CliError::BadInput(_) => 2,
            CliError::Runtime(_) => 1,
        }
    }
}

/// Machine and engine errors are runtime failures.
impl From<String> for CliError {
    fn from(e: String) -> CliError {
        CliError::Runtime(e)
    }
}

/// A runtime failure described in words.
impl From<&str> for CliError {
    fn from(e: &str) -> CliError {
        CliError::Runtime(e.to_string())
    }
}

/// The result of a subcommand.
pub type CliResult<T = ()> = Result<T, CliError>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_has_no_prefix_and_a_line_has_one() {
        let e = CliError::from("the worker died");
        assert_eq!(e.to_string(), "error: the worker died");
        assert_eq!(e.message(), "the worker died");
        assert_eq!(CliError::bad("--jobs 0").message(), "--jobs 0");
    }
}
