//! Node-partitioned epoch orders: each node of a multi-node job reads a fixed, contiguous part
//! of the rows, so N nodes' mounts read the dataset from the shared storage once in total
//! instead of N times.
//!
//! **Parts.** The rows are cut into `nodes` contiguous *slots* of `rows/nodes` rows (sizes
//! differ by at most one): slot `p` is rows `[p·R/N, (p+1)·R/N)`. Node `n` (ranks
//! `n·L .. (n+1)·L` with `L = local_world_size`) owns slot `σ(n)`, `σ` a permutation drawn from
//! the seed alone, so the assignment is fixed for the whole job and a rerun with the same seed
//! on the same nodes finds its part in the node's cache. Contiguous slots are contiguous byte
//! ranges of every file (or contiguous runs of files for a file-per-sample dataset), so a
//! node's cache holds only its slot plus at most one shared cache block at each end.
//!
//! **Exchange.** Chunks are cut on a [`Grid`] of the file's bytes: chunk `k` is the rows that
//! lie wholly inside bytes `[k·S, (k+1)·S)` (`S` a multiple of the 1 MiB cache block), trimmed
//! to one length for all chunks, so an exchanged chunk costs exactly its own cache blocks on the
//! node that receives it; rows that straddle a chunk boundary, and chunks that cross a slot's
//! edge, stay home. (For a file per sample the grid is plain: chunk `k` is rows `[kC, (k+1)C)`.) Epoch 0 reads the home parts as they are, so each node's cache holds
//! its whole part first; from epoch 1 on, every epoch `e`, each slot gives `round(q·full)` of its full chunks
//! (chosen by a shuffle seeded with `(seed, e, slot)`) to a common pool; the pool is shuffled
//! (seeded with `(seed, e)`) and dealt back, each slot receiving as many chunks as it gave. A
//! node's set therefore keeps its size every epoch (the step count never changes), a fraction
//! of about `q·(N−1)/N` of it comes from other nodes (a pooled chunk may be dealt back home), and
//! `q = 0` keeps every part fixed. A node's own chunks are cached from epoch 0, so an epoch
//! reads from the source only the foreign chunks it received (at most `q` of the part): an
//! E-epoch job reads at most `1 + q·(E−1)` datasets in all, plus shared boundary blocks. Chunks are whole runs of rows, not scattered rows, so an
//! exchanged chunk costs its own bytes and no more: the Loader's chunk is [`CHUNK_BYTES`]. `q = 1` is defined as the `partition="global"` order
//! ([`crate::order::epoch_order_from`]) exactly: every node may read every row.
//!
//! **Within a node.** The node's rows of the epoch are shuffled (seeded with `(seed, e, slot)`)
//! or, without shuffling, sorted; the list is padded by repeating it from its start to
//! `L·⌈R/W⌉` positions (`W = N·L`; `⌈⌈R/N⌉/L⌉ = ⌈R/W⌉`, so every rank runs exactly the steps
//! of `DistributedSampler`'s split) and local rank `l` takes positions `l, l+L, l+2L, …`.
//!
//! One node is the special case of all of this that a single-node job cannot tell from the
//! global order, and it *is* the global order: its list is the global permutation.
//!
//! **Resume.** An epoch that was interrupted is described by its [`Segment`]s: each says the
//! layout (nodes, local world size) it ran under and how many positions all ranks together
//! consumed (`batches · batch_size · world_size`), so each slot consumed `consumed / nodes` of
//! its list. Under the same number of nodes the slots' lists simply continue (with the same
//! local world size too: exactly the batches the uninterrupted run would have delivered).
//! Under another number of nodes the unread rest of every slot, concatenated in slot order
//! (which is row order: the rest of slot 0's region first), is cut into `nodes'` balanced
//! contiguous pieces, one per new slot. Either way every row not yet visited in the epoch is
//! visited exactly once, and the new node's piece lies mostly in its new region.

use std::ops::Range;

use crate::error::StreamError;
use crate::order::epoch_order_from;
use crate::plan::{shuffle, SplitMix64};

/// Bytes of one exchanged chunk for the Loader: 8 cache blocks of 1 MiB, so a chunk is mostly
/// whole rows even of large images (150 KB: 55 rows), one `pread` run per chunk is long, and a
/// node's part of a 100 MB dataset still has a few chunks to exchange.
pub const CHUNK_BYTES: u64 = 8 << 20;

