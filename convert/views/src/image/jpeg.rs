//! JPEG decoding through libjpeg-turbo's TurboJPEG 3 API (`turbojpeg-sys`, built from the
//! libjpeg-turbo source it vendors, so no system library or version matters).
//!
//! Why libjpeg-turbo: it is the decoder Pillow ships, so with the same settings (accurate
//! integer IDCT, fancy upsampling) its pixels are Pillow's pixels, where zune-jpeg differed by up
//! to 12 levels; it decodes at M/8 scale in the DCT domain (fast mode, and huge images); it
//! decodes a cropping region (columns outside it skip IDCT, upsampling and colour conversion,
//! rows above and below are entropy-decoded only); it bounds its own memory (`MAXMEMORY`,
//! `MAXPIXELS`, `SCANLIMIT`); and it reports damage as warnings we can classify.
//!
//! Damage: libjpeg-turbo carries on after corrupt data (grey or garbled blocks) and returns a
//! warning. [`classify_warning`] turns truncation, a missing EOI and corrupt entropy data into
//! errors (the image is bad); warnings that do not touch pixels are tolerated. Only the first
//! warning's text is kept by libjpeg, so that is the one classified.
//!
//! One decompressor handle per thread, reused (creating one allocates libjpeg's state) until a
//! decode fails.

use std::cell::RefCell;
use std::ffi::CStr;

use turbojpeg_sys as tj;

/// Scans allowed in a progressive JPEG: real encoders write ~10; thousands of tiny scans are a
/// known way to make a small file take minutes to decode.
const SCAN_LIMIT: i32 = 500;

/// Colour data a JPEG decodes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pixels {
    /// One channel (grayscale JPEG).
    Gray,
    /// Three channels.
    Rgb,
    /// Four channels, Adobe-inverted CMYK (CMYK and YCCK JPEGs).
    Cmyk,
}

impl Pixels {
    /// Bytes per pixel.
    pub fn channels(self) -> usize {
        match self {
            Pixels::Gray => 1,
            Pixels::Rgb => 3,
            Pixels::Cmyk => 4,
        }
    }

    fn format(self) -> i32 {
        match self {
            Pixels::Gray => tj::TJPF_TJPF_GRAY,
            Pixels::Rgb => tj::TJPF_TJPF_RGB,
            Pixels::Cmyk => tj::TJPF_TJPF_CMYK,
        }
    }
}

/// What the header says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
    /// What the pixels decode to.
    pub pixels: Pixels,
    /// Progressive (or otherwise multi-scan): libjpeg holds every coefficient until the end.
    pub progressive: bool,
    /// TurboJPEG's subsampling code (`TJSAMP_*`, -1 unknown).
    subsamp: i32,
}

impl Header {
    /// Coefficients libjpeg buffers per pixel of a multi-scan image (luma plus subsampled
    /// chroma), 2 bytes each.
    pub fn coefficients_per_pixel(&self) -> f64 {
        let chroma = match self.subsamp {
            tj::TJSAMP_TJSAMP_444 => 2.0,
            tj::TJSAMP_TJSAMP_422 | tj::TJSAMP_TJSAMP_440 => 1.0,
            tj::TJSAMP_TJSAMP_420 | tj::TJSAMP_TJSAMP_411 | tj::TJSAMP_TJSAMP_441 => 0.5,
            tj::TJSAMP_TJSAMP_GRAY => 0.0,
            _ => 3.0, // unknown: assume the worst (4 components, no subsampling)
        };
        1.0 + chroma
    }

    /// Width of an iMCU column after scaling by `m/8`: the left edge of a cropping region must
    /// be a multiple of it (TurboJPEG's `tjMCUWidth`, scaled). None: cropping unsupported.
    pub fn crop_align(&self, m: u32) -> Option<u32> {
        let mcu = match self.subsamp {
            tj::TJSAMP_TJSAMP_444 | tj::TJSAMP_TJSAMP_GRAY | tj::TJSAMP_TJSAMP_440 => 8,
            tj::TJSAMP_TJSAMP_422 | tj::TJSAMP_TJSAMP_420 => 16,
            tj::TJSAMP_TJSAMP_411 => 32,
            tj::TJSAMP_TJSAMP_441 => 8,
            _ => return None,
        };
        Some(scaled(mcu, m))
    }
}

