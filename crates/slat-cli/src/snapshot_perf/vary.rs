//! snapshot-perf's `--vary` table (one full run over the `-k` list per combination, one table
//! whose rows are combination × k).

use super::{k_value, SnapshotPerfArgs};
use crate::args::guest_size;
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
    vary_key!(
        "k",
        "-k",
        Values::Text("a page count per vCPU, or `all`", |v| k_value(v).map(drop)),
        |a, v| { a.k = vec![k_value(v)?] }
    ),
    vary_key!(
        "bytes",
        "-b",
        Values::Text("a guest size per vCPU (64M, 1G, 16G)", |v| guest_size(v)
            .map(drop)),
        |a, v| { a.work.bytes = guest_size(v)? }
    ),
];

/// Examples under the keys in `--help`.
pub const EXAMPLES: &str = "Each row is a full run over the -k list; not with --repeat. For \
example: --vary log=get,clear,ring --vary vcpus=1,2, or the snapchange shape: --vary k=16,256 \
--vary bytes=64M,1G,16G.";
