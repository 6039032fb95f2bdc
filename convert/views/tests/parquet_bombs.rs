//! Parquet page and dictionary bombs: tiny files whose page headers claim gigabytes. Each
//! must fail its own view with EIO without the process ever asking for the memory, and leave
//! every other view working. This binary counts every allocation (a global allocator that
//! records the largest single request), which is what the bombs used to blow up.

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use stagefs_parquet_bounds::testing::{dictionary_bomb, Values};
use stagefs_views::{DirSource, ViewError, ViewOptions, ViewSet};

/// The system allocator, recording the largest single allocation asked of it.
struct Counting;

static LARGEST: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is forwarded to the system allocator unchanged; the counter only reads
// the layout.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller's contract for `alloc` is passed on as it is.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System.alloc` with this layout (see `alloc`).
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LARGEST.fetch_max(new_size, Ordering::Relaxed);
        // SAFETY: the caller's contract for `realloc` is passed on as it is.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Largest single allocation any of these tests may make: real decodes of these tiny tables
/// stay far under it, a bomb's claim is 8× it and more.
const MOST: usize = 256 << 20;

fn read_all(set: &ViewSet, rel: &str) -> Result<Vec<u8>, ViewError> {
    let view = set.open(Path::new(rel))?;
    let mut out = vec![0u8; view.len() as usize];
    let n = view.read_at(0, &mut out)?;
    out.truncate(n);
    Ok(out)
}

fn assert_eio(r: Result<Vec<u8>, ViewError>, what: &str) -> String {
    match r {
        Err(e) => {
            assert_eq!(e.errno(), 5, "{what}: {e}");
            e.to_string()
        }
        Ok(b) => panic!("{what}: read {} bytes of a bomb", b.len()),
    }
}

#[test]
fn regression_a_sub_kilobyte_parquet_dictionary_bomb_killed_the_mount() {
    let dir = tempfile::tempdir().expect("tmp");
    // Three columns, each a dictionary page claiming 2 GiB of snappy output: the daemon asked
    // for ~4 GiB per column on a 32 KB read of features.npy and was OOM-killed.
    let bomb = dictionary_bomb(3, Values::Int64, (2 << 30) - 1, None);
    assert!(bomb.len() < 1024, "{}", bomb.len());
    std::fs::write(dir.path().join("bomb.parquet"), &bomb).expect("write");
    // The same shape honest, beside it.
    std::fs::write(
        dir.path().join("good.parquet"),
        dictionary_bomb(3, Values::Int64, 16, None),
    )
    .expect("write");
    let set =
        ViewSet::new(Arc::new(DirSource::new(dir.path())), ViewOptions::default()).expect("scan");
    let msg = assert_eio(read_all(&set, "bomb.parquet/features.npy"), "features.npy");
    assert!(
        msg.contains("claims") && msg.contains("bomb.parquet"),
        "{msg}"
    );
    assert_eio(read_all(&set, "bomb.parquet/c1.npy"), "c1.npy");
    let good = read_all(&set, "good.parquet/features.npy").expect("the honest table reads");
    let (h, _) = stagefs_npy::NpyHeader::parse(&good).expect("npy");
    assert_eq!(h.shape, vec![1000, 3]);
    let c0 = read_all(&set, "good.parquet/c0.npy").expect("a column reads");
    let (_, start) = stagefs_npy::NpyHeader::parse(&c0).expect("npy");
    assert!(c0[start..].chunks_exact(8).all(|c| c == 7i64.to_le_bytes()));
    let largest = LARGEST.load(Ordering::Relaxed);
    assert!(largest < MOST, "an allocation of {largest} bytes");
}

#[test]
fn regression_a_single_column_dictionary_bomb_took_seconds_and_gigabytes() {
    let dir = tempfile::tempdir().expect("tmp");
    std::fs::write(
        dir.path().join("one.parquet"),
        dictionary_bomb(1, Values::Int64, (2 << 30) - 1, None),
    )
    .expect("write");
    let set =
        ViewSet::new(Arc::new(DirSource::new(dir.path())), ViewOptions::default()).expect("scan");
    let t = std::time::Instant::now();
    assert_eio(read_all(&set, "one.parquet/c0.npy"), "c0.npy");
    assert!(t.elapsed().as_secs() < 5, "{:?}", t.elapsed());
    let largest = LARGEST.load(Ordering::Relaxed);
    assert!(largest < MOST, "an allocation of {largest} bytes");
}
