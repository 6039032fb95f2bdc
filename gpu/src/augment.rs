//! Augmentation in the loader's reader threads: a crop of each uint8 image row, resized with the
//! image views' antialiased resampler, an optional horizontal flip, then an optional
//! normalisation to float32/float16 in NHWC or NCHW layout.
//!
//! Randomness comes from (seed, epoch, source row) alone ([`crop_rng`]), never from the thread
//! that happens to read the row or from the order of reads, so a batch is the same on resume,
//! with any number of readers, and on any machine. [`Transform::crop_box`] follows torchvision's
//! `RandomResizedCrop.get_params` (10 tries of area × aspect ratio, then a centred fallback), so
//! the distribution of crops is the one the standard recipe trains with; the draws themselves
//! come from SplitMix64 ([`crate::plan`]), not torch's generator.
//!
//! The resize is Pillow's BILINEAR (triangle filter, antialiased when shrinking) through the
//! crop box (`Image.resize(size, box=...)`), bit-exact with what the image views render; a
//! box of the output's own size (a [`Crop::Center`]) is a plain copy. The flip mirrors the
//! resized crop. Normalisation goes through a 256-entry table per channel, computed once in
//! `f64` (`(x / 255 - mean) / std`), so it costs one load per byte.

use stagefs_npy::DType;
use stagefs_resample::{horizontal_row, vertical, Taps};

use crate::error::StreamError;
use crate::plan::SplitMix64;

/// torchvision's number of tries for a crop that fits before the centred fallback.
const CROP_TRIES: usize = 10;

/// Which part of the image is kept and resized.
#[derive(Clone, Debug, PartialEq)]
pub enum Crop {
    /// The whole image, unchanged in size (only flip / normalize / dtype / layout apply).
    Full,
    /// torchvision's `RandomResizedCrop(size, scale, ratio)`: a random box of `scale` of the
    /// area and aspect ratio in `ratio` (log-uniform), resized to `size × size`.
    RandomResized {
        /// Output side.
        size: u32,
        /// Share of the image's area, (min, max).
        scale: (f64, f64),
        /// Aspect ratio width/height, (min, max).
        ratio: (f64, f64),
    },
    /// torchvision's `CenterCrop(size)`: the centred `size × size` window (no resize).
    Center {
        /// Output side.
        size: u32,
    },
}

/// The element type of transformed rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutType {
    /// Bytes as read (no normalisation allowed).
    U8,
    /// IEEE half precision.
    F16,
    /// IEEE single precision.
    F32,
}

/// What the readers do to each row of the first file.
#[derive(Clone, Debug, PartialEq)]
pub struct Transform {
    /// The crop.
    pub crop: Crop,
    /// Mirror left-right with probability 1/2.
    pub flip: bool,
    /// Per-channel (mean, std) on the 0..1 scale; `None` with a float type: `x / 255`.
    pub normalize: Option<(Vec<f64>, Vec<f64>)>,
    /// Element type of the output.
    pub dtype: OutType,
    /// Channels first (`C, H, W`) instead of the view's `H, W, C`.
    pub channels_first: bool,
}

/// A crop window in source pixels and whether the result is mirrored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CropBox {
    /// First row.
    pub top: u32,
    /// First column.
    pub left: u32,
    /// Rows.
    pub height: u32,
    /// Columns.
    pub width: u32,
    /// Mirrored left-right.
    pub flip: bool,
}

/// Height, width and channels of the image rows a transform reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// Rows of pixels.
    pub height: u32,
    /// Columns of pixels.
    pub width: u32,
    /// 1 (gray) or 3 (RGB).
    pub channels: u32,
}

/// The generator of one sample's draws: (seed, epoch, row) hashed through SplitMix64 steps.
pub fn crop_rng(seed: u64, epoch: u64, row: u64) -> impl FnMut() -> f64 {
    let hash = |x: u64| SplitMix64(x).next();
    let mut rng = SplitMix64(hash(hash(hash(seed) ^ epoch) ^ row));
    move || rng.unit()
}