/// Seeds the slot assignment (kept apart from the epoch shuffles' seeds).
const SLOT_SALT: u64 = 0x005E_ED0F_5107;
/// Seeds the per-slot choice of given chunks and the in-node shuffle.
const SLOT_EPOCH_SALT: u64 = 0xC0FF_EE00_D15C;
/// Seeds the pool's shuffle.
const POOL_SALT: u64 = 0x9001_5EA5_0FF1;

/// The settings that decide a node-partitioned order (everything but the layout).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NodeOrder {
    /// Rows of the dataset.
    pub rows: u64,
    /// Shuffle within each node (otherwise the node's rows in ascending order).
    pub shuffle: bool,
    /// The job's seed.
    pub seed: u64,
    /// Fraction of each node's part that moves through the pool each epoch, in `[0, 1]`.
    pub exchange: f64,
    /// Where the exchanged chunks are cut.
    pub grid: Grid,
}

/// Where exchanged chunks are cut: the rows of a file whose data starts at byte `offset`, rows
/// of `row_bytes`, in chunks of `chunk_bytes` ([module docs](self)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grid {
    /// Byte offset of row 0 in the file.
    pub offset: u64,
    /// Bytes per row.
    pub row_bytes: u64,
    /// Bytes per chunk (a multiple of the cache block for files of rows).
    pub chunk_bytes: u64,
}

impl Grid {
    /// Chunks of `chunk_rows` rows, no byte geometry (a file per sample).
    pub fn rows(chunk_rows: u64) -> Grid {
        Grid {
            offset: 0,
            row_bytes: 1,
            chunk_bytes: chunk_rows.max(1),
        }
    }

    /// The same grid, made usable: rows larger than a chunk get chunks of one row.
    fn effective(self) -> Grid {
        if self.row_bytes == 0 || self.chunk_bytes / self.row_bytes < 2 {
            Grid::rows(if self.row_bytes >= self.chunk_bytes {
                1
            } else {
                2
            })
        } else {
            self
        }
    }

    /// Rows of every chunk: the fewest rows wholly inside any chunk's bytes.
    fn len(&self) -> u64 {
        let (s, rb) = (self.chunk_bytes, self.row_bytes);
        if s.is_multiple_of(rb) && self.offset.is_multiple_of(rb) {
            s / rb
        } else {
            s / rb - 1
        }
    }

    /// First row wholly inside chunk `k`'s bytes.
    fn start(&self, k: u64) -> u64 {
        let at = u128::from(k) * u128::from(self.chunk_bytes);
        let off = u128::from(self.offset);
        if at <= off {
            return 0;
        }
        ((at - off).div_ceil(u128::from(self.row_bytes))) as u64
    }

    /// The chunks (row ranges) wholly inside rows `span`.
    fn chunks_in(&self, span: Range<u64>) -> Vec<Range<u64>> {
        let len = self.len();
        // A chunk index at or before the first one starting in the span.
        let k = (u128::from(span.start) * u128::from(self.row_bytes) + u128::from(self.offset))
            / u128::from(self.chunk_bytes);
        let mut k = (k.min(u128::from(u64::MAX)) as u64).saturating_sub(1);
        let mut out = Vec::new();
        loop {
            let lo = self.start(k);
            if lo.saturating_add(len) > span.end {
                return out;
            }
            if lo >= span.start {
                out.push(lo..lo + len);
            }
            k += 1;
        }
    }
}

/// A Loader's node partition: the ranks per node, the exchange and the chunk.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NodeLayout {
    /// Ranks per node (the node of rank `r` is `r / local_world_size`).
    pub local_world_size: u64,
    /// Fraction of each node's part exchanged every epoch, in `[0, 1]`.
    pub exchange: f64,
    /// Where exchanged chunks are cut; `None`: the Loader cuts [`CHUNK_BYTES`] chunks of its
    /// largest-row file.
    pub grid: Option<Grid>,
}

impl NodeLayout {
    /// Checks the layout against `world_size` ranks.
    pub fn check(&self, world_size: u64) -> Result<(), StreamError> {
        if nodes_of(world_size, self.local_world_size).is_none() {
            return Err(StreamError::Config(format!(
                "local_world_size {} does not divide world_size {world_size}",
                self.local_world_size
            )));
        }
        if !(0.0..=1.0).contains(&self.exchange) {
            return Err(StreamError::Config(format!(
                "exchange {} is not in [0, 1]",
                self.exchange
            )));
        }
        Ok(())
    }

