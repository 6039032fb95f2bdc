//! The GPU streamer: `.npy` tensors into device memory through a ring of pinned host buffers.
//!
//! Filled in by the GPU streamer issue.