/// Pre-computed per-reader state of a transform: the output table and scratch buffers.
pub struct Scratch {
    /// One raw row read from storage.
    pub raw: Vec<u8>,
    tmp: Vec<u8>,
    out: Vec<u8>,
    acc: Vec<i32>,
}

impl Scratch {
    /// Empty buffers; they grow to one row's size on first use.
    pub fn new() -> Self {
        Scratch {
            raw: Vec::new(),
            tmp: Vec::new(),
            out: Vec::new(),
            acc: Vec::new(),
        }
    }
}

impl Default for Scratch {
    fn default() -> Self {
        Self::new()
    }
}

fn config(msg: impl Into<String>) -> StreamError {
    StreamError::Config(msg.into())
}

/// Grows `buf` to `len` bytes without aborting on an impossible size.
fn ensure_len(buf: &mut Vec<u8>, len: usize) -> Result<(), StreamError> {
    if buf.len() < len {
        buf.try_reserve_exact(len - buf.len())
            .map_err(|e| config(format!("cannot hold a row of {len} bytes: {e}")))?;
        buf.resize(len, 0);
    }
    Ok(())
}

impl Transform {
    /// Checks the transform against the rows it reads (uint8 `[H, W]` or `[H, W, C]`, C 1 or
    /// 3) and returns their geometry.
    pub fn check(&self, row_shape: &[u64], dtype: Option<DType>) -> Result<Geometry, StreamError> {
        if dtype != Some(DType::U8) {
            return Err(config(format!(
                "image transforms read uint8 rows; the first file holds {}",
                dtype.map_or("raw bytes", DType::name)
            )));
        }
        let (h, w, c) = match *row_shape {
            [h, w] => (h, w, 1),
            [h, w, c] if c == 1 || c == 3 => (h, w, c),
            _ => {
                return Err(config(format!(
                    "image transforms read rows of shape [H, W] or [H, W, 1|3], not {row_shape:?}"
                )))
            }
        };
        let small = |v: u64| {
            u32::try_from(v)
                .ok()
                .filter(|&v| (1..=1 << 16).contains(&v))
        };
        let (Some(height), Some(width)) = (small(h), small(w)) else {
            return Err(config(format!(
                "images of {h}×{w} pixels: each side must be 1..=65536"
            )));
        };
        let geom = Geometry {
            height,
            width,
            channels: c as u32,
        };
        match self.crop {
            Crop::RandomResized { size, scale, ratio } => {
                if size == 0 || size > 1 << 14 {
                    return Err(config(format!("crop size {size}: use 1..=16384")));
                }
                let ok = |(a, b): (f64, f64)| a.is_finite() && b.is_finite() && 0.0 < a && a <= b;
                if !ok(scale) || scale.1 > 1.0 {
                    return Err(config(format!("scale {scale:?}: use 0 < min <= max <= 1")));
                }
                if !ok(ratio) {
                    return Err(config(format!("ratio {ratio:?}: use 0 < min <= max")));
                }
            }
            Crop::Center { size } => {
                if size == 0 || size > height || size > width {
                    return Err(config(format!(
                        "CenterCrop({size}) of {height}×{width} images: the crop must fit \
                         (render the view larger, e.g. --image-size {})",
                        size.max(1)
                    )));
                }
            }
            Crop::Full => {}
        }
        if let Some((mean, std)) = &self.normalize {
            if self.dtype == OutType::U8 {
                return Err(config("normalize needs dtype float32 or float16"));
            }
            let n = geom.channels as usize;
            if !(mean.len() == n || mean.len() == 1) || mean.len() != std.len() {
                return Err(config(format!(
                    "normalize: mean and std need 1 or {n} values each, got {} and {}",
                    mean.len(),
                    std.len()
                )));
            }
            if std.iter().any(|s| !s.is_finite() || *s == 0.0)
                || mean.iter().any(|m| !m.is_finite())
            {
                return Err(config(
                    "normalize: mean must be finite and std finite and non-zero",
                ));
            }
        }
        Ok(geom)
    }

