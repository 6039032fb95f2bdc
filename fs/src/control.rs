//! The virtual control tree `MOUNTPOINT/.stagefs/`: `stats` is a JSON snapshot of the cache
//! counters, rendered when the file is opened so one read sees one consistent snapshot.
//!
//! Readers without a handle (kernels that skip `open`) get a shared rendering instead
//! ([`StatsFile`]): the kernel asks for the file's attributes before each read call and may split
//! one call into several reads, so a rendering per request would hand a reader the size of one
//! rendering and the bytes of others. A new rendering is made only when the file is looked up
//! by name (an `open` or `stat` of the path: the kernel keeps no entry for it) and the kept one
//! is older than [`STATS_VIEW_AGE`]; the attribute requests and reads of a reader that has the
//! file open are served the kept one (up to [`STATS_VIEW_HELD`]), however slowly it reads. Each
//! rendering is padded to a multiple of [`STATS_FILE_UNIT`] so that the next one has the same
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
/// A rendering still being read (served within this) is kept on a lookup too, up to
/// [`STATS_VIEW_MAX_AGE`], so that another reader's open does not replace the rendering a
/// reader is in the middle of.
pub const STATS_VIEW_IDLE: Duration = STATS_VIEW_AGE;
/// Oldest rendering a lookup keeps, however busy the file is.
pub const STATS_VIEW_MAX_AGE: Duration = Duration::from_secs(1);

/// How long one rendering of the stats file is kept for the next lookup: short enough that a
/// poll (which opens the file anew) sees counters move.
pub const STATS_VIEW_AGE: Duration = Duration::from_millis(100);

/// Oldest rendering served to the attribute requests and reads of a reader that has the file
/// open. Under load a reader's next piece may come seconds later (CI, load 23: JSON torn
/// between two renderings at a 512-byte piece when these requests could replace the rendering
/// after 100 ms idle or 1 s); a descriptor kept open and read again from the start sees
/// counters at most this old.
pub const STATS_VIEW_HELD: Duration = Duration::from_secs(10);

/// Why the stats file is looked at, which decides whether a new rendering may be made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatsLook {
    /// A lookup by name: an `open` or `stat` of the path.
    Lookup,
    /// The attribute request or read of a reader that has the file open (or a listing).
    Held,
}

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
    /// The current rendering and when it was made: the one kept while it is young enough for
    /// `look`, else `fresh()` (the file's contents now) padded to a whole [`STATS_FILE_UNIT`].
    pub fn view(&self, look: StatsLook, fresh: impl FnOnce() -> String) -> (SystemTime, Arc<[u8]>) {
        let mut v = lock(&self.view);
        if let Some((at, taken, bytes, served)) = &mut *v {
            let age = at.elapsed();
            let keep = match look {
                StatsLook::Lookup => {
                    let reading = served.elapsed() < STATS_VIEW_IDLE;
                    age < STATS_VIEW_AGE || (reading && age < STATS_VIEW_MAX_AGE)
                }
                StatsLook::Held => age < STATS_VIEW_HELD,
            };
            if keep {
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

    /// Regression: a reader that had the file open got a new rendering at its next piece once
    /// it had been idle 100 ms or the rendering was 1 s old (CI, loaded: torn JSON). Its
    /// attribute requests and reads keep the rendering; the next lookup by name replaces it.
    #[test]
    fn a_reader_holding_the_file_keeps_its_rendering_past_the_lookup_ages() {
        let f = StatsFile::default();
        let made = AtomicUsize::new(0);
        let fresh = || format!("{{\"n\": {}}}\n", made.fetch_add(1, Relaxed));
        let (_, first) = f.view(StatsLook::Lookup, fresh);
        std::thread::sleep(STATS_VIEW_MAX_AGE + Duration::from_millis(100));
        let (_, held) = f.view(StatsLook::Held, fresh);
        assert_eq!(
            first, held,
            "a held reader's next piece came from a new rendering"
        );
        assert_eq!(held.len() % STATS_FILE_UNIT, 0);
        std::thread::sleep(STATS_VIEW_IDLE + Duration::from_millis(50));
        let (_, looked) = f.view(StatsLook::Lookup, fresh);
        assert_ne!(first, looked, "a new open did not see the counters move");
        assert_eq!(made.load(Relaxed), 2);
    }
}
