//! One image file → one S×S×3 RGB crop, the way torchvision's `Resize(S)` + `CenterCrop(S)`
//! does it on a Pillow image: shorter side to S (longer side `floor(S·long/short)`), bilinear
//! filter with antialiasing (support scaled with the reduction, as Pillow does), then the
//! centered S×S window (offset rounded half-to-even, like Python's `round`).
//!
//! Stack, chosen for speed with no system library: `zune-jpeg` (pure Rust, SIMD IDCT and colour
//! conversion, on a par with libjpeg-turbo; handles baseline, progressive, grayscale, CMYK/YCCK),
//! `png` (palette, 16-bit, alpha, grayscale via its expand/strip transformations) and
//! `fast_image_resize` (SIMD convolution that reproduces Pillow's fixed-point resampling).
//! Only the crop window is resampled: the filter taps are the ones a full resize would use
//! (the crop box is given in source coordinates), so the result equals resize-then-crop while
//! doing ~S/long of the vertical/horizontal work.
//!
//! Decoders run on hostile bytes: each call is wrapped in `catch_unwind`, and images larger
//! than [`MAX_PIXELS`] are refused before any buffer is allocated.

use std::cell::RefCell;
use std::io::Cursor;
use std::panic::{catch_unwind, AssertUnwindSafe};

use fast_image_resize::images::{Image, ImageRef};
use fast_image_resize::{FilterType, PixelType, ResizeAlg, ResizeOptions, Resizer};
use zune_core::bytestream::ZCursor;
use zune_core::colorspace::ColorSpace;
use zune_core::options::DecoderOptions;
use zune_jpeg::JpegDecoder;

/// Largest decoded image accepted (pixels): 2^28 ≈ 268 Mpx, ~800 MB of RGB; larger headers are
/// far more likely hostile than real photographs.
pub const MAX_PIXELS: u64 = 1 << 28;

/// Longest side accepted by the JPEG decoder (JPEG's own limit is 65535).
const MAX_SIDE: usize = 1 << 16;

/// A decoded RGB image, 3 bytes per pixel, rows packed.
struct Rgb {
    width: u32,
    height: u32,
    pixels: Vec<u8>,
}

/// The kind of an image file, from its first bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// JPEG (`FF D8 FF`).
    Jpeg,
    /// PNG (`89 50 4E 47 0D 0A 1A 0A`).
    Png,
}

/// Detects JPEG or PNG from the magic bytes.
pub fn sniff(bytes: &[u8]) -> Option<Kind> {
    if bytes.starts_with(&[0xFF, 0xD8, 0xFF]) {
        Some(Kind::Jpeg)
    } else if bytes.starts_with(b"\x89PNG\r\n\x1a\n") {
        Some(Kind::Png)
    } else {
        None
    }
}

/// Size (width, height) after torchvision's `Resize(size)`: shorter side to `size`.
pub fn resized_dims(width: u32, height: u32, size: u32) -> (u32, u32) {
    let (w, h, s) = (u64::from(width), u64::from(height), u64::from(size));
    if w <= h {
        (size, (s * h / w) as u32)
    } else {
        ((s * w / h) as u32, size)
    }
}

/// Offset of a centered crop of `crop` out of `len`: Python's `int(round((len - crop) / 2))`.
pub fn center_offset(len: u32, crop: u32) -> u32 {
    let d = len.saturating_sub(crop);
    let q = d / 2;
    if d % 2 == 1 && q % 2 == 1 {
        q + 1 // x.5 rounds to the even neighbour
    } else {
        q
    }
}

/// Decodes `bytes` (JPEG or PNG) and writes the S×S×3 crop into `out` (`out.len() == 3·S·S`).
pub fn render(bytes: &[u8], size: u32, out: &mut [u8]) -> Result<(), String> {
    let rgb = match catch_unwind(AssertUnwindSafe(|| decode_rgb(bytes))) {
        Ok(result) => result?,
        Err(_) => return Err("decoder panicked on this file".into()),
    };
    match catch_unwind(AssertUnwindSafe(|| resize_crop(&rgb, size, out))) {
        Ok(result) => result,
        Err(_) => Err("resizer panicked on this file".into()),
    }
}