    /// Output height and width.
    pub fn out_size(&self, geom: Geometry) -> (u32, u32) {
        match self.crop {
            Crop::Full => (geom.height, geom.width),
            Crop::RandomResized { size, .. } | Crop::Center { size } => (size, size),
        }
    }

    /// The output element type.
    pub fn out_dtype(&self) -> DType {
        match self.dtype {
            OutType::U8 => DType::U8,
            OutType::F16 => DType::F16,
            OutType::F32 => DType::F32,
        }
    }

    /// The shape of one output row.
    pub fn out_shape(&self, geom: Geometry) -> Vec<u64> {
        let (h, w) = self.out_size(geom);
        let (h, w, c) = (u64::from(h), u64::from(w), u64::from(geom.channels));
        if self.channels_first {
            vec![c, h, w]
        } else {
            vec![h, w, c]
        }
    }

    /// Bytes of one output row.
    pub fn out_row_bytes(&self, geom: Geometry) -> u64 {
        self.out_shape(geom).iter().product::<u64>() * self.out_dtype().size() as u64
    }

    /// The window and flip of sample `row` in `epoch`: the same for the same arguments,
    /// whatever thread or machine asks.
    pub fn crop_box(&self, seed: u64, epoch: u64, row: u64, geom: Geometry) -> CropBox {
        let (height, width) = (geom.height, geom.width);
        let mut uniform = crop_rng(seed, epoch, row);
        let mut window = match self.crop {
            Crop::Full => CropBox {
                top: 0,
                left: 0,
                height,
                width,
                flip: false,
            },
            Crop::Center { size } => CropBox {
                top: center_offset(height, size),
                left: center_offset(width, size),
                height: size,
                width: size,
                flip: false,
            },
            Crop::RandomResized { scale, ratio, .. } => {
                random_resized(height, width, scale, ratio, &mut uniform)
            }
        };
        window.flip = self.flip && uniform() < 0.5;
        window
    }

    /// Crops, resizes, flips and converts one row `src` (`geom`) into `dst` (its output row).
    pub fn apply(
        &self,
        src: &[u8],
        geom: Geometry,
        window: &CropBox,
        scratch: &mut Scratch,
        table: &Table,
        dst: &mut [u8],
    ) -> Result<(), StreamError> {
        let (oh, ow) = self.out_size(geom);
        let c = geom.channels as usize;
        let (oh_, ow_) = (oh as usize, ow as usize);
        let out_row = ow_ * c;
        ensure_len(&mut scratch.out, oh_ * out_row)?;
        // The whole output of a resize of the window (Pillow's `box=`) along each axis.
        let axis = |len: u32, from: u32, n: u32, out: u32| {
            Taps::new(len, f64::from(from), f64::from(from + n), out, 0, out)
        };
        let htaps = axis(geom.width, window.left, window.width, ow);
        let vtaps = axis(geom.height, window.top, window.height, oh);
        let in_row = geom.width as usize * c;
        let (yl, yh) = vtaps.span();
        ensure_len(&mut scratch.tmp, (yh - yl) as usize * out_row)?;
        for (i, y) in (yl..yh).enumerate() {
            let row = &src[y as usize * in_row..(y as usize + 1) * in_row];
            let out = &mut scratch.tmp[i * out_row..(i + 1) * out_row];
            if c == 1 {
                horizontal_row::<1>(row, 0, &htaps, out);
            } else {
                horizontal_row::<3>(row, 0, &htaps, out);
            }
        }
        let pixels = &mut scratch.out[..oh_ * out_row];
        vertical(
            &scratch.tmp[..(yh - yl) as usize * out_row],
            out_row,
            yl as usize,
            &vtaps,
            pixels,
            &mut scratch.acc,
        );
        if window.flip {
            for line in pixels.chunks_exact_mut(out_row) {
                mirror(line, c);
            }
        }
        table.write(pixels, (oh_, ow_, c), self.channels_first, dst);
        Ok(())
    }

