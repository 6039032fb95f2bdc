//! The image renderer (stagefs-views `image::decode::render`): JPEG or PNG bytes decoded,
//! resized and center-cropped into an S×S×3 slot. The renderer catches decoder panics itself
//! (a bad image reads as zeros, by design), so a panic only counts when it escapes `render`;
//! an abort, an allocation failure or a hang counts always.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stagefs_views::image::decode::render;

/// A small crop side keeps executions fast; the resize path is the same for every size.
const SIZE: u32 = 16;

fuzz_target!(init: {
    // libfuzzer-sys's hook aborts on any panic, even one `render` catches by design: keep the
    // message, drop the abort (a panic escaping `render` still aborts in fuzz_target!).
    std::panic::set_hook(Box::new(|info| {
        if std::env::var_os("FUZZ_SHOW_PANICS").is_some() {
            eprintln!("caught panic: {info}");
        }
    }));
}, |data: &[u8]| {
    let mut out = vec![0u8; (3 * SIZE * SIZE) as usize];
    let _ = render(data, SIZE, &mut out);
});
