//! One memory budget for every Parquet decode in the process: the daemon's concurrent view
//! renders and `convert`'s workers all reserve the buffers a decode will allocate (page,
//! dictionary and decompression buffers, as the page headers declare them) before the decode
//! starts, and give them back when it ends.
//!
//! A decode that needs more than the whole budget fails at once; one that fits waits, at most
//! [`WAIT`], for others to finish. Each decode reserves once, before it allocates, so no decode
//! holds part of the budget while waiting for more: the waits cannot deadlock.

use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use thiserror::Error;

/// The budget unless the program sets another ([`set_global_limit`]): 1 GiB. A real column
/// chunk's pages are ~1 MiB each (every current writer's default), so a decode of a few hundred
/// columns at once fits many times over, while one hostile file — or a dozen — cannot take the
/// node's memory (a single page claiming 2 GiB is refused outright).
pub const DEFAULT_LIMIT: u64 = 1 << 30;

/// The longest a decode waits for room before it fails: long enough for other renders to
/// finish (a block decodes in milliseconds to a second), short enough that a read under a
/// flood of hostile files answers EIO instead of hanging.
pub const WAIT: Duration = Duration::from_secs(10);

/// More memory was asked for than the budget has.
#[derive(Debug, Error)]
#[error("{what}: decoding needs {need} bytes of buffers, {why}")]
pub struct OverBudget {
    /// What was being decoded.
    pub what: String,
    /// Bytes asked for.
    pub need: u64,
    /// The budget's answer, in words.
    pub why: String,
}

/// A byte budget shared by threads.
#[derive(Debug)]
pub struct MemoryBudget {
    limit: Mutex<u64>,
    used: Mutex<u64>,
    freed: Condvar,
}

/// Bytes held from a [`MemoryBudget`] until dropped.
#[derive(Debug)]
#[must_use = "the bytes are given back when the reservation is dropped"]
pub struct Reservation<'b> {
    budget: &'b MemoryBudget,
    bytes: u64,
}

impl MemoryBudget {
    /// A budget of `limit` bytes.
    pub fn new(limit: u64) -> Self {
        MemoryBudget {
            limit: Mutex::new(limit),
            used: Mutex::new(0),
            freed: Condvar::new(),
        }
    }

    /// The budget's size in bytes.
    pub fn limit(&self) -> u64 {
        *self.limit.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Bytes reserved now.
    pub fn used(&self) -> u64 {
        *self.used.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reserves `bytes` for decoding `what`, waiting up to `wait` for room.
    pub fn reserve(
        &self,
        bytes: u64,
        what: &str,
        wait: Duration,
    ) -> Result<Reservation<'_>, OverBudget> {
        let limit = self.limit();
        let over = |why: String| OverBudget {
            what: what.to_string(),
            need: bytes,
            why,
        };
        if bytes > limit {
            return Err(over(format!(
                "more than the whole decode budget of {} MiB",
                limit >> 20
            )));
        }
        let deadline = Instant::now() + wait;
        let mut used = self.used.lock().unwrap_or_else(|p| p.into_inner());
        while used.saturating_add(bytes) > limit {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(over(format!(
                    "and other decodes held {} of the {} MiB budget for {} s",
                    *used,
                    limit >> 20,
                    wait.as_secs()
                )));
            }
            used = self
                .freed
                .wait_timeout(used, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        *used += bytes;
        Ok(Reservation {
            budget: self,
            bytes,
        })
    }
}

impl Reservation<'_> {
    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        let mut used = self.budget.used.lock().unwrap_or_else(|p| p.into_inner());
        *used = used.saturating_sub(self.bytes);
        self.budget.freed.notify_all();
    }
}

/// The process's budget, shared by every decode.
pub fn global() -> &'static MemoryBudget {
    static GLOBAL: OnceLock<MemoryBudget> = OnceLock::new();
    GLOBAL.get_or_init(|| MemoryBudget::new(DEFAULT_LIMIT))
}

/// Sets the size of the process's budget (the mount's and convert's `--decode-budget`).
pub fn set_global_limit(bytes: u64) {
    *global().limit.lock().unwrap_or_else(|p| p.into_inner()) = bytes;
    global().freed.notify_all();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reservation_past_the_whole_budget_fails_at_once() {
        let b = MemoryBudget::new(100);
        let t = Instant::now();
        assert!(b.reserve(101, "x", Duration::from_secs(5)).is_err());
        assert!(t.elapsed() < Duration::from_secs(1));
    }

    #[test]
    fn reservations_wait_for_room_and_give_it_back() {
        let b = MemoryBudget::new(100);
        let r = b.reserve(80, "a", WAIT).expect("fits");
        assert!(b.reserve(30, "b", Duration::from_millis(50)).is_err());
        std::thread::scope(|s| {
            let waiter = s.spawn(|| {
                b.reserve(30, "c", Duration::from_secs(5))
                    .map(|r| r.bytes())
            });
            std::thread::sleep(Duration::from_millis(50));
            drop(r);
            assert_eq!(waiter.join().expect("join").expect("room once a freed"), 30);
        });
        assert_eq!(b.used(), 0);
    }
}