    /// The run of `world_size` ranks that consumed `consumed` positions under this layout.
    pub fn segment(&self, world_size: u64, consumed: u64) -> Segment {
        Segment {
            nodes: world_size / self.local_world_size.max(1),
            local_world_size: self.local_world_size,
            consumed,
        }
    }

    /// The order's settings for `rows` rows.
    pub fn order(&self, rows: u64, shuffle: bool, seed: u64) -> NodeOrder {
        NodeOrder {
            rows,
            shuffle,
            seed,
            exchange: self.exchange,
            grid: self.grid.unwrap_or(Grid::rows(1)),
        }
    }
}

/// One run of an epoch under one layout, for resuming ([module docs](self)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Nodes of the run.
    pub nodes: u64,
    /// Ranks per node of the run.
    pub local_world_size: u64,
    /// Positions consumed by all ranks together (`batches · batch_size · world_size`).
    pub consumed: u64,
}

/// The rows `[start, end)` of slot `slot` out of `nodes`.
pub fn slot_rows(rows: u64, nodes: u64, slot: u64) -> Range<u64> {
    let cut = |p: u64| (u128::from(rows) * u128::from(p) / u128::from(nodes.max(1))) as u64;
    cut(slot)..cut(slot + 1)
}

/// The slot node `node` owns among `nodes`: a permutation of the nodes drawn from `seed`.
pub fn home_slot(seed: u64, nodes: u64, node: u64) -> u64 {
    let mut slots: Vec<u64> = (0..nodes).collect();
    shuffle(&mut slots, seed ^ SLOT_SALT);
    slots.get(node as usize).copied().unwrap_or(node)
}

fn mix(seed: u64, epoch: u64, slot: u64, salt: u64) -> u64 {
    let mut r = SplitMix64(seed ^ salt);
    let a = r.next() ^ epoch.wrapping_mul(0xA24B_AED4_963E_E407);
    let mut r = SplitMix64(a);
    r.next() ^ slot.wrapping_mul(0x9FB2_1C65_1E98_DF25)
}

/// Whether `exchange` means the global order (`q >= 1`).
fn is_global(o: &NodeOrder) -> bool {
    o.exchange >= 1.0
}

/// The row ranges each slot holds in `epoch` under `nodes` nodes, before the in-node shuffle:
/// its part less the chunks it gave, then the chunks it received. `q < 1` only.
fn slot_chunks(o: &NodeOrder, epoch: u64, nodes: u64) -> Vec<Vec<Range<u64>>> {
    let grid = o.grid.effective();
    // Epoch 0 is the home parts (see the module docs).
    let q = if epoch == 0 {
        0.0
    } else {
        o.exchange.clamp(0.0, 1.0)
    };
    let mut held = Vec::with_capacity(nodes as usize);
    let mut given_counts = Vec::with_capacity(nodes as usize);
    let mut pool: Vec<Range<u64>> = Vec::new();
    for p in 0..nodes {
        let span = slot_rows(o.rows, nodes, p);
        let chunks = grid.chunks_in(span.clone());
        let full = chunks.len() as u64;
        let give = ((q * full as f64).round() as u64).min(full);
        let mut ks: Vec<usize> = (0..chunks.len()).collect();
        if give > 0 {
            shuffle(&mut ks, mix(o.seed, epoch, p, SLOT_EPOCH_SALT));
        }
        let mut out: Vec<Range<u64>> = ks[..give as usize]
            .iter()
            .map(|&k| chunks[k].clone())
            .collect();
        out.sort_unstable_by_key(|r| r.start);
        // The part less the given chunks, in row order.
        let mut mine = Vec::with_capacity(out.len() + 1);
        let mut at = span.start;
        for r in &out {
            if at < r.start {
                mine.push(at..r.start);
            }
            at = r.end;
        }
        if at < span.end {
            mine.push(at..span.end);
        }
        pool.extend(out);
        given_counts.push(give);
        held.push(mine);
    }
    shuffle(&mut pool, mix(o.seed, epoch, 0, POOL_SALT));
    let mut dealt = pool.into_iter();
    for (mine, give) in held.iter_mut().zip(given_counts) {
        mine.extend(dealt.by_ref().take(give as usize));
    }
    held
}

