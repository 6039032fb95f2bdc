//! One image file → one S×S×3 RGB crop, the way torchvision's `Resize(S)` + `CenterCrop(S)`
//! does it on a Pillow image: shorter side to S (longer side `floor(S·long/short)`), Pillow's
//! antialiased BILINEAR filter, then the centred S×S window (offset rounded half-to-even, like
//! Python's `round`).
//!
//! Pipeline, per image: read the header; refuse it above the pixel cap; plan the decode (the
//! crop window's filter taps give the source rectangle that is needed, see [`resample`]); wait
//! for the plan's pixels in the [`DecodeBudget`]; decode only that rectangle (JPEG: TurboJPEG
//! cropping region; PNG: rows streamed through the horizontal pass); resample the window.
//!
//! Two modes:
//! - *exact* (default): JPEGs decoded at full scale by libjpeg-turbo with Pillow's settings and
//!   resampled with Pillow's fixed-point arithmetic, so the slot equals Pillow's
//!   `open → convert("RGB") → resize → crop` byte for byte (same libjpeg-turbo decoder). One
//!   exception, for memory: a JPEG whose crop window would exceed [`MAX_WINDOW_PIXELS`] (or
//!   the decode budget) is decoded at the smallest DCT reduction that fits.
//! - *fast* (`fast: true`): JPEGs decoded at `M/8` scale in the DCT domain with the smallest
//!   `M` (1..=8) that keeps the shorter side ≥ S, then the same resize with the full-resolution
//!   geometry (Pillow's `box=` in the scaled image), so the crop covers the same scene.
//!
//! Decoders run on hostile bytes: every size is checked before anything is allocated, all
//! buffers are fallible reservations, and the whole render runs under `catch_unwind`.

use std::cell::RefCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use super::budget::DecodeBudget;
use super::jpeg::{self, Pixels, Region};
use super::png;
use super::resample::{horizontal_row, vertical, Taps};

/// Default pixel cap (`width × height` from a header): 2^26 ≈ 67 Mpx (8192²; a 9500×7000
/// photograph fits). Larger headers are far more likely hostile than real; `--max-image-pixels`
/// raises it. (Pillow warns at 89 Mpx and refuses 179 Mpx.)
pub const DEFAULT_MAX_PIXELS: u64 = 1 << 26;

/// Largest JPEG region decoded at once: 2^24 px (a 4096² window, from photos up to ~20 Mpx);
/// above it the JPEG is decoded at the smallest DCT reduction that fits (in exact mode too).
pub const MAX_WINDOW_PIXELS: u64 = 1 << 24;

/// Scaled pixels kept beyond the filter taps on each side of a JPEG cropping region, so that
/// no pixel the filter reads sits at the region's edge, where libjpeg's fancy upsampling sees
/// no neighbour.
const CROP_MARGIN: u32 = 8;

/// Scratch buffers larger than this are freed after the image instead of kept for the next:
/// what a thread keeps between images (1 MiB each: a 500×375 window, its intermediate) stays
/// small beside the budget, which only counts decodes in flight.
const RETAIN_BYTES: usize = 1 << 20;

/// How images are decoded.
#[derive(Clone, Debug)]
pub struct DecodeSettings {
    /// Fast mode (reduced-scale JPEG decoding) instead of exact.
    pub fast: bool,
    /// Pixel cap: larger images are bad inputs.
    pub max_pixels: u64,
    /// Budget shared by every decode of the process.
    pub budget: Arc<DecodeBudget>,
}

