//! The virtual control tree `MOUNTPOINT/.stagefs/`: `stats` is a JSON snapshot of the cache
//! counters, rendered when the file is opened so one read sees one consistent snapshot.
//!
//! Readers without a handle (kernels that skip `open`) get a shared rendering instead
//! ([`StatsFile`]): the kernel asks for the file's attributes before each read call and may split
//! one call into several reads, so a rendering per request would hand a reader the size of one
//! rendering and the bytes of others. A rendering is kept [`STATS_VIEW_AGE`], longer while it is
//! being read, and padded to a multiple of [`STATS_FILE_UNIT`] so that the next one has the same
//! size.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use stagefs_prefetch::locks::lock;
use stagefs_prefetch::StatsSnapshot;

/// Name of the control directory at the mount root.
pub const CONTROL_DIR: &str = ".stagefs";
/// Name of the stats file inside it.
pub const STATS_FILE: &str = "stats";
/// Name of the tensor-view tree at the mount root.
pub const VIEW_DIR: &str = ".npy";

/// The stats file's size is a multiple of this (the JSON padded with spaces): a rendering of
/// other counters then has the same size, so a reader never gets the size of one rendering and
/// the bytes of another (a shorter rendering read to a longer size returned other bytes after
/// its end: "trailing characters", seen under load).
pub const STATS_FILE_UNIT: usize = 8 << 10;
/// A rendering still being read (served within this) is kept, up to [`STATS_VIEW_MAX_AGE`], so
/// that the pieces of one reader's reads come from one rendering. [`STATS_VIEW_AGE`] itself:
/// a reader that polls slower never sees an older rendering than it would anyway, and a
/// reader whose next piece comes 20 ms later (the earlier value) is common on a loaded node
/// (CI, load 23: JSON torn between two renderings at a 512-byte piece).
pub const STATS_VIEW_IDLE: Duration = STATS_VIEW_AGE;
/// Oldest rendering served, however busy the file is.
pub const STATS_VIEW_MAX_AGE: Duration = Duration::from_secs(1);

/// How long one rendering of the stats file is served to readers without a handle: long
/// enough for a reader's attribute request and its reads to see one rendering, short enough
/// that a poll sees counters move.
pub const STATS_VIEW_AGE: Duration = Duration::from_millis(100);

/// One rendering of the stats file: when it was made (monotonic, and as its mtime), its bytes,
/// and when it was last served (monotonic).
type StatsView = (Instant, SystemTime, Arc<[u8]>, Instant);

/// The stats file's contents for the counters `s`.
pub fn render(s: &StatsSnapshot) -> String {
    let mut json =
        serde_json::to_string_pretty(s).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"));
    json.push('\n');
    json
}

/// The stats file as readers without a handle see it (see the module docs).
#[derive(Default)]
pub struct StatsFile {
    /// The current rendering, if any yet.
    view: Mutex<Option<StatsView>>,
}

impl StatsFile {
    /// The current rendering and when it was made: the one kept while it is young enough,
    /// else `fresh()` (the file's contents now) padded to a whole [`STATS_FILE_UNIT`].
    pub fn view(&self, fresh: impl FnOnce() -> String) -> (SystemTime, Arc<[u8]>) {
        let mut v = lock(&self.view);
        if let Some((at, taken, bytes, served)) = &mut *v {
            let age = at.elapsed();
            let reading = served.elapsed() < STATS_VIEW_IDLE;
            if age < STATS_VIEW_AGE || (reading && age < STATS_VIEW_MAX_AGE) {
                *served = Instant::now();
                return (*taken, bytes.clone());
            }
        }
        let mut json = fresh().into_bytes();
        // Padded to a whole unit with spaces before the final newline (still valid JSON).
        json.pop();
        let size = (json.len() + 1).div_ceil(STATS_FILE_UNIT) * STATS_FILE_UNIT;
        json.resize(size - 1, b' ');
        json.push(b'\n');
        let bytes: Arc<[u8]> = json.into();
        let taken = SystemTime::now();
        let now = Instant::now();
        *v = Some((now, taken, bytes.clone(), now));
        (taken, bytes)
    }
}
