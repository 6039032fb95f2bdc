//! A node's declared part of the dataset: what the loaders on this node will read this epoch
//! and the next (`stagefs.Loader(partition="node")` sends it over the hint socket as lines with
//! a `"scope"` generation, see [`crate::hints`]).
//!
//! Once a scope is declared the mount stages that set instead of the whole tree (the tree
//! stager skips everything else, its queued blocks are dropped, and [`crate::scope_stager::spawn_stager`] fetches the
//! declared blocks), and speculation stays inside it: read-ahead of a file with a scope is cut
//! to the scope's ranges, and cross-file prefetch skips files without one. So the header read at
//! offset 0 of a file whose rows are split across nodes does not read ahead into other nodes'
//! rows. Demand reads are never restricted: a reader gets every byte it asks for. A mount that is
//! never sent a scope behaves as before.
//!
//! A file's scope is replaced by a line of a newer generation (the loader's epoch) and extended
//! by lines of the same one, so every rank of a node may send the same set without
//! coordinating. At most [`MAX_RANGES`] ranges are kept in all (adjacent ones merged): a node's
//! part is a few contiguous spans per file plus exchanged chunks of ~8 MiB, so a million ranges
//! covers terabytes, and a misbehaving client cannot grow the daemon's memory without bound.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

use stagefs_prefetch::locks::lock;

use crate::snapshot::NodeId;

/// Most ranges kept over all files.
pub const MAX_RANGES: usize = 1 << 20;

/// One file's declared ranges.
struct FileScope {
    generation: u64,
    /// Sorted, merged byte ranges.
    ranges: Vec<Range<u64>>,
}

/// The declared ranges per file, and their count over all files.
#[derive(Default)]
struct Declared {
    files: HashMap<NodeId, FileScope>,
    ranges: usize,
}

/// The declared part of this node, per file.
#[derive(Default)]
pub struct Scope {
    files: Mutex<Declared>,
    active: AtomicBool,
    /// Bumped on every change, so the stager starts over.
    version: AtomicU64,
}

/// Inserts `r` into the sorted, merged `ranges`.
fn insert(ranges: &mut Vec<Range<u64>>, r: Range<u64>) {
    let at = ranges.partition_point(|x| x.end < r.start);
    let mut merged = r;
    let mut end = at;
    while end < ranges.len() && ranges[end].start <= merged.end {
        merged.start = merged.start.min(ranges[end].start);
        merged.end = merged.end.max(ranges[end].end);
        end += 1;
    }
    ranges.splice(at..end, std::iter::once(merged));
}

impl Scope {
    /// Whether any scope was declared.
    pub fn is_active(&self) -> bool {
        self.active.load(Relaxed)
    }

    /// Changes counted so far.
    pub fn version(&self) -> u64 {
        self.version.load(Relaxed)
    }

    /// Adds `ranges` (`(offset, len)`) of file `node` under `generation`; whether the scope
    /// became active with it (the first declaration).
    pub fn add(&self, node: NodeId, generation: u64, ranges: &[(u64, u64)]) -> bool {
        let mut guard = lock(&self.files);
        let Declared {
            files,
            ranges: total,
        } = &mut *guard;
        let f = files.entry(node).or_insert(FileScope {
            generation,
            ranges: Vec::new(),
        });
        if generation < f.generation {
            return false;
        }
        if generation > f.generation {
            *total = total.saturating_sub(f.ranges.len());
            *f = FileScope {
                generation,
                ranges: Vec::new(),
            };
        }
        for &(offset, len) in ranges {
            if len == 0 {
                continue;
            }
            if *total >= MAX_RANGES {
                break;
            }
            let before = f.ranges.len();
            insert(&mut f.ranges, offset..offset.saturating_add(len));
            // Merging may shrink the list.
            *total = (*total + f.ranges.len()).saturating_sub(before);
        }
        self.version.fetch_add(1, Relaxed);
        !self.active.swap(true, Relaxed)
    }

    /// The parts of `r` inside file `node`'s scope; `None` when the file has none (no limit).
    pub fn clip(&self, node: NodeId, r: Range<u64>) -> Option<Vec<Range<u64>>> {
        // The FUSE read path asks at each read-ahead step: a mount nobody declared a part to
        // (one node, or no Loader) answers without taking the lock.
        if !self.is_active() {
            return None;
        }
        let declared = lock(&self.files);
        let f = declared.files.get(&node)?;
        let from = f.ranges.partition_point(|x| x.end <= r.start);
        Some(
            f.ranges[from..]
                .iter()
                .take_while(|x| x.start < r.end)
                .map(|x| x.start.max(r.start)..x.end.min(r.end))
                .filter(|x| !x.is_empty())
                .collect(),
        )
    }

    /// Whether block `[start, end)` of file `node` may be fetched ahead of readers: anything
    /// while no scope is declared, else only blocks that overlap the file's scope.
    pub fn allows(&self, node: NodeId, block: Range<u64>) -> bool {
        if !self.is_active() {
            return true;
        }
        self.clip(node, block).is_some_and(|c| !c.is_empty())
    }

    /// The files with a scope and their declared bytes.
    pub fn files(&self) -> Vec<(NodeId, u64)> {
        lock(&self.files)
            .files
            .iter()
            .map(|(n, f)| (*n, f.ranges.iter().map(|r| r.end - r.start).sum()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_merge_replace_by_generation_and_clip() {
        let s = Scope::default();
        let n: NodeId = 3;
        assert!(!s.is_active());
        assert!(s.allows(n, 0..10));
        assert!(s.add(n, 1, &[(100, 50), (150, 50), (400, 10)]));
        assert!(!s.add(n, 1, &[(120, 10)]));
        assert_eq!(s.clip(n, 0..1000), Some(vec![100..200, 400..410]));
        assert_eq!(s.clip(n, 0..100), Some(vec![]));
        assert!(!s.allows(n, 0..100));
        assert!(s.allows(n, 190..1000));
        // Another file without a scope: no limit on read-ahead, but no speculation either.
        let other: NodeId = 4;
        assert_eq!(s.clip(other, 0..10), None);
        assert!(!s.allows(other, 0..10));
        // An older generation is ignored, a newer one replaces.
        s.add(n, 0, &[(0, 10)]);
        assert_eq!(s.clip(n, 0..1000), Some(vec![100..200, 400..410]));
        s.add(n, 2, &[(0, 10)]);
        assert_eq!(s.clip(n, 0..1000), Some(std::iter::once(0..10).collect()));
        assert_eq!(s.files(), vec![(n, 10)]);
    }

    #[test]
    fn ranges_are_bounded_over_all_files() {
        let s = Scope::default();
        let many: Vec<(u64, u64)> = (0..MAX_RANGES as u64 + 10).map(|i| (i * 10, 5)).collect();
        s.add(1, 0, &many);
        assert_eq!(s.clip(1, 0..u64::MAX).map(|c| c.len()), Some(MAX_RANGES));
        s.add(2, 0, &[(0, 5), (100, 5)]);
        assert_eq!(s.clip(2, 0..1000).map(|c| c.len()), Some(0), "no room left");
        // A newer generation gives its file's room back.
        s.add(1, 1, &[(0, 5)]);
        s.add(2, 0, &[(200, 5), (300, 5)]);
        assert_eq!(s.clip(2, 0..1000).map(|c| c.len()), Some(2));
    }
}
