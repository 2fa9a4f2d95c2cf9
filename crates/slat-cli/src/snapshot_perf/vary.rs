//! snapshot-perf's `--vary` table (one full run over the `-k` list per combination, one table
//! whose rows are combination × k).

use super::SnapshotPerfArgs;
use crate::args::{BackendArg, LogKind};
use crate::driver::vary::{count_in, names, pick, Key, Values};
use crate::vary_key;

/// The table.
pub const VARY: &[Key<SnapshotPerfArgs>] = &[
    vary_key!(
        "vcpus",
        "-v",
        Values::Text("1-512", |v| count_in(v, 1, 512).map(drop)),
        |a, v| { a.work.vcpus = count_in(v, 1, 512)? as u32 }
    ),
    vary_key!(
        "log",
        "-g, --dirty-ring, manual protect",
        Values::OneOf(names::<LogKind>),
        |a, v| { a.log.set_kind(pick(v)?) }
    ),
    vary_key!(
        "order",
        "-a",
        Values::OneOf(|| vec!["seq".into(), "random".into()]),
        |a, v| { a.random = v == "random" }
    ),
    vary_key!(
        "backend",
        "--backend",
        Values::OneOf(names::<BackendArg>),
        |a, v| { a.backend = vec![pick(v)?] }
    ),
];

/// Examples under the keys in `--help`.
pub const EXAMPLES: &str = "Each row is a full run over the -k list; not with --repeat. For \
example: --vary log=get,clear,ring --vary vcpus=1,2.";
