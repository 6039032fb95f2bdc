//! Where pushed pages go: the kernel's page cache, through the fuser adapter's notifier
//! (`FUSE_NOTIFY_STORE`), or a recorder in tests.
//!
//! The trait sits below every module that pushes (the walker, the pushers, the hint server)
//! and below [`crate::files::Files`], which holds the sink, so none of them imports another
//! to reach it.

/// Where pushed file contents go: the kernel's page cache of inode `ino`.
pub trait PageSink: Send + Sync {
    /// Offers `data` as the contents of inode `ino` at `offset`; false if it was refused (the
    /// kernel no longer knows the inode, or the mount is going away).
    fn store(&self, ino: u64, offset: u64, data: &[u8]) -> bool;

    /// Whether pages of `ino` would be kept (asked before reading them from scratch).
    fn holds(&self, _ino: u64) -> bool {
        true
    }
}

/// Lets a closure serve as a sink (tests record pushes this way).
impl<F: Fn(u64, u64, &[u8]) -> bool + Send + Sync> PageSink for F {
    fn store(&self, ino: u64, offset: u64, data: &[u8]) -> bool {
        self(ino, offset, data)
    }
}