/// Decodes to packed RGB.
fn decode_rgb(bytes: &[u8]) -> Result<Rgb, String> {
    match sniff(bytes) {
        Some(Kind::Jpeg) => decode_jpeg(bytes),
        Some(Kind::Png) => decode_png(bytes),
        None => Err("not a JPEG or PNG file (unknown magic bytes)".into()),
    }
}

fn check_size(width: u64, height: u64) -> Result<(), String> {
    if width == 0 || height == 0 {
        return Err(format!("image has zero size {width}x{height}"));
    }
    if width * height > MAX_PIXELS {
        return Err(format!(
            "image is {width}x{height}, more than {MAX_PIXELS} pixels"
        ));
    }
    Ok(())
}

fn decode_jpeg(bytes: &[u8]) -> Result<Rgb, String> {
    let options = DecoderOptions::default()
        .jpeg_set_out_colorspace(ColorSpace::RGB)
        .set_max_width(MAX_SIDE)
        .set_max_height(MAX_SIDE);
    let mut dec = JpegDecoder::new_with_options(ZCursor::new(bytes), options);
    dec.decode_headers()
        .map_err(|e| format!("bad JPEG header: {e:?}"))?;
    let info = dec.info().ok_or("bad JPEG header: no frame")?;
    let (w, h) = (u64::from(info.width), u64::from(info.height));
    check_size(w, h)?;
    let pixels = dec
        .decode()
        .map_err(|e| format!("corrupt JPEG data: {e:?}"))?;
    let n = (w * h) as usize;
    let colorspace = dec.output_colorspace().unwrap_or(ColorSpace::RGB);
    let pixels = match (colorspace.num_components(), pixels.len() / n.max(1)) {
        (3, 3) => pixels,
        (_, 1) => gray_to_rgb(&pixels),
        (_, 4) => cmyk_to_rgb(&pixels),
        (c, got) => return Err(format!("JPEG decoded to {got} channels (expected {c})")),
    };
    if pixels.len() != n * 3 {
        return Err(format!(
            "JPEG decoded to {} bytes, expected {}",
            pixels.len(),
            n * 3
        ));
    }
    Ok(Rgb {
        width: w as u32,
        height: h as u32,
        pixels,
    })
}

fn decode_png(bytes: &[u8]) -> Result<Rgb, String> {
    let mut dec = png::Decoder::new(Cursor::new(bytes));
    dec.set_transformations(png::Transformations::normalize_to_color8());
    dec.set_limits(png::Limits {
        bytes: (MAX_PIXELS * 4) as usize,
    });
    let mut reader = dec
        .read_info()
        .map_err(|e| format!("bad PNG header: {e}"))?;
    let (w, h) = reader.info().size();
    check_size(u64::from(w), u64::from(h))?;
    let len = reader.output_buffer_size().ok_or("PNG too large")?;
    let mut buf = vec![0u8; len];
    let frame = reader
        .next_frame(&mut buf)
        .map_err(|e| format!("corrupt PNG data: {e}"))?;
    buf.truncate(frame.buffer_size());
    let (w, h) = (frame.width, frame.height);
    let n = w as usize * h as usize;
    let line = frame.line_size;
    // Rows are packed for 8-bit output; be defensive anyway.
    let channels = line / w.max(1) as usize;
    if channels == 0 || line * h as usize > buf.len() {
        return Err("PNG frame smaller than its header says".into());
    }
    let mut rgb = Vec::with_capacity(n * 3);
    for row in buf.chunks_exact(line).take(h as usize) {
        let row = &row[..w as usize * channels];
        match channels {
            1 | 2 => {
                for px in row.chunks_exact(channels) {
                    rgb.extend_from_slice(&[px[0], px[0], px[0]]);
                }
            }
            3 => rgb.extend_from_slice(row),
            4 => {
                // Alpha is dropped, as Pillow's convert("RGB") does.
                for px in row.chunks_exact(4) {
                    rgb.extend_from_slice(&px[..3]);
                }
            }
            c => return Err(format!("PNG with {c} channels per pixel after expansion")),
        }
    }
    Ok(Rgb {
        width: w,
        height: h,
        pixels: rgb,
    })
}

