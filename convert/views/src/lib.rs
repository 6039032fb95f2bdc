//! Tensor views for stagefs: tables and image folders as NumPy `.npy` arrays.
//!
//! This crate knows nothing of FUSE: a view is "exact size up front + render any byte range",
//! and decoders get their input bytes from the caller, so the mount feeds them from the scratch
//! cache and `stagefs convert` from plain files.

pub mod cores;
pub mod error;
pub mod image;
pub mod source;
pub mod table;
pub mod tree;
pub mod view;
pub mod viewset;
pub mod write;

pub use cores::job_cores;
pub use error::ViewError;
pub use source::{ByteSource, DirSource, EntryKind, SourceEntry};
pub use tree::{ImageFolder, TableFormat, ViewDir, ViewTree};
pub use view::{View, ViewOptions};
pub use viewset::{open_view, table_entries, ViewEntry, ViewKind, ViewSet};
