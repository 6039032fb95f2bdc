//! The process-wide decode budget: how many pixels all image decodes in flight may hold at once.
//!
//! Every decode first works out what it will hold (its decoded window, a progressive JPEG's
//! coefficient buffer, a PNG's row and intermediate buffers — all counted in pixels of 3 bytes)
//! and waits here until that fits beside the decodes already running. The mount's FUSE threads,
//! its background renderer and `convert`'s workers share one budget, so a burst of huge images
//! never holds more than the budget however many threads ask, where 8 FUSE threads each decoding
//! a 16k² PNG used to drive a daemon to 5.5 GB.
//!
//! A single decode may never charge more than the whole budget: the renderer shrinks what it
//! holds (a JPEG is decoded at a reduced DCT scale) or refuses the image before asking.

use std::sync::{Arc, Condvar, Mutex, OnceLock};

/// Default budget: 2^25 pixels (~100 MB of RGB): 170 ImageNet-sized images, or a 12 Mpx
/// photo's crop window beside a few dozen ordinary ones, in flight at once.
pub const DEFAULT_BUDGET_PIXELS: u64 = 1 << 25;

/// Smallest budget accepted: one 1024² window, so that ordinary photographs still decode.
pub const MIN_BUDGET_PIXELS: u64 = 1 << 20;

/// A counting semaphore over pixels.
#[derive(Debug)]
pub struct DecodeBudget {
    total: u64,
    used: Mutex<u64>,
    freed: Condvar,
}

impl DecodeBudget {
    /// A budget of `total` pixels (at least [`MIN_BUDGET_PIXELS`]).
    pub fn new(total: u64) -> Arc<DecodeBudget> {
        Arc::new(DecodeBudget {
            total: total.max(MIN_BUDGET_PIXELS),
            used: Mutex::new(0),
            freed: Condvar::new(),
        })
    }

    /// The budget every [`crate::ViewOptions::default`] shares: one per process.
    pub fn process_default() -> Arc<DecodeBudget> {
        static DEFAULT: OnceLock<Arc<DecodeBudget>> = OnceLock::new();
        DEFAULT
            .get_or_init(|| DecodeBudget::new(DEFAULT_BUDGET_PIXELS))
            .clone()
    }

    /// Total pixels.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Pixels held by decodes in flight now.
    pub fn in_use(&self) -> u64 {
        self.used.lock().map(|u| *u).unwrap_or(0)
    }

    /// Waits until `pixels` (clamped to the total) fit, then holds them until the guard drops.
    pub fn acquire(&self, pixels: u64) -> BudgetGuard<'_> {
        let pixels = pixels.min(self.total);
        let mut used = match self.used.lock() {
            Ok(u) => u,
            Err(p) => p.into_inner(),
        };
        while *used + pixels > self.total {
            used = match self.freed.wait(used) {
                Ok(u) => u,
                Err(p) => p.into_inner(),
            };
        }
        *used += pixels;
        BudgetGuard {
            budget: self,
            pixels,
        }
    }
}

/// Pixels held from a [`DecodeBudget`]; released on drop.
#[derive(Debug)]
pub struct BudgetGuard<'a> {
    budget: &'a DecodeBudget,
    pixels: u64,
}

impl Drop for BudgetGuard<'_> {
    fn drop(&mut self) {
        let mut used = match self.budget.used.lock() {
            Ok(u) => u,
            Err(p) => p.into_inner(),
        };
        *used -= self.pixels;
        drop(used);
        self.budget.freed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    #[test]
    fn concurrent_holders_never_exceed_the_budget() {
        let budget = DecodeBudget::new(MIN_BUDGET_PIXELS * 4);
        let peak = Arc::new(AtomicU64::new(0));
        let threads: Vec<_> = (0..8)
            .map(|i| {
                let (budget, peak) = (budget.clone(), peak.clone());
                std::thread::spawn(move || {
                    for k in 0..50u64 {
                        let want = MIN_BUDGET_PIXELS * (1 + (i + k) % 3);
                        let _g = budget.acquire(want);
                        peak.fetch_max(budget.in_use(), Ordering::SeqCst);
                        std::thread::yield_now();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert!(peak.load(Ordering::SeqCst) <= budget.total());
        assert_eq!(budget.in_use(), 0);
    }

    #[test]
    fn a_request_larger_than_the_budget_is_clamped_not_deadlocked() {
        let budget = DecodeBudget::new(MIN_BUDGET_PIXELS);
        let g = budget.acquire(u64::MAX);
        assert_eq!(budget.in_use(), MIN_BUDGET_PIXELS);
        drop(g);
        assert_eq!(budget.in_use(), 0);
    }
}
