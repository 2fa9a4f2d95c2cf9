// The `both_formats!` macro, included (not a module: `macro_rules!` scope is textual) by
// `crates/slat/tests/engine/common/mod.rs` and `crates/slat-machine/tests/machine/common/mod.rs`.

/// Instantiates generic test bodies (`fn name<F: PteFormat>()`) once per page-table format, as
/// `ept::name` (`slat::Ept`) and `stage2::name` (`slat::Stage2`):
///
/// ```ignore
/// both_formats! {
///     a_test,
///     // Extra attributes for the Stage2 instance only (an engine bug being fixed, say).
///     #[stage2(ignore = "stage2: one-line reason")]
///     another_test,
///     // No Stage2 instance at all: the behaviour does not exist there (say why).
///     #[ept_only]
///     hardware_dirty_bit_test,
/// }
/// ```
macro_rules! both_formats {
    ($($list:tt)*) => {
        mod ept {
            instantiate_for!(Ept; $($list)*);
        }
        mod stage2 {
            instantiate_for!(Stage2; $($list)*);
        }
    };
}

/// [`both_formats!`]'s worker: the `#[test]` functions of one format, one list entry at a time.
macro_rules! instantiate_for {
    (@test $fmt:ident [$(#[$attr:meta])*] $name:ident) => {
        #[test]
        $(#[$attr])*
        fn $name() {
            super::$name::<slat::$fmt>()
        }
    };
    ($fmt:ident;) => {};
    (Ept; #[ept_only] $name:ident $(, $($rest:tt)*)?) => {
        instantiate_for!(@test Ept [] $name);
        instantiate_for!(Ept; $($($rest)*)?);
    };
    (Stage2; #[ept_only] $name:ident $(, $($rest:tt)*)?) => {
        instantiate_for!(Stage2; $($($rest)*)?);
    };
    (Ept; #[stage2($($attr:meta),*)] $name:ident $(, $($rest:tt)*)?) => {
        instantiate_for!(@test Ept [] $name);
        instantiate_for!(Ept; $($($rest)*)?);
    };
    (Stage2; #[stage2($($attr:meta),*)] $name:ident $(, $($rest:tt)*)?) => {
        instantiate_for!(@test Stage2 [$(#[$attr])*] $name);
        instantiate_for!(Stage2; $($($rest)*)?);
    };
    ($fmt:ident; $name:ident $(, $($rest:tt)*)?) => {
        instantiate_for!(@test $fmt [] $name);
        instantiate_for!($fmt; $($($rest)*)?);
    };
}
