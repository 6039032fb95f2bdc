//! Pillow's BILINEAR resampling (the antialiased "triangle" filter of `Image.resize`),
//! reproduced to the bit and computed for the crop window only.
//!
//! Pillow (`libImaging/Resample.c`) resizes in two passes, horizontal then vertical, each a
//! convolution whose per-output taps come from `precompute_coeffs`: centre `in0 + (x+0.5)·scale`,
//! support `1·max(scale, 1)`, weights `1 - |d|` normalised to sum 1 in `f64`, then rounded to
//! fixed point with [`PRECISION_BITS`] = 22 fractional bits (`int(±0.5 + w·2^22)`); each pass
//! accumulates `Σ pixel·weight` from `2^21` in `i32` and clips `sum >> 22` to 0..255, so the
//! intermediate image is 8-bit. Everything here does exactly that, in the same order, so the
//! result equals `img.resize((nw, nh), BILINEAR).crop(box)` byte for byte.
//!
//! The saving: a torchvision `Resize(S)` + `CenterCrop(S)` keeps an S×S window of an
//! `nw×nh` resize. Output pixel `x` of a full resize depends only on its own taps, so the
//! window's taps are computed for `x ∈ [left, left+S)` alone: the horizontal pass runs on the
//! source rows the window's vertical taps touch and produces S columns (not `nw`), and the
//! vertical pass produces S rows (not `nh`). The source box (`in0..in1`, Pillow's `box=`) lets
//! a JPEG decoded at a reduced DCT scale keep the full-resolution geometry.

/// Fractional bits of Pillow's 8-bit fixed-point weights (`32 - 8 - 2`).
pub const PRECISION_BITS: u32 = 22;

/// The taps of a run of output pixels along one axis.
#[derive(Clone, Debug, Default)]
pub struct Taps {
    /// Per output pixel: (first source index, number of taps).
    bounds: Vec<(u32, u32)>,
    /// `ksize` fixed-point weights per output pixel (unused ones 0).
    weights: Vec<i32>,
    ksize: usize,
    /// `weights` with each weight repeated 4 times, for the SSE4.1 horizontal pass.
    wide: Vec<i32>,
    /// True when every output pixel copies one source pixel (`scale == 1`, box aligned).
    identity: bool,
}

/// Pillow's `bilinear_filter`.
fn triangle(x: f64) -> f64 {
    let x = x.abs();
    if x < 1.0 {
        1.0 - x
    } else {
        0.0
    }
}

impl Taps {
    /// Taps of output pixels `first..first + count` of a resize of source pixels `in0..in1`
    /// (of an axis `in_size` long) to `out_size` pixels: Pillow's `precompute_coeffs` and
    /// `normalize_coeffs_8bpc`, for a sub-range of the output.
    pub fn new(in_size: u32, in0: f64, in1: f64, out_size: u32, first: u32, count: u32) -> Taps {
        let scale = (in1 - in0) / f64::from(out_size.max(1));
        let filterscale = scale.max(1.0);
        let support = filterscale; // the triangle's support is 1
        let ksize = support.ceil() as usize * 2 + 1;
        let ss = 1.0 / filterscale;
        let mut taps = Taps {
            bounds: Vec::with_capacity(count as usize),
            weights: vec![0; count as usize * ksize],
            ksize,
            wide: Vec::new(),
            identity: true,
        };
        let mut k = vec![0f64; ksize];
        for (i, xx) in (first..first + count).enumerate() {
            let center = in0 + (f64::from(xx) + 0.5) * scale;
            // C's (int) cast truncates toward zero; values are > -1 here, so clamping first is
            // the same as Pillow's truncate-then-clamp.
            let xmin = ((center - support + 0.5) as i64).max(0);
            let xmax = ((center + support + 0.5) as i64).min(i64::from(in_size));
            let n = (xmax - xmin).clamp(0, ksize as i64) as usize;
            let mut ww = 0.0;
            for (x, kx) in k.iter_mut().enumerate().take(n) {
                let w = triangle((x as f64 + xmin as f64 - center + 0.5) * ss);
                *kx = w;
                ww += w;
            }
            let row = &mut taps.weights[i * ksize..i * ksize + ksize];
            for (dst, &w) in row.iter_mut().zip(&k).take(n) {
                let w = if ww != 0.0 { w / ww } else { w };
                let fixed = w * f64::from(1u32 << PRECISION_BITS);
                *dst = if w < 0.0 {
                    (-0.5 + fixed) as i32
                } else {
                    (0.5 + fixed) as i32
                };
            }
            let one = 1i32 << PRECISION_BITS;
            if !(n >= 1 && row[0] == one && row[1..].iter().all(|&w| w == 0)) {
                taps.identity = false;
            }
            taps.bounds.push((xmin as u32, n as u32));
        }
        taps.wide = taps.weights.iter().flat_map(|&w| [w; 4]).collect();
        taps
    }