/// `TJSCALED(dim, m/8)`: the size of `dim` pixels decoded at scale `m/8` (rounded up).
pub fn scaled(dim: u32, m: u32) -> u32 {
    ((u64::from(dim) * u64::from(m)).div_ceil(8)) as u32
}

/// A decoding region, in pixels of the scaled image.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    /// Left edge (a multiple of [`Header::crop_align`]).
    pub x: u32,
    /// Top edge.
    pub y: u32,
    /// Width.
    pub w: u32,
    /// Height.
    pub h: u32,
}

/// Limits handed to libjpeg for one decode.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Largest `width × height` accepted from a header.
    pub max_pixels: u64,
    /// Bytes libjpeg may allocate for its own buffers (coefficients of a progressive image).
    pub max_memory: u64,
}

struct Handle(tj::tjhandle);

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: the handle came from tj3Init and is destroyed exactly once, here.
        unsafe { tj::tj3Destroy(self.0) }
    }
}

thread_local! {
    static HANDLE: RefCell<Option<Handle>> = const { RefCell::new(None) };
}

/// Runs `f` with this thread's decompressor.
fn with_handle<T>(f: impl FnOnce(tj::tjhandle) -> Result<T, String>) -> Result<T, String> {
    HANDLE.with(|cell| {
        let mut slot = cell.borrow_mut();
        if slot.is_none() {
            // SAFETY: tj3Init has no preconditions; a null result is handled.
            let h = unsafe { tj::tj3Init(tj::TJINIT_TJINIT_DECOMPRESS as i32) };
            if h.is_null() {
                return Err("cannot initialise the JPEG decoder".into());
            }
            *slot = Some(Handle(h));
        }
        let h = slot.as_ref().map(|h| h.0).ok_or("no JPEG decoder")?;
        let result = f(h);
        if result.is_err() {
            // After an error inside jpeg_read_header TurboJPEG leaves the decompressor mid-
            // header (it does not abort it), and the next file would be parsed as the rest of
            // this one: start the next decode with a fresh handle.
            *slot = None;
        }
        result
    })
}

/// The text of the handle's last error or warning.
fn error_text(h: tj::tjhandle) -> String {
    // SAFETY: tj3GetErrorStr returns a pointer to a NUL-terminated string owned by the library
    // (the handle's or a thread-local buffer), valid until the next call on this thread.
    let ptr = unsafe { tj::tj3GetErrorStr(h) };
    if ptr.is_null() {
        return "unknown error".into();
    }
    // SAFETY: non-null and NUL-terminated, as above; copied out at once.
    unsafe { CStr::from_ptr(ptr) }
        .to_string_lossy()
        .trim()
        .to_string()
}

fn set(h: tj::tjhandle, param: tj::TJPARAM, value: i64) -> Result<(), String> {
    let value = value.clamp(0, i64::from(i32::MAX)) as i32;
    // SAFETY: a valid handle and a parameter id from the bindings.
    if unsafe { tj::tj3Set(h, param as i32, value) } != 0 {
        return Err(format!("JPEG decoder setup: {}", error_text(h)));
    }
    Ok(())
}

fn get(h: tj::tjhandle, param: tj::TJPARAM) -> i32 {
    // SAFETY: a valid handle and a parameter id from the bindings.
    unsafe { tj::tj3Get(h, param as i32) }
}

