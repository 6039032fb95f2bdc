//! The image renderer (stagefs-views `image::decode::render`): JPEG or PNG bytes decoded,
//! resized and center-cropped into an S×S×3 slot. The renderer catches decoder panics itself
//! (a bad image reads as zeros, by design), so a panic only counts when it escapes `render`
//! (see `count_only_escaping_panics`); an abort, an allocation failure or a hang counts always.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stagefs_fuzz::count_only_escaping_panics;
use stagefs_views::image::decode::render;

/// A small crop side keeps executions fast; the resize path is the same for every size.
const SIZE: u32 = 16;

fuzz_target!(init: count_only_escaping_panics(), |data: &[u8]| {
    let mut out = vec![0u8; (3 * SIZE * SIZE) as usize];
    let _ = render(data, SIZE, &mut out);
});
