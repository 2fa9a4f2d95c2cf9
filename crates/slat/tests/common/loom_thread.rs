//! Model threads with room for the engine's clocked wrappers (`sync.rs`): loom's default
//! coroutine stack (32 KiB) is too small for a fault's frames. Included by each loom model
//! as its `thread` module (`#[path]`), so one definition serves them all.

#[allow(unused_imports)] // not every model yields
pub use loom::thread::{yield_now, JoinHandle};

/// A model thread's stack.
const MODEL_STACK: usize = 1 << 20;

/// `loom::thread::spawn` on a [`MODEL_STACK`] stack.
pub fn spawn<F, T>(f: F) -> JoinHandle<T>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    loom::thread::Builder::new()
        .stack_size(MODEL_STACK)
        .spawn(f)
        .expect("spawn a model thread")
}