    /// The per-channel conversion table of this transform for `channels` channels.
    pub fn table(&self, channels: u32) -> Table {
        let c = channels as usize;
        let value = |ch: usize, x: u8| -> f64 {
            let v = f64::from(x) / 255.0;
            match &self.normalize {
                Some((mean, std)) => {
                    let k = if mean.len() == 1 { 0 } else { ch };
                    (v - mean[k]) / std[k]
                }
                None => v,
            }
        };
        match self.dtype {
            OutType::U8 => Table::U8,
            OutType::F32 => Table::F32(
                (0..c)
                    .map(|ch| std::array::from_fn(|x| value(ch, x as u8) as f32))
                    .collect(),
            ),
            OutType::F16 => Table::F16(
                (0..c)
                    .map(|ch| {
                        std::array::from_fn(|x| half::f16::from_f64(value(ch, x as u8)).to_bits())
                    })
                    .collect(),
            ),
        }
    }
}

/// The value each byte of each channel turns into.
pub enum Table {
    /// Bytes stay bytes.
    U8,
    /// Per channel: 256 float32 values.
    F32(Vec<[f32; 256]>),
    /// Per channel: 256 float16 bit patterns.
    F16(Vec<[u16; 256]>),
}

impl Table {
    /// Writes `pixels` (`h × w × c` bytes, HWC) into `dst` in the table's type and the layout.
    fn write(&self, pixels: &[u8], (h, w, c): (usize, usize, usize), chw: bool, dst: &mut [u8]) {
        if let Table::U8 = self {
            if !chw || c == 1 {
                dst[..pixels.len()].copy_from_slice(pixels);
                return;
            }
        }
        // Output element (pixel, channel) sits at `px * c + ch` (HWC) or `ch * plane + px` (CHW):
        // one pass over the pixels, channel by channel, without a division per element.
        let plane = h * w;
        let (px_step, ch_step) = if chw { (1, plane) } else { (c, 1) };
        for ch in 0..c {
            let values = pixels.iter().skip(ch).step_by(c);
            let slots = (0..plane).map(|px| px * px_step + ch * ch_step);
            match self {
                Table::U8 => {
                    for (at, &p) in slots.zip(values) {
                        dst[at] = p;
                    }
                }
                Table::F32(t) => {
                    let t = &t[ch];
                    for (at, &p) in slots.zip(values) {
                        dst[at * 4..at * 4 + 4].copy_from_slice(&t[p as usize].to_le_bytes());
                    }
                }
                Table::F16(t) => {
                    let t = &t[ch];
                    for (at, &p) in slots.zip(values) {
                        dst[at * 2..at * 2 + 2].copy_from_slice(&t[p as usize].to_le_bytes());
                    }
                }
            }
        }
    }
}

/// Reverses the order of the `c`-byte pixels of one line.
fn mirror(line: &mut [u8], c: usize) {
    let n = line.len() / c;
    for i in 0..n / 2 {
        let j = n - 1 - i;
        for k in 0..c {
            line.swap(i * c + k, j * c + k);
        }
    }
}

/// torchvision's `CenterCrop` offset: `int(round((len - crop) / 2))`, Python's round (ties to
/// even).
fn center_offset(len: u32, crop: u32) -> u32 {
    (f64::from(len.saturating_sub(crop)) / 2.0).round_ties_even() as u32
}

