//! Scratch cache and prefetch.
