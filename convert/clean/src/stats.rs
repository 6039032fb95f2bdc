//! Mergeable statistics: count, mean and M2 (sum of squared deviations) per column.
//!
//! Each work unit computes its accumulator exactly with two passes over its own values (sum →
//! mean, then Σ(x − mean)²), which vectorises and keeps the rounding error of one batch small;
//! units are then combined with Chan et al.'s pairwise update. Units are always merged in input
//! order (file index, then unit index), so a run gives bit-identical statistics whatever the
//! thread scheduling, and a sharded run (per-file accumulators merged later in file order) gives
//! the same bits as an unsharded one.
//!
//! Statistics follow pandas: nulls and NaN are skipped, `std` uses ddof = 1, a column with fewer
//! than two values has a NaN std.
//!
//! Accumulators travel between SLURM array tasks as JSON. JSON numbers cannot carry NaN or all
//! bits portably, so every float is written twice: as a number (for people) and as the hex of
//! its IEEE bits (what is read back), which makes the round trip lossless.

use serde::{Deserialize, Serialize};

/// Count, mean and sum of squared deviations of a set of values (Chan/Welford form).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Accumulator {
    /// Number of non-null, non-NaN values.
    pub count: u64,
    /// Mean of those values (0 when `count` is 0).
    pub mean: f64,
    /// Σ (x − mean)² over those values.
    pub m2: f64,
}

impl Accumulator {
    /// Accumulates a slice of values, skipping NaN (nulls must already be excluded by the caller
    /// or passed as NaN).
    pub fn from_values(values: impl Iterator<Item = f64> + Clone) -> Self {
        let mut count = 0u64;
        let mut sum = 0.0f64;
        for v in values.clone() {
            if !v.is_nan() {
                count += 1;
                sum += v;
            }
        }
        if count == 0 {
            return Self::default();
        }
        let mean = sum / count as f64;
        let mut m2 = 0.0f64;
        let mut comp = 0.0f64;
        for v in values {
            if !v.is_nan() {
                let d = v - mean;
                m2 += d * d;
                comp += d;
            }
        }
        // Corrected two-pass (Chan, Golub & LeVeque): removes the error left in `mean` by the
        // rounded sum; `comp` is exactly 0 in exact arithmetic.
        let m2 = m2 - comp * comp / count as f64;
        // The mean itself is refined the same way, so it matches a pairwise sum / n to ~1 ulp.
        let mean = mean + comp / count as f64;
        Self {
            count,
            mean,
            m2: m2.max(0.0),
        }
    }

    /// Combines two accumulators (Chan et al. 1979); `self` first, order matters only in the
    /// last bits.
    pub fn merge(&self, other: &Self) -> Self {
        if other.count == 0 {
            return *self;
        }
        if self.count == 0 {
            return *other;
        }
        let na = self.count as f64;
        let nb = other.count as f64;
        let n = na + nb;
        let delta = other.mean - self.mean;
        let mean = self.mean + delta * (nb / n);
        let m2 = self.m2 + other.m2 + delta * delta * (na * nb / n);
        Self {
            count: self.count + other.count,
            mean,
            m2,
        }
    }

    /// Mean as pandas reports it: NaN for an empty column.
    pub fn pandas_mean(&self) -> f64 {
        if self.count == 0 {
            f64::NAN
        } else {
            self.mean
        }
    }

    /// Sample standard deviation (ddof = 1) as pandas reports it: NaN below two values.
    pub fn pandas_std(&self) -> f64 {
        if self.count < 2 {
            f64::NAN
        } else {
            (self.m2 / (self.count - 1) as f64).sqrt()
        }
    }
}

/// A float written both for people (`value`, null for NaN/inf) and losslessly (`bits`, hex).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ExactF64 {
    /// The value as a JSON number, or null when it is not finite.
    pub value: Option<f64>,
    /// The IEEE-754 bits in hex: this is what is read back.
    pub bits: String,
}

impl From<f64> for ExactF64 {
    fn from(v: f64) -> Self {
        Self {
            value: v.is_finite().then_some(v),
            bits: format!("{:016x}", v.to_bits()),
        }
    }
}

impl ExactF64 {
    /// The exact value, or `None` when `bits` is not 16 hex digits.
    pub fn get(&self) -> Option<f64> {
        if self.bits.len() != 16 {
            return None;
        }
        u64::from_str_radix(&self.bits, 16).ok().map(f64::from_bits)
    }
}

/// An accumulator in its JSON form.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct AccumulatorJson {
    /// Number of values.
    pub count: u64,
    /// Their mean.
    pub mean: ExactF64,
    /// Their Σ (x − mean)².
    pub m2: ExactF64,
}

impl From<&Accumulator> for AccumulatorJson {
    fn from(a: &Accumulator) -> Self {
        Self {
            count: a.count,
            mean: a.mean.into(),
            m2: a.m2.into(),
        }
    }
}

impl AccumulatorJson {
    /// Back to an accumulator; `None` if a float is malformed.
    pub fn get(&self) -> Option<Accumulator> {
        Some(Accumulator {
            count: self.count,
            mean: self.mean.get()?,
            m2: self.m2.get()?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(v: &[f64]) -> (f64, f64) {
        let n = v.len() as f64;
        let mean = v.iter().sum::<f64>() / n;
        let var = v.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / (n - 1.0);
        (mean, var.sqrt())
    }

    #[test]
    fn merge_equals_whole() {
        let v: Vec<f64> = (0..1000)
            .map(|i| ((i * 7919) % 1000) as f64 * 0.37 - 50.0)
            .collect();
        let whole = Accumulator::from_values(v.iter().copied());
        let mut merged = Accumulator::default();
        for chunk in v.chunks(77) {
            merged = merged.merge(&Accumulator::from_values(chunk.iter().copied()));
        }
        let (mean, std) = naive(&v);
        for a in [whole, merged] {
            assert_eq!(a.count, 1000);
            assert!((a.pandas_mean() - mean).abs() <= 1e-12 * mean.abs().max(1.0));
            assert!((a.pandas_std() - std).abs() <= 1e-12 * std);
        }
    }

    #[test]
    fn nan_skipped_and_small_counts() {
        let a = Accumulator::from_values([1.0, f64::NAN, 3.0].into_iter());
        assert_eq!(a.count, 2);
        assert_eq!(a.pandas_mean(), 2.0);
        assert_eq!(a.pandas_std(), 2f64.sqrt());
        let one = Accumulator::from_values([5.0].into_iter());
        assert!(one.pandas_std().is_nan());
        assert!(Accumulator::default().pandas_mean().is_nan());
    }

    #[test]
    fn json_round_trip_is_lossless() {
        let a = Accumulator {
            count: 3,
            mean: 0.1 + 0.2,
            m2: f64::NAN,
        };
        let json = serde_json::to_string(&AccumulatorJson::from(&a)).expect("test");
        let back: AccumulatorJson = serde_json::from_str(&json).expect("test");
        let b = back.get().expect("test");
        assert_eq!(a.mean.to_bits(), b.mean.to_bits());
        assert_eq!(a.m2.to_bits(), b.m2.to_bits());
    }
}
