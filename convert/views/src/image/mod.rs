//! Image folders as arrays: `images.npy` (uint8 `[N,S,S,3]`), `labels.npy` (int64 `[N]`),
//! `classes.txt`, `files.txt`.

pub mod decode;
mod view;

pub use view::{image_file_view, images_len, ImagesView};
