//! The stagefs filesystem: a read-only mirror of a source tree served through the scratch
//! cache, plus virtual control files and tensor views.
//!
//! [`core::FsCore`] holds all behaviour as plain methods (lookup, getattr, readdir, open, read,
//! release) that tests call without a kernel mount; [`fuse`] is a thin adapter that translates
//! fuser requests and replies, mapping errors to errno in one place ([`error`]).

pub mod control;
pub mod core;
pub mod error;
pub mod fuse;
pub mod inode;
pub mod listing;
pub mod mount;
pub mod snapshot;
pub mod views;

pub use crate::core::{FsConfig, FsCore};
pub use error::FsError;