/// Each slot's rows in `epoch` under `nodes` nodes, in visiting order (unpadded). `q < 1` only.
fn slot_lists(o: &NodeOrder, epoch: u64, nodes: u64) -> Vec<Vec<u64>> {
    if nodes == 1 {
        // One node: its part is everything, and its list is the global permutation, so a
        // single-node job gets exactly the `partition="global"` order.
        return vec![epoch_order_from(o.rows, o.shuffle, o.seed, epoch, 0, 0, 1)];
    }
    slot_chunks(o, epoch, nodes)
        .into_iter()
        .enumerate()
        .map(|(p, chunks)| {
            let mut rows: Vec<u64> = chunks.into_iter().flatten().collect();
            if o.shuffle {
                shuffle(&mut rows, mix(o.seed, epoch, p as u64, SLOT_EPOCH_SALT ^ 1));
            } else {
                rows.sort_unstable();
            }
            rows
        })
        .collect()
}

/// The row ranges node `node` of `nodes` reads in `epoch` (from the epoch's start), merged and
/// sorted: what its mount should stage. For `q >= 1`, every row.
pub fn node_ranges(o: &NodeOrder, epoch: u64, nodes: u64, node: u64) -> Vec<Range<u64>> {
    if o.rows == 0 || nodes == 0 || node >= nodes {
        return Vec::new();
    }
    if is_global(o) || nodes == 1 {
        return std::iter::once(0..o.rows).collect();
    }
    let slot = home_slot(o.seed, nodes, node);
    let mut chunks = slot_chunks(o, epoch, nodes)
        .swap_remove(slot as usize)
        .into_iter()
        .filter(|r| !r.is_empty())
        .collect::<Vec<_>>();
    chunks.sort_unstable_by_key(|r| r.start);
    let mut out: Vec<Range<u64>> = Vec::with_capacity(chunks.len());
    for r in chunks {
        match out.last_mut() {
            Some(last) if last.end == r.start => last.end = r.end,
            _ => out.push(r),
        }
    }
    out
}

/// Validates a layout: `world_size` ranks, `local_world_size` per node.
pub fn nodes_of(world_size: u64, local_world_size: u64) -> Option<u64> {
    (local_world_size > 0 && world_size > 0 && world_size.is_multiple_of(local_world_size))
        .then(|| world_size / local_world_size)
}

