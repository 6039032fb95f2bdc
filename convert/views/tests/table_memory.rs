//! Hardening round three: every wide table read through its views stayed in memory (its
//! parsed metadata, a decoded block and 64 MiB of rendered blocks of its own), so a daemon
//! that read 12 CSVs of 10^5 columns held 3 GB with no plateau. Now a view set keeps table
//! metadata within one budget (`ViewOptions::table_meta_bytes`) and rendered blocks of all
//! tables within one cache (`table::CACHE_BYTES`). This binary counts the bytes allocated and
//! not yet freed (a global allocator), which is what grew.

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::Path;
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::Arc;

use stagefs_views::{DirSource, ViewOptions, ViewSet};

struct Live;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: every call is forwarded to the system allocator unchanged; the counter only reads
// the sizes.
unsafe impl GlobalAlloc for Live {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's contract for `alloc` is passed on as it is.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: `ptr` came from `System.alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        // SAFETY: the caller's contract for `realloc` is passed on as it is.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Live = Live;

fn wide_csv(path: &Path, cols: usize, rows: usize) {
    let mut text = (0..cols)
        .map(|c| format!("c{c}"))
        .collect::<Vec<_>>()
        .join(",");
    text.push('\n');
    for r in 0..rows {
        let row: Vec<String> = (0..cols).map(|c| ((r + c) % 97).to_string()).collect();
        text.push_str(&row.join(","));
        text.push('\n');
    }
    std::fs::write(path, text).expect("write");
}

#[test]
fn regression_wide_tables_read_through_their_views_accumulated_memory() {
    let dir = tempfile::tempdir().expect("tmp");
    let (tables, cols, rows) = (24, 2000, 300);
    for t in 0..tables {
        wide_csv(&dir.path().join(format!("t{t:02}.csv")), cols, rows);
    }
    let budget = 8 << 20;
    let set = ViewSet::new(
        Arc::new(DirSource::new(dir.path())),
        ViewOptions {
            table_meta_bytes: budget,
            ..ViewOptions::default()
        },
    )
    .expect("scan");
    let base = LIVE.load(Ordering::Relaxed);
    let mut most = 0isize;
    for t in 0..tables {
        let rel = format!("t{t:02}.csv/features.npy");
        let view = set.open(Path::new(&rel)).expect("open");
        let mut buf = vec![0u8; view.len() as usize];
        let n = view.read_at(0, &mut buf).expect("read");
        assert_eq!(n as u64, view.len());
        // Row 7, column 5 of table t: (7 + 5) % 97 as float32.
        let header = buf.len() - rows * cols * 4;
        let at = header + (7 * cols + 5) * 4;
        assert_eq!(buf[at..at + 4], 12f32.to_le_bytes(), "{rel}");
        drop(buf);
        drop(view);
        let (held, bytes) = set.tables_held();
        assert!(held < tables, "every table kept");
        assert!(
            bytes <= budget + (2 << 20),
            "{bytes} bytes of table metadata held"
        );
        most = most.max(LIVE.load(Ordering::Relaxed) - base);
    }
    let bound = budget + stagefs_views::table::CACHE_BYTES + (16 << 20);
    assert!(
        most <= bound as isize,
        "{most} bytes live after reading {tables} wide tables (bound {bound})"
    );
    assert!(stagefs_views::table::rendered_bytes() <= stagefs_views::table::CACHE_BYTES);
    // A dropped table is parsed again on its next use, and reads the same.
    let again = set.open(Path::new("t00.csv/c5.npy")).expect("reopen");
    assert!(!again.is_empty());
}
