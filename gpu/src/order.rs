//! Epoch orders: which rows a rank visits in an epoch, and in what order — PyTorch's
//! `DistributedSampler` split over a seeded permutation, resumable part-way. Pure functions of
//! their arguments, shared by the Loader and the multi-node partition (which must agree with
//! it row for row).

use crate::plan::shuffle;

/// The rows `rank` visits in `epoch`, in order: PyTorch's `DistributedSampler` split.
///
/// All `rows` indices (a permutation seeded by `seed` and `epoch` when shuffling), padded by
/// repeating from the start to a multiple of `world_size` so every rank gets the same number of
/// rows (DDP ranks must run the same number of steps), then every `world_size`-th index from
/// `rank`. The permutation is Fisher–Yates over SplitMix64 ([`crate::plan`]), not torch's
/// generator, so the order is stable across versions and platforms but differs from torch's.
pub fn epoch_order(
    rows: u64,
    shuffle_rows: bool,
    seed: u64,
    epoch: u64,
    rank: u64,
    world_size: u64,
) -> Vec<u64> {
    epoch_order_from(rows, shuffle_rows, seed, epoch, 0, rank, world_size)
}

/// The rows `rank` visits in the rest of `epoch` once its first `start` positions of the
/// epoch's permutation were consumed (by all ranks together, under any world size).
///
/// The epoch's permutation `P` (as in [`epoch_order`]) is consumed globally in order: with
/// `world_size` ranks each past `k` batches of `B`, the first `k·B·world_size` positions of the
/// padded list are done, so a run is described by one number, `start`. The rest, `P[start..]`,
/// is padded by repeating `P[0..]` (rows already seen this epoch) to a multiple of the (possibly
/// new) `world_size` and split as `DistributedSampler` splits. With `start = 0` this is
/// [`epoch_order`]; with an unchanged world size and batch size it continues exactly the
/// uninterrupted sequence (position `k·B + i` of the old split is position `i` of the new);
/// with another world size each row of `P[start..]` is visited exactly once across the ranks,
/// and the padding (fewer than `world_size` rows) repeats `P[0..]`, rows already seen this epoch
/// once `start >= world_size`.
pub fn epoch_order_from(
    rows: u64,
    shuffle_rows: bool,
    seed: u64,
    epoch: u64,
    start: u64,
    rank: u64,
    world_size: u64,
) -> Vec<u64> {
    if rows == 0 || world_size == 0 || rank >= world_size || start >= rows {
        return Vec::new();
    }
    let mut all: Vec<u64> = (0..rows).collect();
    if shuffle_rows {
        // The same mixing of seed and epoch as the streamer's batch shuffle.
        shuffle(&mut all, seed ^ epoch.wrapping_mul(0xA24B_AED4_963E_E407));
    }
    let per_rank = (rows - start).div_ceil(world_size);
    (0..per_rank)
        .map(|i| all[((start + i * world_size + rank) % rows) as usize])
        .collect()
}