impl Default for DecodeSettings {
    fn default() -> Self {
        DecodeSettings {
            fast: false,
            max_pixels: DEFAULT_MAX_PIXELS,
            budget: DecodeBudget::process_default(),
        }
    }
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

/// Size (width, height) after torchvision's `Resize(size)`: shorter side to `size`
/// (saturating at `u32::MAX` for absurd aspect ratios, which the renderer refuses).
pub fn resized_dims(width: u32, height: u32, size: u32) -> (u32, u32) {
    let (w, h, s) = (
        u64::from(width.max(1)),
        u64::from(height.max(1)),
        u64::from(size),
    );
    let sat = |v: u64| u32::try_from(v).unwrap_or(u32::MAX);
    if w <= h {
        (size, sat(s * h / w))
    } else {
        (sat(s * w / h), size)
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

/// Decodes `bytes` (JPEG or PNG) in exact mode with the default cap and the process budget,
/// and writes the S×S×3 crop into `out` (`out.len() == 3·S·S`).
pub fn render(bytes: &[u8], size: u32, out: &mut [u8]) -> Result<(), String> {
    render_with(bytes, size, &DecodeSettings::default(), out)
}

/// [`render`] with explicit settings.
pub fn render_with(
    bytes: &[u8],
    size: u32,
    settings: &DecodeSettings,
    out: &mut [u8],
) -> Result<(), String> {
    if size == 0 || out.len() as u64 != 3 * u64::from(size) * u64::from(size) {
        return Err(format!(
            "internal: output of {} bytes for S={size}",
            out.len()
        ));
    }
    match catch_unwind(AssertUnwindSafe(|| match sniff(bytes) {
        Some(Kind::Jpeg) => render_jpeg(bytes, size, settings, out),
        Some(Kind::Png) => render_png(bytes, size, settings, out),
        None => Err("not a JPEG or PNG file (unknown magic bytes)".into()),
    })) {
        Ok(result) => result,
        Err(_) => Err("decoder panicked on this file".into()),
    }
}

/// Most pixels a JPEG may declare per byte of file. The leanest baseline encoding of a flat
/// image spends a few bits per 8×8 block (DC difference + end of block), a few hundred pixels a
/// byte; 4096 leaves a wide margin for real files and refuses a 732-byte header declaring
/// 57 Mpx (fuzzer finding: seconds of CPU per decode, then truncated anyway).
const JPEG_PIXELS_PER_BYTE: u64 = 4096;
/// Most pixels a PNG may declare per byte of file: deflate expands a byte to at most ~1032,
/// and a 1-bit image packs 8 pixels per byte (~8.3 K pixels a byte); twice that.
const PNG_PIXELS_PER_BYTE: u64 = 16_384;

fn check_size(
    width: u32,
    height: u32,
    file_len: usize,
    per_byte: u64,
    settings: &DecodeSettings,
) -> Result<(), String> {
    let px = u64::from(width) * u64::from(height);
    if px == 0 {
        return Err(format!("image has zero size {width}x{height}"));
    }
    if px / per_byte > file_len as u64 {
        return Err(format!(
            "image declares {width}x{height} pixels in a file of {file_len} bytes, more than \
             its format can hold (truncated, or a decompression bomb)"
        ));
    }
    if px > settings.max_pixels {
        return Err(format!(
            "image is {width}x{height} = {px} pixels, more than the cap of {} \
             (--max-image-pixels raises it)",
            settings.max_pixels
        ));
    }
    Ok(())
}

/// The crop window's filter taps in an image of `sw×sh` pixels that shows the `w×h` original
/// at scale `sw/w` (exactly `m/8`), with the resize geometry of the original.
struct Window {
    h: Taps,
    v: Taps,
}

impl Window {
    fn new(w: u32, h: u32, m: u32, size: u32) -> Result<Window, String> {
        let (nw, nh) = resized_dims(w, h, size);
        if nw == u32::MAX || nh == u32::MAX {
            return Err(format!(
                "image {w}x{h} has an aspect ratio too extreme to resize"
            ));
        }
        let (left, top) = (center_offset(nw, size), center_offset(nh, size));
        let f = f64::from(m) / 8.0;
        let (sw, sh) = (jpeg::scaled(w, m), jpeg::scaled(h, m));
        Ok(Window {
            h: Taps::new(sw, 0.0, f64::from(w) * f, nw, left, size),
            v: Taps::new(sh, 0.0, f64::from(h) * f, nh, top, size),
        })
    }
}

/// Per-thread buffers reused from image to image.
#[derive(Default)]
struct Scratch {
    window: Vec<u8>,
    tmp: Vec<u8>,
    gray: Vec<u8>,
    acc: Vec<i32>,
}

impl Scratch {
    fn trim(&mut self) {
        for v in [&mut self.window, &mut self.tmp, &mut self.gray] {
            if v.capacity() > RETAIN_BYTES {
                *v = Vec::new();
            }
        }
        if self.acc.capacity() * 4 > RETAIN_BYTES {
            self.acc = Vec::new();
        }
    }
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

fn with_scratch<T>(f: impl FnOnce(&mut Scratch) -> T) -> T {
    SCRATCH.with(|cell| {
        let mut s = cell.borrow_mut();
        let result = f(&mut s);
        s.trim();
        result
    })
}

/// Resizes `buf` to `len` bytes with a fallible reservation. The contents are left as they are
/// (every caller overwrites all of them), so a reused buffer is not zeroed again per image.
fn ensure_len(buf: &mut Vec<u8>, len: usize) -> Result<(), String> {
    if len > buf.len() {
        buf.try_reserve(len - buf.len())
            .map_err(|_| format!("cannot allocate {len} bytes"))?;
        buf.resize(len, 0);
    }
    buf.truncate(len);
    Ok(())
}

/// Pixels (of 3 bytes) a decode holding `bytes` charges to the budget.
fn px(bytes: f64) -> u64 {
    (bytes / 3.0).ceil() as u64
}

struct JpegPlan {
    m: u32,
    window: Window,
    region: Region,
    charge: u64,
}

fn plan_jpeg(
    head: &jpeg::Header,
    size: u32,
    settings: &DecodeSettings,
) -> Result<JpegPlan, String> {
    let (w, h) = (head.width, head.height);
    let ch = head.pixels.channels() as f64;
    let start = if settings.fast {
        (1..=8u32)
            .find(|&m| jpeg::scaled(w, m).min(jpeg::scaled(h, m)) >= size)
            .unwrap_or(8)
    } else {
        8
    };
    let coefficients = if head.progressive {
        f64::from(w) * f64::from(h) * head.coefficients_per_pixel() * 2.0
    } else {
        0.0
    };
    let total = settings.budget.total();
    if px(coefficients) > total {
        return Err(format!(
            "progressive JPEG {w}x{h} needs more memory than the decode budget of {total} pixels"
        ));
    }
    for m in (1..=start).rev() {
        let window = Window::new(w, h, m, size)?;
        let (sw, sh) = (jpeg::scaled(w, m), jpeg::scaled(h, m));
        let (xl, xh) = window.h.span();
        let (yl, yh) = window.v.span();
        let (x0, x1) = match head.crop_align(m) {
            Some(a) if a > 0 => (
                xl.saturating_sub(CROP_MARGIN) / a * a,
                (xh + CROP_MARGIN).min(sw),
            ),
            _ => (0, sw),
        };
        let (y0, y1) = (yl.saturating_sub(CROP_MARGIN), (yh + CROP_MARGIN).min(sh));
        let region = Region {
            x: x0,
            y: y0,
            w: x1.saturating_sub(x0).max(1),
            h: y1.saturating_sub(y0).max(1),
        };
        let window_px = u64::from(region.w) * u64::from(region.h);
        let bytes = window_px as f64 * ch
            + f64::from(size) * f64::from(yh - yl) * ch
            + 2.0 * f64::from(size) * f64::from(size) * ch
            + coefficients;
        let charge = px(bytes);
        if charge <= total && window_px <= MAX_WINDOW_PIXELS {
            return Ok(JpegPlan {
                m,
                window,
                region,
                charge,
            });
        }
    }
    Err(format!(
        "JPEG {w}x{h} does not fit the decode budget of {total} pixels even at 1/8 scale"
    ))
}

fn render_jpeg(
    bytes: &[u8],
    size: u32,
    settings: &DecodeSettings,
    out: &mut [u8],
) -> Result<(), String> {
    let head = jpeg::header(bytes)?;
    check_size(
        head.width,
        head.height,
        bytes.len(),
        JPEG_PIXELS_PER_BYTE,
        settings,
    )?;
    let plan = plan_jpeg(&head, size, settings)?;
    let _held = settings.budget.acquire(plan.charge);
    let limits = jpeg::Limits {
        max_pixels: settings.max_pixels,
        max_memory: settings.budget.total().saturating_mul(3),
    };
    with_scratch(|s| {
        jpeg::decode(bytes, &head, plan.m, plan.region, limits, &mut s.window)?;
        let r = plan.region;
        let mut ch = head.pixels.channels();
        if head.pixels == Pixels::Cmyk {
            cmyk_to_rgb_in_place(&mut s.window);
            ch = 3;
        }
        let row_len = r.w as usize * ch;
        let (yl, yh) = plan.window.v.span();
        let out_row = size as usize * ch;
        ensure_len(&mut s.tmp, (yh - yl) as usize * out_row)?;
        for (i, y) in (yl..yh).enumerate() {
            let start = (y - r.y) as usize * row_len;
            let src = &s.window[start..start + row_len];
            let dst = &mut s.tmp[i * out_row..(i + 1) * out_row];
            resample_row(ch, src, r.x as usize, &plan.window.h, dst);
        }
        finish(s, ch, size, yl as usize, &plan.window.v, out)
    })
}

fn resample_row(ch: usize, src: &[u8], x0: usize, taps: &Taps, dst: &mut [u8]) {
    if ch == 1 {
        horizontal_row::<1>(src, x0, taps, dst);
    } else {
        horizontal_row::<3>(src, x0, taps, dst);
    }
}

/// The vertical pass from `s.tmp` (rows from `y0`, `ch` channels) into the RGB slot `out`.
fn finish(
    s: &mut Scratch,
    ch: usize,
    size: u32,
    y0: usize,
    taps: &Taps,
    out: &mut [u8],
) -> Result<(), String> {
    let out_row = size as usize * ch;
    if ch == 3 {
        vertical(&s.tmp, out_row, y0, taps, out, &mut s.acc);
        return Ok(());
    }
    ensure_len(&mut s.gray, size as usize * size as usize)?;
    vertical(&s.tmp, out_row, y0, taps, &mut s.gray, &mut s.acc);
    for (px, &g) in out.chunks_exact_mut(3).zip(s.gray.iter()) {
        px.fill(g);
    }
    Ok(())
}

fn render_png(
    bytes: &[u8],
    size: u32,
    settings: &DecodeSettings,
    out: &mut [u8],
) -> Result<(), String> {
    let head = png::header(bytes)?;
    check_size(
        head.width,
        head.height,
        bytes.len(),
        PNG_PIXELS_PER_BYTE,
        settings,
    )?;
    let window = Window::new(head.width, head.height, 8, size)?;
    let ch = head.channels;
    let (yl, yh) = window.v.span();
    let out_row = size as usize * ch;
    // The decoder's raw and previous rows (up to 8 bytes a pixel), our converted row, the
    // intermediate, the slot; an interlaced image's whole frame (up to 4 bytes a pixel).
    let w = f64::from(head.width);
    let mut bytes_held = 2.0 * 8.0 * w + w * ch as f64 + f64::from(yh - yl) * out_row as f64;
    bytes_held += 2.0 * f64::from(size) * f64::from(size) * 3.0;
    if head.interlaced {
        bytes_held += w * f64::from(head.height) * 4.0;
    }
    let charge = px(bytes_held);
    let total = settings.budget.total();
    if charge > total {
        return Err(format!(
            "PNG {}x{} needs more memory than the decode budget of {total} pixels",
            head.width, head.height
        ));
    }
    let _held = settings.budget.acquire(charge);
    with_scratch(|s| {
        ensure_len(&mut s.tmp, (yh - yl) as usize * out_row)?;
        let tmp = &mut s.tmp;
        let taps = &window.h;
        png::decode_rows(bytes, total.saturating_mul(3), |y, row| {
            let y = y as u32;
            if (yl..yh).contains(&y) {
                let i = (y - yl) as usize;
                resample_row(ch, row, 0, taps, &mut tmp[i * out_row..(i + 1) * out_row]);
            }
        })?;
        finish(s, ch, size, yl as usize, &window.v, out)
    })
}

/// Adobe-inverted CMYK (as libjpeg returns it) → RGB, in place (4 bytes a pixel become 3), the
/// way Pillow does it: raw mode `CMYK;I` inverts, then `convert("RGB")` computes
/// `R = 255 - K' - C'·(255 - K')/255` with its rounding `MULDIV255`.
fn cmyk_to_rgb_in_place(buf: &mut Vec<u8>) {
    let n = buf.len() / 4;
    for i in 0..n {
        let (c, m, y, k) = (buf[4 * i], buf[4 * i + 1], buf[4 * i + 2], buf[4 * i + 3]);
        // Pillow's CMYK (after inversion) is 255 - stored; nk = 255 - K' = stored k.
        let nk = i32::from(k);
        let f = |stored: u8| {
            let ink = 255 - i32::from(stored);
            let t = ink * nk + 128;
            let muldiv = ((t >> 8) + t) >> 8;
            (nk - muldiv).clamp(0, 255) as u8
        };
        buf[3 * i] = f(c);
        buf[3 * i + 1] = f(m);
        buf[3 * i + 2] = f(y);
    }
    buf.truncate(3 * n);
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

    #[test]
    fn cmyk_conversion_matches_pillow_formula() {
        // Stored (inverted) C=255 (no cyan ink), K=255 (no black): white.
        let mut b = vec![255, 255, 255, 255];
        cmyk_to_rgb_in_place(&mut b);
        assert_eq!(b, vec![255, 255, 255]);
        // Stored K=0 (full black): black whatever the rest.
        let mut b = vec![10, 200, 255, 0];
        cmyk_to_rgb_in_place(&mut b);
        assert_eq!(b, vec![0, 0, 0]);
    }
}
