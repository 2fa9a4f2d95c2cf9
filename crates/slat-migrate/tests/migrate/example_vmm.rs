//! Runs `examples/minimal_vmm.rs` (a kvm-ioctls VMM migrated over a UNIX socket) in this
//! process: its `main` checks the migration itself (memory equal at the switch-over, device
//! state handed back, the guest counting on at the destination) and fails on any difference.
//! Skipped, with the reason printed, where /dev/kvm cannot be opened.

#[path = "../../examples/minimal_vmm.rs"]
mod minimal_vmm;

#[test]
fn the_minimal_vmm_example_migrates_and_verifies() {
    if let Err(e) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
    {
        eprintln!("skipped: /dev/kvm is not usable ({e})");
        return;
    }
    if let Err(e) = minimal_vmm::main() {
        panic!("examples/minimal_vmm.rs failed: {e}");
    }
}
