//! Formats and tensor views for stagefs.
//!
//! This crate knows nothing of FUSE: a view is "exact size up front + render any byte range",
//! and decoders get their input bytes from the caller, so the mount feeds them from the scratch
//! cache and `stagefs convert` from plain files.

pub mod clean;
pub mod npy;
