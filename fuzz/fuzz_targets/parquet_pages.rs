//! Parquet pages and dictionaries under a counting allocator: any bytes as `t.parquet`, every
//! view file read (the page scan of `stagefs-parquet-bounds`, then the parquet crate's decode),
//! and every allocation the process makes held to what the bounds promise — no single
//! allocation past a page's cap (256 MiB) plus slack, and no more than the decode budget plus
//! slack live at once. A lying page header that reaches the allocator is a finding (an abort),
//! even where the allocation would have succeeded.
#![no_main]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use libfuzzer_sys::fuzz_target;
use stagefs_fuzz::{count_only_escaping_panics, read_table};
use stagefs_views::TableFormat;

/// Largest single allocation allowed: a page's cap and 64 KiB of slack.
const MOST_ONE: usize = (stagefs_parquet_bounds::MAX_PAGE_BYTES as usize) + (64 << 10);

/// Most bytes live at once: the decode budget and 256 MiB of slack (decoded batches, footers).
const MOST_LIVE: usize = (stagefs_parquet_bounds::budget::DEFAULT_LIMIT as usize) + (256 << 20);

static LIVE: AtomicUsize = AtomicUsize::new(0);

struct Bounded;

fn check(size: usize) {
    let live = LIVE.fetch_add(size, Ordering::Relaxed) + size;
    if size > MOST_ONE || live > MOST_LIVE {
        // Not a panic (the views catch those): this must end the run as a finding.
        eprintln!("allocation of {size} bytes ({live} live) past the bounds");
        std::process::abort();
    }
}

// SAFETY: every call is forwarded to the system allocator unchanged; the checks only read the
// sizes (and abort before allocating past the bounds).
unsafe impl GlobalAlloc for Bounded {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        check(layout.size());
        // SAFETY: the caller's contract for `alloc` is passed on as it is.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        check(layout.size());
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: `ptr` came from `System` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        check(new_size);
        // SAFETY: the caller's contract for `realloc` is passed on as it is.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Bounded = Bounded;

fuzz_target!(init: count_only_escaping_panics(), |data: &[u8]| {
    read_table("t.parquet", TableFormat::Parquet, data);
});