    /// Source indices `[lo, hi)` any tap touches (empty when there are no taps).
    pub fn span(&self) -> (u32, u32) {
        let lo = self.bounds.iter().map(|b| b.0).min().unwrap_or(0);
        let hi = self.bounds.iter().map(|b| b.0 + b.1).max().unwrap_or(0);
        (lo, hi.max(lo))
    }

    /// Number of output pixels.
    pub fn len(&self) -> usize {
        self.bounds.len()
    }

    /// True when there are no output pixels.
    pub fn is_empty(&self) -> bool {
        self.bounds.is_empty()
    }

    fn tap(&self, i: usize) -> (usize, &[i32]) {
        let (start, n) = self.bounds[i];
        let w = &self.weights[i * self.ksize..i * self.ksize + n as usize];
        (start as usize, w)
    }
}

/// Pillow's `clip8` of an accumulated sum.
#[inline(always)]
fn clip8(sum: i32) -> u8 {
    (sum >> PRECISION_BITS).clamp(0, 255) as u8
}

/// One row of the horizontal pass: `src` holds source pixels from index `x0` on (`C` bytes
/// each), `dst` receives `taps.len()` pixels.
pub fn horizontal_row<const C: usize>(src: &[u8], x0: usize, taps: &Taps, dst: &mut [u8]) {
    if taps.identity {
        for (i, px) in dst.chunks_exact_mut(C).enumerate() {
            let s = (taps.bounds[i].0 as usize - x0) * C;
            px.copy_from_slice(&src[s..s + C]);
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if C == 3 && std::arch::is_x86_feature_detected!("sse4.1") {
        // SAFETY: the CPU has SSE4.1 (checked just above).
        unsafe { simd::horizontal_rgb(src, x0, taps, dst) };
        return;
    }
    for (i, px) in dst.chunks_exact_mut(C).enumerate() {
        let (start, w) = taps.tap(i);
        let from = (start - x0) * C;
        let pixels = &src[from..from + w.len() * C];
        let mut acc = [1i32 << (PRECISION_BITS - 1); C];
        for (p, &k) in pixels.chunks_exact(C).zip(w) {
            for c in 0..C {
                acc[c] += i32::from(p[c]) * k;
            }
        }
        for c in 0..C {
            px[c] = clip8(acc[c]);
        }
    }
}

/// The vertical pass: `src` holds rows of `row_len` bytes from source row `y0` on; writes
/// `taps.len()` rows of `row_len` bytes into `dst`. `acc` is scratch (reused across calls).
pub fn vertical(
    src: &[u8],
    row_len: usize,
    y0: usize,
    taps: &Taps,
    dst: &mut [u8],
    acc: &mut Vec<i32>,
) {
    if taps.identity {
        for (i, out) in dst.chunks_exact_mut(row_len).enumerate() {
            let s = (taps.bounds[i].0 as usize - y0) * row_len;
            out.copy_from_slice(&src[s..s + row_len]);
        }
        return;
    }
    acc.clear();
    acc.resize(row_len, 0);
    for (i, out) in dst.chunks_exact_mut(row_len).enumerate() {
        let (start, w) = taps.tap(i);
        acc.fill(1 << (PRECISION_BITS - 1));
        for (t, &k) in w.iter().enumerate() {
            let s = (start + t - y0) * row_len;
            multiply_add(acc, &src[s..s + row_len], k);
        }
        for (o, &a) in out.iter_mut().zip(acc.iter()) {
            *o = clip8(a);
        }
    }
}

/// The horizontal pass for RGB with SSE4.1: one output pixel's three sums in the lanes of one
/// register (`pmovzxbd` of 4 bytes, `pmulld` by the weight, `paddd`), the same integer
/// arithmetic as the scalar loop, so the same bytes. The last pixel of a row would load one byte
/// past it; pixels whose taps reach the end of `src` take the scalar path.
#[cfg(target_arch = "x86_64")]
mod simd {
    use super::{clip8, Taps, PRECISION_BITS};
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU must support SSE4.1.
    #[target_feature(enable = "sse4.1")]
    pub(super) unsafe fn horizontal_rgb(src: &[u8], x0: usize, taps: &Taps, dst: &mut [u8]) {
        // The common filter sizes (scale below 1, 1-2, 2-3, 3-4) with the tap loop unrolled.
        let fixed = match taps.ksize {
            3 => horizontal_fixed::<3>,
            5 => horizontal_fixed::<5>,
            7 => horizontal_fixed::<7>,
            9 => horizontal_fixed::<9>,
            _ => horizontal_any,
        };
        // SAFETY: the CPU has SSE4.1, as this function's own contract requires.
        unsafe { fixed(src, x0, taps, dst) }
    }

    /// [`horizontal_rgb`] for any filter size.
    ///
    /// # Safety
    /// The CPU must support SSE4.1.
    #[target_feature(enable = "sse4.1")]
    unsafe fn horizontal_any(src: &[u8], x0: usize, taps: &Taps, dst: &mut [u8]) {
        let half = _mm_set1_epi32(1 << (PRECISION_BITS - 1));
        let count = dst.len() / 3;
        let stride = taps.ksize * 4;
        for i in 0..count {
            let (start, n) = taps.bounds[i];
            let (from, n) = ((start as usize - x0) * 3, n as usize);
            let px = &mut dst[3 * i..3 * i + 3];
            if from + n * 3 + 1 > src.len() {
                let (_, w) = taps.tap(i);
                let mut acc = [1i32 << (PRECISION_BITS - 1); 3];
                for (p, &k) in src[from..from + n * 3].chunks_exact(3).zip(w) {
                    for c in 0..3 {
                        acc[c] += i32::from(p[c]) * k;
                    }
                }
                for c in 0..3 {
                    px[c] = clip8(acc[c]);
                }
                continue;
            }
            // SAFETY: taps t < n read bytes from + 3t .. from + 3t + 3 (4 with the extra
            // byte), all below src.len() (checked above: from + 3n + 1 <= len); the weights of
            // pixel i are wide[i·stride .. i·stride + 4n] (4 per tap, n <= ksize), inside
            // `wide`, which holds 4·ksize per output pixel; unaligned loads are what
            // read_unaligned / loadu are for.
            let sum = unsafe {
                let p = src.as_ptr().add(from);
                let k = taps.wide.as_ptr().add(i * stride);
                let mut acc = half;
                let mut acc2 = _mm_setzero_si128();
                let mut t = 0;
                while t + 2 <= n {
                    let a = _mm_cvtepu8_epi32(_mm_cvtsi32_si128(
                        (p.add(3 * t) as *const i32).read_unaligned(),
                    ));
                    let b = _mm_cvtepu8_epi32(_mm_cvtsi32_si128(
                        (p.add(3 * t + 3) as *const i32).read_unaligned(),
                    ));
                    let ka = _mm_loadu_si128(k.add(4 * t) as *const __m128i);
                    let kb = _mm_loadu_si128(k.add(4 * t + 4) as *const __m128i);
                    acc = _mm_add_epi32(acc, _mm_mullo_epi32(a, ka));
                    acc2 = _mm_add_epi32(acc2, _mm_mullo_epi32(b, kb));
                    t += 2;
                }
                if t < n {
                    let a = _mm_cvtepu8_epi32(_mm_cvtsi32_si128(
                        (p.add(3 * t) as *const i32).read_unaligned(),
                    ));
                    let ka = _mm_loadu_si128(k.add(4 * t) as *const __m128i);
                    acc = _mm_add_epi32(acc, _mm_mullo_epi32(a, ka));
                }
                _mm_srai_epi32(_mm_add_epi32(acc, acc2), PRECISION_BITS as i32)
            };
            // Saturate to 0..255 (what clip8 does) and keep the low byte of each lane.
            let packed = _mm_packus_epi16(_mm_packs_epi32(sum, sum), _mm_setzero_si128());
            let bytes = (_mm_cvtsi128_si32(packed) as u32).to_le_bytes();
            px.copy_from_slice(&bytes[..3]);
        }
    }

    /// [`horizontal_rgb`] for `K == taps.ksize`: every pixel runs all `K` taps (the weights past
    /// its own `n` are 0, so the sums are the same), which lets the loop unroll.
    ///
    /// # Safety
    /// The CPU must support SSE4.1.
    #[target_feature(enable = "sse4.1")]
    unsafe fn horizontal_fixed<const K: usize>(src: &[u8], x0: usize, taps: &Taps, dst: &mut [u8]) {
        let half = _mm_set1_epi32(1 << (PRECISION_BITS - 1));
        let count = (dst.len() / 3).min(taps.bounds.len());
        debug_assert_eq!(taps.wide.len(), taps.bounds.len() * K * 4);
        for i in 0..count {
            let (start, n) = taps.bounds[i];
            let from = (start as usize - x0) * 3;
            if from + K * 3 + 1 > src.len() {
                // The last pixels of a row: their K taps would read past it.
                let (_, w) = taps.tap(i);
                let mut acc = [1i32 << (PRECISION_BITS - 1); 3];
                let end = (from + n as usize * 3).min(src.len());
                for (p, &k) in src[from..end].chunks_exact(3).zip(w) {
                    for c in 0..3 {
                        acc[c] += i32::from(p[c]) * k;
                    }
                }
                for c in 0..3 {
                    dst[3 * i + c] = clip8(acc[c]);
                }
                continue;
            }
            // SAFETY: the K taps read bytes from .. from + 3K + 1 <= src.len() (checked just
            // above); the weights are wide[4Ki .. 4K(i+1)], inside `wide` (4K per output pixel,
            // i < bounds.len()); unaligned loads are what read_unaligned / loadu are for.
            let sum = unsafe {
                let p = src.as_ptr().add(from);
                let k = taps.wide.as_ptr().add(i * K * 4);
                let mut acc = half;
                for t in 0..K {
                    let a = _mm_cvtepu8_epi32(_mm_cvtsi32_si128(
                        (p.add(3 * t) as *const i32).read_unaligned(),
                    ));
                    let kt = _mm_loadu_si128(k.add(4 * t) as *const __m128i);
                    acc = _mm_add_epi32(acc, _mm_mullo_epi32(a, kt));
                }
                _mm_srai_epi32(acc, PRECISION_BITS as i32)
            };
            let packed = _mm_packus_epi16(_mm_packs_epi32(sum, sum), _mm_setzero_si128());
            let bytes = (_mm_cvtsi128_si32(packed) as u32).to_le_bytes();
            dst[3 * i..3 * i + 3].copy_from_slice(&bytes[..3]);
        }
    }
}

/// `acc[i] += row[i] · k`: one weight for a whole row, a loop the compiler vectorises. x86-64's
/// baseline (SSE2) has no 32-bit multiply, so the same loop is also compiled for AVX2 and
/// SSE4.1 and picked at run time (`pmulld` on 8 or 4 lanes).
fn multiply_add(acc: &mut [i32], row: &[u8], k: i32) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked just above).
            return unsafe { multiply_add_avx2(acc, row, k) };
        }
        if std::arch::is_x86_feature_detected!("sse4.1") {
            // SAFETY: the CPU has SSE4.1 (checked just above).
            return unsafe { multiply_add_sse41(acc, row, k) };
        }
    }
    multiply_add_plain(acc, row, k);
}