/// torchvision's `RandomResizedCrop.get_params` with `uniform` draws in `[0, 1)`.
fn random_resized(
    height: u32,
    width: u32,
    scale: (f64, f64),
    ratio: (f64, f64),
    uniform: &mut impl FnMut() -> f64,
) -> CropBox {
    let area = f64::from(height) * f64::from(width);
    let (lr0, lr1) = (ratio.0.ln(), ratio.1.ln());
    for _ in 0..CROP_TRIES {
        let target = area * (scale.0 + (scale.1 - scale.0) * uniform());
        let aspect = (lr0 + (lr1 - lr0) * uniform()).exp();
        let w = (target * aspect).sqrt().round();
        let h = (target / aspect).sqrt().round();
        if 0.0 < w && w <= f64::from(width) && 0.0 < h && h <= f64::from(height) {
            let (w, h) = (w as u32, h as u32);
            // randint(0, H - h) inclusive, as torch.randint(0, H - h + 1).
            let top = (uniform() * f64::from(height - h + 1)) as u32;
            let left = (uniform() * f64::from(width - w + 1)) as u32;
            return CropBox {
                top: top.min(height - h),
                left: left.min(width - w),
                height: h,
                width: w,
                flip: false,
            };
        }
    }
    // Fallback: the whole image, its aspect ratio clamped into `ratio`, centred.
    let in_ratio = f64::from(width) / f64::from(height);
    let (w, h) = if in_ratio < ratio.0 {
        (
            width,
            ((f64::from(width) / ratio.0).round() as u32).clamp(1, height),
        )
    } else if in_ratio > ratio.1 {
        (
            ((f64::from(height) * ratio.1).round() as u32).clamp(1, width),
            height,
        )
    } else {
        (width, height)
    };
    CropBox {
        top: (height - h) / 2,
        left: (width - w) / 2,
        height: h,
        width: w,
        flip: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rrc(size: u32, flip: bool) -> Transform {
        Transform {
            crop: Crop::RandomResized {
                size,
                scale: (0.08, 1.0),
                ratio: (0.75, 4.0 / 3.0),
            },
            flip,
            normalize: None,
            dtype: OutType::U8,
            channels_first: false,
        }
    }

    #[test]
    fn random_crops_stay_inside_and_are_deterministic() {
        let t = rrc(16, true);
        for (h, w) in [(32, 32), (17, 90), (90, 17), (1, 1), (3, 200)] {
            let g = Geometry {
                height: h,
                width: w,
                channels: 3,
            };
            for row in 0..500 {
                let b = t.crop_box(7, 2, row, g);
                assert_eq!(b, t.crop_box(7, 2, row, g));
                assert!(b.height >= 1 && b.width >= 1, "{b:?}");
                assert!(
                    b.top + b.height <= h && b.left + b.width <= w,
                    "{b:?} in {h}x{w}"
                );
            }
        }
    }

    #[test]
    fn center_crop_copies_the_centred_window() {
        let t = Transform {
            crop: Crop::Center { size: 2 },
            ..rrc(2, false)
        };
        let g = Geometry {
            height: 4,
            width: 5,
            channels: 1,
        };
        let src: Vec<u8> = (0..20).collect();
        let b = t.crop_box(0, 0, 0, g);
        // torchvision: top round(1.0) = 1, left round(1.5) = 2 (ties to even).
        assert_eq!((b.top, b.left), (1, 2));
        let mut out = vec![0; 4];
        t.apply(&src, g, &b, &mut Scratch::new(), &t.table(1), &mut out)
            .unwrap();
        assert_eq!(out, [7, 8, 12, 13]);
    }

    #[test]
    fn normalized_channels_first_float32() {
        let t = Transform {
            crop: Crop::Full,
            flip: false,
            normalize: Some((vec![0.5, 0.0, 0.0], vec![0.5, 1.0, 2.0])),
            dtype: OutType::F32,
            channels_first: true,
        };
        let g = Geometry {
            height: 1,
            width: 2,
            channels: 3,
        };
        let src = [255u8, 255, 255, 0, 0, 0];
        let b = t.crop_box(0, 0, 0, g);
        let mut out = vec![0u8; 24];
        t.apply(&src, g, &b, &mut Scratch::new(), &t.table(3), &mut out)
            .unwrap();
        let v: Vec<f32> = out
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        assert_eq!(v, [1.0, -1.0, 1.0, 0.0, 0.5, 0.0]);
    }
}
