//! The batch plan: which rows of which source each batch holds, in the order they are streamed.
//!
//! Each source is cut into batches of `batch_rows` rows (its last batch may be shorter; batches
//! never span two files, so every batch has one dtype and row shape). With shuffling, each epoch
//! visits all batches in a permutation drawn from the seed and the epoch number: a Fisher–Yates
//! shuffle driven by SplitMix64. Both are written out here rather than taken from `rand` because
//! the order must stay the same for a given seed across versions and platforms — a user re-running
//! a job with `--seed S` gets the same batches in the same order, and `rand` does not promise
//! value stability of its shuffles across releases.

use std::ops::Range;

/// One batch of the plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedBatch {
    /// Position in the stream, from 0 over all epochs.
    pub seq: u64,
    /// Epoch, from 0.
    pub epoch: u32,
    /// Index of the source in the list given to the streamer.
    pub source: usize,
    /// Rows of that source (relative to the source's first row).
    pub rows: Range<u64>,
}

/// Batches of one epoch in file order: `(source, rows)`.
pub fn epoch_batches(source_rows: &[u64], batch_rows: u64) -> Vec<(usize, Range<u64>)> {
    let mut out = Vec::new();
    for (source, &rows) in source_rows.iter().enumerate() {
        let mut start = 0;
        while start < rows {
            let end = (start + batch_rows).min(rows);
            out.push((source, start..end));
            start = end;
        }
    }
    out
}

/// The full plan: `epochs` passes over the batches, each shuffled when `seed` is given.
pub fn plan(
    source_rows: &[u64],
    batch_rows: u64,
    epochs: u32,
    seed: Option<u64>,
) -> Vec<PlannedBatch> {
    let base = epoch_batches(source_rows, batch_rows);
    let mut out = Vec::with_capacity(base.len() * epochs as usize);
    for epoch in 0..epochs {
        let mut order: Vec<usize> = (0..base.len()).collect();
        if let Some(seed) = seed {
            shuffle(
                &mut order,
                seed ^ (u64::from(epoch)).wrapping_mul(0xA24B_AED4_963E_E407),
            );
        }
        for i in order {
            let (source, rows) = base[i].clone();
            out.push(PlannedBatch {
                seq: out.len() as u64,
                epoch,
                source,
                rows,
            });
        }
    }
    out
}

/// SplitMix64 (Steele, Lea, Flood 2014): a tiny generator with a fixed, documented output.
pub(crate) struct SplitMix64(pub(crate) u64);

impl SplitMix64 {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (Lemire's multiply-shift; the bias is below 2^-40 for any n we see).
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next()) * u128::from(n)) >> 64) as u64
    }

    /// Uniform in `[0, 1)`: the top 53 bits as a double.
    pub(crate) fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// Fisher–Yates shuffle of `items` driven by `seed`.
pub fn shuffle<T>(items: &mut [T], seed: u64) {
    let mut rng = SplitMix64(seed);
    for i in (1..items.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        items.swap(i, j);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_cover_every_row_once_and_last_is_partial() {
        let b = epoch_batches(&[10, 0, 4], 4);
        assert_eq!(b, vec![(0, 0..4), (0, 4..8), (0, 8..10), (2, 0..4)]);
    }

    #[test]
    fn shuffle_is_a_deterministic_permutation_that_differs_by_seed_and_epoch() {
        let p1 = plan(&[100], 3, 2, Some(7));
        let p2 = plan(&[100], 3, 2, Some(7));
        assert_eq!(p1, p2);
        let n = p1.len() / 2;
        let mut e0: Vec<_> = p1[..n].iter().map(|b| b.rows.start).collect();
        let e1: Vec<_> = p1[n..].iter().map(|b| b.rows.start).collect();
        assert_ne!(e0, e1, "epochs should differ");
        let other: Vec<_> = plan(&[100], 3, 1, Some(8))
            .iter()
            .map(|b| b.rows.start)
            .collect();
        assert_ne!(e0, other, "seeds should differ");
        e0.sort();
        assert_eq!(e0, (0..34).map(|i| i * 3).collect::<Vec<_>>());
        assert!(p1.iter().enumerate().all(|(i, b)| b.seq == i as u64));
    }

    #[test]
    fn splitmix_matches_reference_values() {
        // Reference output of SplitMix64 seeded with 0 (from the published C implementation).
        let mut r = SplitMix64(0);
        assert_eq!(r.next(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(r.next(), 0x6E78_9E6A_A1B9_65F4);
    }
}