#[inline(always)]
fn multiply_add_plain(acc: &mut [i32], row: &[u8], k: i32) {
    for (a, &p) in acc.iter_mut().zip(row) {
        *a += i32::from(p) * k;
    }
}

/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn multiply_add_avx2(acc: &mut [i32], row: &[u8], k: i32) {
    multiply_add_plain(acc, row, k);
}

/// # Safety
/// The CPU must support SSE4.1.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse4.1")]
unsafe fn multiply_add_sse41(acc: &mut [i32], row: &[u8], k: i32) {
    multiply_add_plain(acc, row, k);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_sizes_are_identity() {
        let t = Taps::new(10, 0.0, 10.0, 10, 0, 10);
        assert!(t.identity);
        let src: Vec<u8> = (0..30).collect();
        let mut dst = vec![0u8; 30];
        horizontal_row::<3>(&src, 0, &t, &mut dst);
        assert_eq!(src, dst);
    }

    #[test]
    fn halving_averages_pairs_like_pillow() {
        // Scale 2, support 2: output 0 is centred on 1.0 and has taps x = 0, 1, 2 with
        // triangle weights 0.75, 0.75, 0.25, normalised to 3/7, 3/7, 1/7.
        let t = Taps::new(4, 0.0, 4.0, 2, 0, 2);
        let src = [0u8, 100, 200, 250];
        let mut dst = [0u8; 2];
        horizontal_row::<1>(&src, 0, &t, &mut dst);
        assert_eq!(
            dst[0],
            ((0.0 * 3.0 + 100.0 * 3.0 + 200.0) / 7.0_f64).round() as u8
        );
        assert!(dst[1] > dst[0]);
    }

    #[test]
    fn simd_and_scalar_passes_agree() {
        for (w, out) in [
            (97u32, 41u32),
            (500, 298),
            (1600, 224),
            (30, 224),
            (7, 3),
            (350, 100),
        ] {
            let src: Vec<u8> = (0..w * 3).map(|i| (i * 97 % 256) as u8).collect();
            let taps = Taps::new(w, 0.0, f64::from(w), out, 0, out);
            let mut fast = vec![0u8; out as usize * 3];
            horizontal_row::<3>(&src, 0, &taps, &mut fast);
            let mut slow = vec![0u8; out as usize * 3];
            for (i, px) in slow.chunks_exact_mut(3).enumerate() {
                let (start, wts) = taps.tap(i);
                let mut acc = [1i32 << (PRECISION_BITS - 1); 3];
                for (t, &k) in wts.iter().enumerate() {
                    for c in 0..3 {
                        acc[c] += i32::from(src[(start + t) * 3 + c]) * k;
                    }
                }
                for c in 0..3 {
                    px[c] = clip8(acc[c]);
                }
            }
            assert_eq!(fast, slow, "{w} -> {out}");
        }
    }

    #[test]
    fn a_window_equals_the_same_columns_of_a_full_resize() {
        let (w, out) = (97u32, 41u32);
        let src: Vec<u8> = (0..w * 3).map(|i| (i * 37 % 251) as u8).collect();
        let full = Taps::new(w, 0.0, f64::from(w), out, 0, out);
        let mut all = vec![0u8; out as usize * 3];
        horizontal_row::<3>(&src, 0, &full, &mut all);
        let part = Taps::new(w, 0.0, f64::from(w), out, 7, 20);
        let (lo, _) = part.span();
        let mut some = vec![0u8; 20 * 3];
        horizontal_row::<3>(&src[lo as usize * 3..], lo as usize, &part, &mut some);
        assert_eq!(&all[7 * 3..27 * 3], &some[..]);
    }
}
