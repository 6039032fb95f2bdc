//! The virtual control tree `MOUNTPOINT/.stagefs/`: `stats` is a JSON snapshot of the cache
//! counters, rendered when the file is opened so one read sees one consistent snapshot.

/// Name of the control directory at the mount root.
pub const CONTROL_DIR: &str = ".stagefs";
/// Name of the stats file inside it.
pub const STATS_FILE: &str = "stats";
/// Name of the tensor-view tree at the mount root.
pub const VIEW_DIR: &str = ".npy";