/// Is a libjpeg warning damage (the image is bad) or harmless?
///
/// Bad: "Premature end of JPEG file" (truncated, or no EOI), "Corrupt JPEG data: bad Huffman
/// code / premature end of data segment / found marker instead of RST" (entropy data damaged:
/// blocks decode as garbage or grey), an inconsistent progression (a damaged progressive scan
/// header) and invalid SOS parameters. Tolerated, as Pillow does: "N extraneous bytes before
/// marker" on its own (junk between segments, typically padding before EOI, with every block
/// decoded), and notes about unknown JFIF revisions, Adobe transforms or ICC data.
pub fn classify_warning(text: &str) -> Result<(), String> {
    let lower = text.to_ascii_lowercase();
    let harmless = lower.contains("extraneous bytes before marker")
        || lower.contains("jfif")
        || lower.contains("adobe")
        || lower.contains("icc");
    if harmless {
        Ok(())
    } else {
        Err(format!("corrupt JPEG data: {text}"))
    }
}

/// Reads the header of `bytes`.
pub fn header(bytes: &[u8]) -> Result<Header, String> {
    with_handle(|h| {
        // SAFETY: the buffer is valid for its length; the library only reads it.
        let rc = unsafe { tj::tj3DecompressHeader(h, bytes.as_ptr(), bytes.len() as _) };
        if rc != 0 {
            // SAFETY: valid handle.
            let code = unsafe { tj::tj3GetErrorCode(h) };
            let text = error_text(h);
            if code != tj::TJERR_TJERR_WARNING as i32 {
                return Err(format!("bad JPEG header: {text}"));
            }
            classify_warning(&text)?;
        }
        let width = get(h, tj::TJPARAM_TJPARAM_JPEGWIDTH);
        let height = get(h, tj::TJPARAM_TJPARAM_JPEGHEIGHT);
        if width < 1 || height < 1 {
            return Err(format!("bad JPEG header: size {width}x{height}"));
        }
        if get(h, tj::TJPARAM_TJPARAM_PRECISION) != 8 || get(h, tj::TJPARAM_TJPARAM_LOSSLESS) != 0 {
            return Err("unsupported JPEG: not 8-bit lossy (12-bit, 16-bit or lossless)".into());
        }
        let pixels = match get(h, tj::TJPARAM_TJPARAM_COLORSPACE) as tj::TJCS {
            tj::TJCS_TJCS_GRAY => Pixels::Gray,
            tj::TJCS_TJCS_CMYK | tj::TJCS_TJCS_YCCK => Pixels::Cmyk,
            _ => Pixels::Rgb,
        };
        Ok(Header {
            width: width as u32,
            height: height as u32,
            pixels,
            progressive: get(h, tj::TJPARAM_TJPARAM_PROGRESSIVE) != 0,
            subsamp: get(h, tj::TJPARAM_TJPARAM_SUBSAMP),
        })
    })
}

