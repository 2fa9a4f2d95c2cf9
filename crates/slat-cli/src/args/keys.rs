//! The `--vary` keys several benchmarks share, each generic over the flags it sets; a
//! benchmark's table lists the ones it takes (its own keys beside them).

use super::{BackendArg, DirtyArgs, FormatArg, LogArgs, LogKind, MachineArgs, Switch, Workload};
use crate::driver::vary::{count_in, engine, names, pick, variants, Key, Values};
use crate::vary_key;
use slat::{
    CmoPolicy, DirtyTrack, GetLogVariant, MmuLockKind, RebuildOrder, RecoverVariant, WrprotVariant,
};

/// The flag groups a shared key sets.
pub trait Flags {
    fn work(&mut self) -> &mut Workload;
    fn machine(&mut self) -> &mut MachineArgs;
    fn log(&mut self) -> &mut LogArgs;
    fn backends(&mut self) -> &mut Vec<BackendArg>;
}

/// Flags with the dirty-logging switches too.
pub trait DirtyFlags: Flags {
    fn dirty(&mut self) -> &mut DirtyArgs;
}

/// `vcpus`: `-v`, 1-512.
pub const fn vcpus<A: Flags>() -> Key<A> {
    let values = Values::Text("1-512", |v| count_in(v, 1, 512).map(drop));
    vary_key!("vcpus", "-v", values, |a, v| {
        a.work().vcpus = count_in(v, 1, 512)? as u32
    })
}

/// `backend`: one machine per row.
pub const fn backend<A: Flags>() -> Key<A> {
    let values = Values::OneOf(names::<BackendArg>);
    vary_key!("backend", "--backend", values, |a, v| {
        *a.backends() = vec![pick(v)?]
    })
}

/// `log`: get, clear or ring (the harvest, keeping the ring size and chunk given).
pub const fn log<A: Flags>() -> Key<A> {
    let values = Values::OneOf(names::<LogKind>);
    vary_key!("log", "-g, --dirty-ring, manual protect", values, |a, v| {
        a.log().set_kind(pick(v)?)
    })
}

/// A key per engine switch: `name`, the flag it sets, its values, how a value parses, and the
/// field it sets.
macro_rules! switch_keys {
    ($($f:ident: $tr:ident, $name:literal, $values:expr, $parse:ident, $group:ident.$field:ident;)*) => {$(
        #[doc = concat!("`", $name, "`.")]
        pub const fn $f<A: $tr>() -> Key<A> {
            Key {
                name: $name,
                sets: concat!("--", $name),
                values: $values,
                apply: |a, v| {
                    a.$group().$field = $parse(v)?;
                    Ok(())
                },
            }
        }
    )*};
}

switch_keys! {
    format: Flags, "format", Values::OneOf(names::<FormatArg>), pick, machine.format;
    fast_pf: Flags, "fast-pf", Values::OneOf(names::<Switch>), pick, machine.fast_pf;
    mmu_lock: Flags, "mmu-lock", Values::OneOf(variants::<MmuLockKind>), engine, machine.mmu_lock;
    ad_bits: Flags, "ad-bits", Values::OneOf(names::<Switch>), pick, machine.ad_bits;
    cmo: Flags, "cmo", Values::OneOf(variants::<CmoPolicy>), engine, machine.cmo;
    get_log: DirtyFlags, "get-dirty-log", Values::OneOf(variants::<GetLogVariant>), engine, dirty.get_log;
    tracking: DirtyFlags, "dirty-tracking", Values::OneOf(variants::<DirtyTrack>), engine, dirty.tracking;
    eager_split: DirtyFlags, "eager-split", Values::OneOf(names::<Switch>), pick, dirty.eager_split;
    recover: DirtyFlags, "recover", Values::OneOf(variants::<RecoverVariant>), engine, dirty.recover;
    rebuild: DirtyFlags, "rebuild", Values::OneOf(variants::<RebuildOrder>), engine, dirty.rebuild;
    wrprot: DirtyFlags, "wrprot", Values::OneOf(variants::<WrprotVariant>), engine, dirty.wrprot;
}

/// Implements [`Flags`] (and with `dirty`, [`DirtyFlags`]) for a benchmark's flags whose
/// groups have the usual field names.
#[macro_export]
macro_rules! vary_flags {
    ($t:ty) => {
        impl $crate::args::keys::Flags for $t {
            fn work(&mut self) -> &mut $crate::args::Workload {
                &mut self.work
            }
            fn machine(&mut self) -> &mut $crate::args::MachineArgs {
                &mut self.machine
            }
            fn log(&mut self) -> &mut $crate::args::LogArgs {
                &mut self.log
            }
            fn backends(&mut self) -> &mut Vec<$crate::args::BackendArg> {
                &mut self.backend
            }
        }
    };
    ($t:ty, dirty) => {
        $crate::vary_flags!($t);
        impl $crate::args::keys::DirtyFlags for $t {
            fn dirty(&mut self) -> &mut $crate::args::DirtyArgs {
                &mut self.dirty
            }
        }
    };
}
