//! snapshot-perf's `--vary` table (one full run over the `-k` list per combination, one table
//! whose rows are combination × k).

use super::SnapshotPerfArgs;
use crate::args::keys::{backend, log, vcpus};
use crate::driver::vary::{Key, Values};
use crate::vary_key;

crate::vary_flags!(SnapshotPerfArgs);

pub const VARY: &[Key<SnapshotPerfArgs>] = &[
    vcpus(),
    log(),
    vary_key!(
        "order",
        "-a",
        Values::OneOf(|| vec!["seq".into(), "random".into()]),
        |a, v| { a.random = v == "random" }
    ),
    backend(),
];

/// Examples under the keys in `--help`.
pub const EXAMPLES: &str = "Each row is a full run over the -k list; not with --repeat. For \
example: --vary log=get,clear,ring --vary vcpus=1,2.";
