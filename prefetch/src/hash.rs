//! A hash that is stable across builds, Rust versions and machines (std's `DefaultHasher` is
//! not promised to be): FNV-1a, 64 bit. Used where a hash names something persistent — a
//! view's generation in the cache log, a default cache directory.

use std::hash::Hasher;

/// FNV-1a, 64 bit.
#[derive(Clone, Copy, Debug)]
pub struct StableHasher(u64);

impl Default for StableHasher {
    fn default() -> Self {
        StableHasher(0xcbf2_9ce4_8422_2325)
    }
}

impl Hasher for StableHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

/// FNV-1a of `bytes`.
pub fn stable_hash(bytes: &[u8]) -> u64 {
    let mut h = StableHasher::default();
    h.write(bytes);
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pinned_values() {
        // Changing these would orphan every existing cache.
        assert_eq!(stable_hash(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(stable_hash(b"a"), 0xaf63_dc4c_8601_ec8c);
    }
}