/// The rows rank `rank` of `nodes · local_world_size` visits in `epoch`, in order, after the
/// earlier runs `before` of the same epoch (empty: the whole epoch) — see the [module
/// docs](self). Empty when the layout is invalid or nothing is left.
pub fn node_epoch_order(
    o: &NodeOrder,
    epoch: u64,
    before: &[Segment],
    nodes: u64,
    local_world_size: u64,
    rank: u64,
) -> Vec<u64> {
    let world = nodes.saturating_mul(local_world_size);
    if o.rows == 0 || world == 0 || rank >= world {
        return Vec::new();
    }
    if is_global(o) {
        // Global positions are consumed in order whatever the layout: they add up.
        let start = before.iter().map(|s| s.consumed).sum::<u64>();
        return epoch_order_from(o.rows, o.shuffle, o.seed, epoch, start, rank, world);
    }
    let first_nodes = before.first().map_or(nodes, |s| s.nodes.max(1));
    let mut lists = slot_lists(o, epoch, first_nodes);
    let mut offs = vec![0u64; lists.len()];
    for (i, seg) in before.iter().enumerate() {
        let seg_nodes = seg.nodes.max(1);
        let per_slot = seg.consumed / seg_nodes;
        for off in offs.iter_mut() {
            *off = off.saturating_add(per_slot);
        }
        let next_nodes = before.get(i + 1).map_or(nodes, |s| s.nodes.max(1));
        if next_nodes != lists.len() as u64 {
            let rest: Vec<u64> = lists
                .iter()
                .zip(&offs)
                .flat_map(|(l, &off)| l[(off.min(l.len() as u64) as usize)..].iter().copied())
                .collect();
            let n = rest.len() as u64;
            lists = (0..next_nodes)
                .map(|p| {
                    let r = slot_rows(n, next_nodes, p);
                    rest[r.start as usize..r.end as usize].to_vec()
                })
                .collect();
            offs = vec![0; lists.len()];
        }
    }
    let left = |p: usize| (lists[p].len() as u64).saturating_sub(offs[p]);
    if (0..lists.len()).all(|p| left(p) == 0) {
        return Vec::new();
    }
    let per_rank = (0..lists.len())
        .map(|p| left(p).div_ceil(local_world_size))
        .max()
        .unwrap_or(0);
    let node = rank / local_world_size;
    let local = rank % local_world_size;
    let slot = home_slot(o.seed, nodes, node) as usize;
    let list = &lists[slot];
    let off = offs[slot];
    (0..per_rank)
        .map(|i| {
            let pos = off + i * local_world_size + local;
            match list.len() as u64 {
                // A slot with no rows at all (fewer rows than nodes) pads with any rows.
                0 => pos % o.rows,
                len => list[(pos % len) as usize],
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(rows: u64, q: f64, seed: u64, chunk: u64) -> NodeOrder {
        NodeOrder {
            rows,
            shuffle: true,
            seed,
            exchange: q,
            grid: Grid::rows(chunk),
        }
    }

    /// Every rank's order of one run; asserts equal lengths (DDP lockstep).
    fn all_ranks(o: &NodeOrder, e: u64, before: &[Segment], n: u64, l: u64) -> Vec<Vec<u64>> {
        let out: Vec<Vec<u64>> = (0..n * l)
            .map(|r| node_epoch_order(o, e, before, n, l, r))
            .collect();
        assert!(out.iter().all(|v| v.len() == out[0].len()), "unequal steps");
        out
    }

    /// Rows visited across ranks, positions `from..` of each rank's order.
    fn visits(orders: &[Vec<u64>], from: usize, to: usize, rows: u64) -> Vec<u32> {
        let mut seen = vec![0u32; rows as usize];
        for o in orders {
            for &r in &o[from.min(o.len())..to.min(o.len())] {
                seen[r as usize] += 1;
            }
        }
        seen
    }

    #[test]
    fn every_row_once_per_epoch_with_distributed_samplers_step_count() {
        for rows in [1u64, 7, 100, 101, 997, 4096] {
            for (n, l) in [(1u64, 1u64), (1, 3), (2, 2), (3, 2), (4, 2), (8, 1), (5, 3)] {
                for q in [0.0, 0.1, 0.25, 0.5, 0.99, 1.0] {
                    for seed in [0u64, 9] {
                        for e in [0u64, 3] {
                            let o = spec(rows, q, seed, 4);
                            let ord = all_ranks(&o, e, &[], n, l);
                            assert_eq!(ord[0].len() as u64, rows.div_ceil(n * l));
                            let seen = visits(&ord, 0, usize::MAX, rows);
                            assert!(
                                seen.iter().all(|&c| c >= 1),
                                "row missed: rows {rows} n {n} l {l} q {q}"
                            );
                            // Padding repeats fewer than `world` positions in all.
                            let extra: u32 = seen.iter().map(|c| c - 1).sum();
                            assert_eq!(u64::from(extra), rows.div_ceil(n * l) * n * l - rows);
                            // Deterministic.
                            assert_eq!(ord, all_ranks(&o, e, &[], n, l));
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn padding_only_repeats_rows_of_the_node_when_the_part_is_large_enough() {
        let o = spec(1001, 0.0, 3, 10);
        let ord = all_ranks(&o, 1, &[], 4, 3);
        for node in 0..4u64 {
            let slot = home_slot(3, 4, node);
            let span = slot_rows(1001, 4, slot);
            for l in 0..3 {
                assert!(ord[(node * 3 + l) as usize]
                    .iter()
                    .all(|r| span.contains(r)));
            }
        }
    }

    #[test]
    fn parts_are_contiguous_fixed_at_q0_and_chunked_under_exchange() {
        let rows = 10_000;
        for e in 0..4 {
            for node in 0..4 {
                let r = node_ranges(&spec(rows, 0.0, 5, 64), e, 4, node);
                assert_eq!(r, vec![slot_rows(rows, 4, home_slot(5, 4, node))]);
            }
        }
        // Epoch 0 is the home parts whatever the exchange (each node caches its part first).
        for node in 0..4 {
            let r = node_ranges(&spec(rows, 0.5, 5, 64), 0, 4, node);
            assert_eq!(r, vec![slot_rows(rows, 4, home_slot(5, 4, node))]);
        }
        // The slots are a permutation of the nodes, drawn from the seed.
        let mut s: Vec<u64> = (0..8).map(|n| home_slot(11, 8, n)).collect();
        assert_ne!(s, (0..8).collect::<Vec<_>>());
        s.sort_unstable();
        assert_eq!(s, (0..8).collect::<Vec<_>>());
        // With exchange, a node's rows outside its part are whole chunks of the grid.
        let o = spec(rows, 0.25, 5, 64);
        for node in 0..4 {
            let home = slot_rows(rows, 4, home_slot(5, 4, node));
            for r in node_ranges(&o, 2, 4, node) {
                if r.end <= home.start || r.start >= home.end {
                    assert!(r.start.is_multiple_of(64), "{r:?} off the chunk grid");
                    assert!(r.end.is_multiple_of(64), "{r:?} off the chunk grid");
                }
            }
        }
    }

    #[test]
    fn exchange_moves_about_q_of_each_part_and_changes_by_epoch() {
        let rows = 64 * 400;
        for q in [0.0, 0.1, 0.25, 0.5] {
            let o = spec(rows, q, 1, 64);
            let mut sets = Vec::new();
            for node in 0..4 {
                let home = slot_rows(rows, 4, home_slot(1, 4, node));
                let got: u64 = node_ranges(&o, 1, 4, node)
                    .iter()
                    .map(|r| r.end.min(home.end).saturating_sub(r.start.max(home.start)))
                    .sum();
                let away = 1.0 - got as f64 / (home.end - home.start) as f64;
                // At most q leaves (a pooled chunk may come back home), and most of it does.
                assert!(away <= q + 1e-9, "q {q}: {away} moved");
                assert!(away >= q * 0.5, "q {q}: only {away} moved");
                sets.push(node_ranges(&o, 1, 4, node));
            }
            let next: Vec<_> = (0..4).map(|n| node_ranges(&o, 2, 4, n)).collect();
            assert_eq!(
                q == 0.0,
                sets == next,
                "q {q}: epochs should differ iff q > 0"
            );
        }
    }

    #[test]
    fn grid_chunks_cover_whole_cache_blocks_only() {
        const MB: u64 = 1 << 20;
        // 128-byte header, 4 KiB rows, 8 MiB chunks: 2047 rows each, never touching the
        // block of the straddling row.
        let g = Grid {
            offset: 128,
            row_bytes: 4096,
            chunk_bytes: 8 * MB,
        };
        let c = g.chunks_in(0..32768);
        assert_eq!(c.len(), 16);
        for (k, r) in c.iter().enumerate() {
            let (first, last) = (128 + r.start * 4096, 128 + r.end * 4096 - 1);
            assert_eq!(first / MB, 8 * k as u64, "{r:?}");
            assert_eq!(last / MB, 8 * k as u64 + 7, "{r:?}");
        }
        // Image rows that do not divide a block: one length, inside the chunk's blocks.
        let g = Grid {
            offset: 128,
            row_bytes: 150_528,
            chunk_bytes: 8 * MB,
        };
        let c = g.chunks_in(1000..5000);
        assert!(c.iter().all(|r| r.end - r.start == 54));
        for r in &c {
            let (first, last) = (128 + r.start * 150_528, 128 + r.end * 150_528 - 1);
            assert_eq!(
                first / (8 * MB),
                last / (8 * MB),
                "{r:?} crosses a chunk's blocks"
            );
            assert!(r.start >= 1000 && r.end <= 5000);
        }
        assert!(c.windows(2).all(|w| w[0].end <= w[1].start));
        assert_eq!(Grid::rows(64).chunks_in(100..300), vec![128..192, 192..256]);
    }

    #[test]
    fn q1_is_the_global_order() {
        let o = spec(1003, 1.0, 4, 8);
        for r in 0..8 {
            assert_eq!(
                node_epoch_order(&o, 2, &[], 4, 2, r),
                epoch_order_from(1003, true, 4, 2, 0, r, 8)
            );
        }
    }

    #[test]
    fn one_node_is_the_global_order_also_when_resumed() {
        for q in [0.0, 0.3] {
            let o = spec(1003, q, 4, 8);
            for r in 0..3 {
                assert_eq!(
                    node_epoch_order(&o, 2, &[], 1, 3, r),
                    epoch_order_from(1003, true, 4, 2, 0, r, 3)
                );
                let seg = Segment {
                    nodes: 1,
                    local_world_size: 3,
                    consumed: 300,
                };
                assert_eq!(
                    node_epoch_order(&o, 2, &[seg], 1, 2, r),
                    epoch_order_from(1003, true, 4, 2, 300, r, 2),
                );
            }
        }
    }

    #[test]
    fn without_shuffle_each_rank_reads_ascending_rows_of_its_part() {
        let mut o = spec(100, 0.0, 0, 4);
        o.shuffle = false;
        let ord = node_epoch_order(&o, 0, &[], 2, 1, 0);
        let span = slot_rows(100, 2, home_slot(0, 2, 0));
        assert_eq!(ord, span.collect::<Vec<_>>());
    }

    /// Resume after `k` batches of `b` under (n, l) into (n2, l2): the rest is visited exactly
    /// once, and with an unchanged layout it is exactly the uninterrupted tail.
    fn check_resume(rows: u64, q: f64, (n, l): (u64, u64), (n2, l2): (u64, u64), b: u64, k: u64) {
        let o = spec(rows, q, 7, 16);
        let full = all_ranks(&o, 3, &[], n, l);
        let consumed = k * b * n * l;
        let seg = [Segment {
            nodes: n,
            local_world_size: l,
            consumed,
        }];
        let rest = all_ranks(&o, 3, &seg, n2, l2);
        assert_eq!(rest, all_ranks(&o, 3, &seg, n2, l2), "deterministic");
        let done = visits(&full, 0, (k * b) as usize, rows);
        let later = visits(&rest, 0, usize::MAX, rows);
        for row in 0..rows as usize {
            if done[row] == 0 {
                assert!(
                    later[row] >= 1,
                    "row {row} never visited ({n}->{n2}, q {q})"
                );
            }
        }
        // Only padding repeats: fewer than one position per rank of the new layout, except
        // rows the old layout's padding had already shown (counted as seen).
        let fresh: u64 = (0..rows as usize)
            .filter(|&r| done[r] == 0)
            .map(|r| u64::from(later[r]))
            .sum();
        let unseen = done.iter().filter(|&&c| c == 0).count() as u64;
        assert!(
            fresh - unseen < n2 * l2,
            "{n}->{n2}: {fresh} visits for {unseen} rows"
        );
        if (n, l) == (n2, l2) {
            for r in 0..(n * l) as usize {
                assert_eq!(rest[r], full[r][(k * b) as usize..], "exact resume differs");
            }
        }
    }

    #[test]
    fn resume_mid_epoch_on_another_number_of_nodes_visits_the_rest_once() {
        for rows in [1000u64, 1001, 4099] {
            for q in [0.0, 0.25, 1.0] {
                for to in [(2u64, 2u64), (8, 2), (4, 2), (4, 3), (1, 1)] {
                    check_resume(rows, q, (4, 2), to, 5, 7);
                }
            }
        }
        // Twice: 4 nodes -> 8 -> 2, every row of the epoch still exactly once.
        let o = spec(2000, 0.25, 7, 16);
        let a = all_ranks(&o, 1, &[], 4, 2);
        let s1 = Segment {
            nodes: 4,
            local_world_size: 2,
            consumed: 10 * 8,
        };
        let b = all_ranks(&o, 1, &[s1], 8, 2);
        let s2 = Segment {
            nodes: 8,
            local_world_size: 2,
            consumed: 20 * 16,
        };
        let c = all_ranks(&o, 1, &[s1, s2], 2, 2);
        let mut seen = visits(&a, 0, 10, 2000);
        for (x, y) in seen.iter_mut().zip(visits(&b, 0, 20, 2000)) {
            *x += y;
        }
        for (x, y) in seen.iter_mut().zip(visits(&c, 0, usize::MAX, 2000)) {
            *x += y;
        }
        assert!(seen.iter().all(|&c| c >= 1));
        let extra: u32 = seen.iter().map(|c| c - 1).sum();
        assert!(extra < 4, "{extra} repeats");
    }
}
