//! The stagefs filesystem: a read-only mirror of a source tree served from a metadata snapshot
//! through the scratch cache, plus virtual control files and tensor views.
//!
//! [`fscore::FsCore`] holds all behaviour (named `fscore`, not `core`, which is Rust's) as
//! plain methods (lookup, getattr, readdir, open, read, release) that tests call without a
//! kernel mount; [`session`] builds it and starts and stops its background work; [`fuse`] is a
//! thin adapter that translates fuser requests and replies, mapping errors to errno in one
//! place ([`error`]).
//!
//! - [`snapshot`]: the tree's metadata, listed once with many requests in flight, persisted.
//! - [`files`]: source files through the cache (node → entry binding, read path, prefetch).
//! - [`walk`]: following readers through directories (cross-file prefetch, page pushes).
//! - [`stream`]: what is pushed of large files (ahead of sequential readers, the rest of a
//!   block); [`pushers`]: the threads that push it; [`sink`]: where pushes go.
//! - [`views`]: the `.npy/` tree.
//! - [`hints`]: the control socket in the cache directory: read-order hints from loaders and
//!   [`direct`] descriptors of verified copies ([`stagefs_protocol`] for the messages); both
//!   get a [`handle::MountHandle`] of the mount, not the core.
//!   [`scope`]: the node's declared part, which staging and speculation keep to.
//! - [`inode`]: inode numbers; [`control`]: the virtual tree's names and the stats file;
//!   [`mount`]: kernel sessions.
//! - [`offload`]: the view pool, so slow renders never hold the FUSE threads.

pub mod control;
pub mod direct;
pub mod direct_table;
pub mod error;
pub mod files;
pub mod fscore;
pub mod fuse;
pub mod handle;
pub mod hints;
pub mod inode;
pub mod mount;
pub mod offload;
pub mod pushers;
pub mod scope;
pub mod scope_stager;
pub mod session;
pub mod sink;
pub mod snapshot;
pub mod stream;
pub mod views;
pub mod walk;

pub use crate::fscore::{FsConfig, FsCore};
pub use error::FsError;
/// What the CLI needs of the cache layer, so it does not reach into `stagefs-prefetch`.
pub use stagefs_prefetch::{cachedir::CacheDir, hash::stable_hash, FetchConfig, StatsSnapshot};