/// Decodes `region` of `bytes` at scale `m/8` into `out` (resized to `w·h·channels`),
/// accurate IDCT and fancy upsampling, as Pillow does. A damage warning is an error.
pub fn decode(
    bytes: &[u8],
    head: &Header,
    m: u32,
    region: Region,
    limits: Limits,
    out: &mut Vec<u8>,
) -> Result<(), String> {
    let ch = head.pixels.channels();
    let len = (region.w as usize)
        .checked_mul(region.h as usize)
        .and_then(|n| n.checked_mul(ch))
        .ok_or("JPEG region too large")?;
    out.clear();
    out.try_reserve(len)
        .map_err(|_| format!("cannot allocate {len} bytes for the JPEG decode"))?;
    // SAFETY: capacity was reserved above; the bytes are fully written by tj3Decompress8
    // (pitch × height = len) before they are read, and on failure the buffer is cleared.
    unsafe { out.set_len(len) };
    let result = with_handle(|h| {
        set(h, tj::TJPARAM_TJPARAM_STOPONWARNING, 0)?;
        set(h, tj::TJPARAM_TJPARAM_FASTUPSAMPLE, 0)?;
        set(h, tj::TJPARAM_TJPARAM_FASTDCT, 0)?;
        set(h, tj::TJPARAM_TJPARAM_SCANLIMIT, i64::from(SCAN_LIMIT))?;
        set(h, tj::TJPARAM_TJPARAM_SAVEMARKERS, 0)?;
        set(h, tj::TJPARAM_TJPARAM_MAXPIXELS, limits.max_pixels as i64)?;
        set(
            h,
            tj::TJPARAM_TJPARAM_MAXMEMORY,
            (limits.max_memory >> 20).max(1) as i64,
        )?;
        // The header call sets the size TurboJPEG checks the scaling and region against.
        // SAFETY: the buffer is valid for its length; the library only reads it.
        let rc = unsafe { tj::tj3DecompressHeader(h, bytes.as_ptr(), bytes.len() as _) };
        // SAFETY: valid handle.
        if rc != 0 && unsafe { tj::tj3GetErrorCode(h) } != tj::TJERR_TJERR_WARNING as i32 {
            return Err(format!("bad JPEG header: {}", error_text(h)));
        }
        let g = gcd(m, 8);
        let factor = tj::tjscalingfactor {
            num: (m / g) as i32,
            denom: (8 / g) as i32,
        };
        // SAFETY: valid handle; the factor is one of libjpeg-turbo's M/8 factors.
        if unsafe { tj::tj3SetScalingFactor(h, factor) } != 0 {
            return Err(format!("JPEG scaling {m}/8: {}", error_text(h)));
        }
        let (sw, sh) = (scaled(head.width, m), scaled(head.height, m));
        let whole = region.x == 0 && region.y == 0 && region.w == sw && region.h == sh;
        let crop = if whole {
            tj::tjregion {
                x: 0,
                y: 0,
                w: 0,
                h: 0,
            }
        } else {
            tj::tjregion {
                x: region.x as i32,
                y: region.y as i32,
                w: region.w as i32,
                h: region.h as i32,
            }
        };
        // SAFETY: valid handle; the region was checked against the scaled size by the caller
        // and is checked again by the library.
        if unsafe { tj::tj3SetCroppingRegion(h, crop) } != 0 {
            return Err(format!("JPEG cropping region: {}", error_text(h)));
        }
        let pitch = region.w as usize * ch;
        // SAFETY: `out` holds pitch × region.h bytes, which is what TurboJPEG writes for a
        // region of that size at this pixel format; the input buffer is valid and only read.
        let rc = unsafe {
            tj::tj3Decompress8(
                h,
                bytes.as_ptr(),
                bytes.len() as _,
                out.as_mut_ptr(),
                pitch as i32,
                head.pixels.format(),
            )
        };
        if rc != 0 {
            // SAFETY: valid handle.
            let code = unsafe { tj::tj3GetErrorCode(h) };
            let text = error_text(h);
            if code != tj::TJERR_TJERR_WARNING as i32 {
                return Err(format!("corrupt JPEG: {text}"));
            }
            classify_warning(&text)?;
        }
        Ok(())
    });
    if result.is_err() {
        out.clear();
    }
    result
}

fn gcd(a: u32, b: u32) -> u32 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warnings_that_mean_damage_are_errors() {
        assert!(classify_warning("Premature end of JPEG file").is_err());
        assert!(classify_warning("Corrupt JPEG data: bad Huffman code").is_err());
        assert!(classify_warning("Corrupt JPEG data: premature end of data segment").is_err());
        assert!(
            classify_warning("Corrupt JPEG data: 12 extraneous bytes before marker 0xd9").is_ok()
        );
        assert!(classify_warning("Warning: unknown JFIF revision number 3.01").is_ok());
    }

    #[test]
    fn scaled_rounds_up_like_tjscaled() {
        assert_eq!(scaled(375, 5), 235);
        assert_eq!(scaled(500, 8), 500);
        assert_eq!(scaled(1, 1), 1);
        assert_eq!(scaled(16383, 1), 2048);
    }
}
