//! Image folders as arrays: `images.npy` (uint8 `[N,S,S,3]`), `labels.npy` (int64 `[N]`),
//! `classes.txt`, `files.txt`.
//!
//! `decode` renders one file into one slot (modes, limits), over `jpeg` (libjpeg-turbo), `png`
//! (streamed rows) and `resample` (Pillow's filter on the crop window); `budget` bounds the
//! pixels all decodes of the process hold at once; `view` is the array itself.

pub mod budget;
pub mod decode;
pub mod jpeg;
pub mod png;
/// Pillow's filter, in its own crate so the loader's augmentation (stagefs-gpu) shares it
/// without depending on this crate's arrow/parquet.
pub use stagefs_resample as resample;
mod view;

pub use budget::DecodeBudget;
pub use decode::DecodeSettings;
pub use view::{image_file_view, images_len, ImagesView};