fn gray_to_rgb(gray: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(gray.len() * 3);
    for &g in gray {
        out.extend_from_slice(&[g, g, g]);
    }
    out
}

/// CMYK as stored by Adobe (inverted: 255 = no ink) → RGB, `R = C·K/255` as Pillow does for
/// the JPEGs it reads with raw mode `CMYK;I`.
fn cmyk_to_rgb(cmyk: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(cmyk.len() / 4 * 3);
    for px in cmyk.chunks_exact(4) {
        let k = u32::from(px[3]);
        let f = |c: u8| ((u32::from(c) * k + 127) / 255) as u8;
        out.extend_from_slice(&[f(px[0]), f(px[1]), f(px[2])]);
    }
    out
}

thread_local! {
    /// One resizer per thread: it keeps its scratch buffers between images.
    static RESIZER: RefCell<Resizer> = RefCell::new(Resizer::new());
}

fn resize_crop(rgb: &Rgb, size: u32, out: &mut [u8]) -> Result<(), String> {
    let (nw, nh) = resized_dims(rgb.width, rgb.height, size);
    let left = center_offset(nw, size);
    let top = center_offset(nh, size);
    let sx = f64::from(rgb.width) / f64::from(nw);
    let sy = f64::from(rgb.height) / f64::from(nh);
    let src = ImageRef::new(rgb.width, rgb.height, &rgb.pixels, PixelType::U8x3)
        .map_err(|e| format!("internal: source image: {e}"))?;
    let mut dst = Image::from_slice_u8(size, size, out, PixelType::U8x3)
        .map_err(|e| format!("internal: destination image: {e}"))?;
    // The box can overshoot the image by a rounding error; clamp it to the image.
    let (bl, bt) = (f64::from(left) * sx, f64::from(top) * sy);
    let bw = (f64::from(size) * sx).min(f64::from(rgb.width) - bl);
    let bh = (f64::from(size) * sy).min(f64::from(rgb.height) - bt);
    let options = ResizeOptions::new()
        .resize_alg(ResizeAlg::Convolution(FilterType::Bilinear))
        .crop(bl, bt, bw, bh);
    RESIZER.with(|r| {
        r.borrow_mut()
            .resize(&src, &mut dst, &options)
            .map_err(|e| format!("resize: {e}"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dims_follow_torchvision() {
        assert_eq!(resized_dims(500, 375, 224), (298, 224));
        assert_eq!(resized_dims(375, 500, 224), (224, 298));
        assert_eq!(resized_dims(224, 224, 224), (224, 224));
        assert_eq!(resized_dims(10, 1000, 224), (224, 22400));
    }

    #[test]
    fn center_offset_rounds_half_to_even() {
        assert_eq!(center_offset(224, 224), 0);
        assert_eq!(center_offset(225, 224), 0); // round(0.5) == 0
        assert_eq!(center_offset(227, 224), 2); // round(1.5) == 2
        assert_eq!(center_offset(229, 224), 2); // round(2.5) == 2
        assert_eq!(center_offset(298, 224), 37);
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        let mut out = vec![0u8; 3 * 8 * 8];
        assert!(render(b"", 8, &mut out).is_err());
        assert!(render(b"\xFF\xD8\xFF\xE0garbage", 8, &mut out).is_err());
        assert!(render(b"\x89PNG\r\n\x1a\n\0\0", 8, &mut out).is_err());
    }
}
