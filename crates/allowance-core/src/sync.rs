//! The lock the shared ledger uses: parking_lot's, or shuttle's when the
//! locking protocol is being model-checked (`--cfg allowance_shuttle`).

#[cfg(not(allowance_shuttle))]
pub(crate) use parking_lot::{Mutex, MutexGuard};

#[cfg(allowance_shuttle)]
mod imp {
    /// A shuttle mutex with parking_lot's shape (no poisoning).
    #[derive(Debug, Default)]
    pub(crate) struct Mutex<T>(shuttle::sync::Mutex<T>);

    pub(crate) type MutexGuard<'a, T> = shuttle::sync::MutexGuard<'a, T>;

    impl<T> Mutex<T> {
        pub(crate) fn new(t: T) -> Self {
            Mutex(shuttle::sync::Mutex::new(t))
        }

        pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
            self.0.lock().unwrap_or_else(|e| e.into_inner())
        }
    }
}

#[cfg(allowance_shuttle)]
pub(crate) use imp::{Mutex, MutexGuard};
