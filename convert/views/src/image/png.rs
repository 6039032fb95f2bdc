//! PNG decoding, row by row, with the `png` crate.
//!
//! A PNG has no reduced-scale decode, but it arrives in rows, and Pillow's resize starts with a
//! horizontal pass row by row: so each row is expanded to 8-bit (palette, low bit depths, 16-bit
//! and alpha handled as Pillow's `convert("RGB")` does), reduced to the crop window's columns at
//! once, and dropped. Memory is one source row plus the S-wide intermediate, whatever the image
//! size — a 16384² bomb holds ~11 MB, not 800. Interlaced (Adam7) images need the whole frame
//! before any row is complete; they are decoded whole (and charged to the budget as such).
//!
//! Strictness: the `png` crate checks every chunk's CRC (Pillow does not check IDAT CRCs) and
//! zlib's stream; every row is read even past the window so damage anywhere is found. Missing
//! IEND and data after it are tolerated, as Pillow does.

use std::io::Cursor;

use png::{ColorType, Transformations};

/// What the header says.
#[derive(Clone, Copy, Debug)]
pub struct Header {
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
    /// Adam7-interlaced.
    pub interlaced: bool,
    /// 1 (gray) or 3 (RGB) channels after conversion.
    pub channels: usize,
}

fn decoder(bytes: &[u8], max_bytes: u64) -> png::Decoder<Cursor<&[u8]>> {
    let mut dec = png::Decoder::new(Cursor::new(bytes));
    dec.set_transformations(Transformations::normalize_to_color8());
    dec.set_ignore_text_chunk(true);
    dec.set_ignore_iccp_chunk(true);
    dec.set_limits(png::Limits {
        bytes: usize::try_from(max_bytes).unwrap_or(usize::MAX),
    });
    dec
}

fn channels(color: ColorType) -> usize {
    match color {
        ColorType::Grayscale | ColorType::GrayscaleAlpha => 1,
        _ => 3,
    }
}

/// Reads the header of `bytes`.
pub fn header(bytes: &[u8]) -> Result<Header, String> {
    let mut dec = decoder(bytes, 1 << 24);
    let info = dec
        .read_header_info()
        .map_err(|e| format!("bad PNG header: {e}"))?;
    Ok(Header {
        width: info.width,
        height: info.height,
        interlaced: info.interlaced,
        channels: channels(info.color_type),
    })
}

/// Converts one expanded 8-bit row (`color` after `normalize_to_color8`) to `ch` channels.
fn convert_row(row: &[u8], color: ColorType, width: usize, out: &mut [u8]) {
    match color {
        ColorType::Grayscale | ColorType::Rgb => out.copy_from_slice(&row[..out.len()]),
        ColorType::GrayscaleAlpha => {
            for (o, px) in out.iter_mut().zip(row.chunks_exact(2)).take(width) {
                *o = px[0];
            }
        }
        // Alpha is dropped, as Pillow's convert("RGB") does; palettes arrive expanded.
        ColorType::Rgba | ColorType::Indexed => {
            for (o, px) in out.chunks_exact_mut(3).zip(row.chunks_exact(4)).take(width) {
                o.copy_from_slice(&px[..3]);
            }
        }
    }
}

/// Decodes `bytes`, calling `row(y, pixels)` for every row in order (`pixels` has
/// `width × channels` bytes). `max_bytes` bounds the decoder's own allocations.
pub fn decode_rows(
    bytes: &[u8],
    max_bytes: u64,
    mut row: impl FnMut(usize, &[u8]),
) -> Result<(), String> {
    let mut reader = decoder(bytes, max_bytes)
        .read_info()
        .map_err(|e| format!("bad PNG header: {e}"))?;
    let (w, h) = reader.info().size();
    let (color, _) = reader.output_color_type();
    let ch = channels(color);
    let width = w as usize;
    let mut converted = Vec::new();
    converted
        .try_reserve_exact(width * ch)
        .map_err(|_| "PNG row too large to allocate")?;
    converted.resize(width * ch, 0);
    if reader.info().interlaced {
        let len = reader.output_buffer_size().ok_or("PNG too large")?;
        let mut frame = Vec::new();
        frame
            .try_reserve_exact(len)
            .map_err(|_| format!("cannot allocate {len} bytes for an interlaced PNG"))?;
        frame.resize(len, 0);
        let info = reader
            .next_frame(&mut frame)
            .map_err(|e| format!("corrupt PNG data: {e}"))?;
        for (y, line) in frame
            .chunks_exact(info.line_size)
            .take(h as usize)
            .enumerate()
        {
            convert_row(line, color, width, &mut converted);
            row(y, &converted);
        }
        return Ok(());
    }
    let mut y = 0usize;
    loop {
        let r = match reader.next_row() {
            Ok(Some(r)) => r,
            Ok(None) => break,
            // Every row is in, and the file ends where the next chunk (IEND) should start:
            // tolerated, as Pillow does. A CRC or zlib error at this point still counts.
            Err(png::DecodingError::IoError(e))
                if y == h as usize && e.kind() == std::io::ErrorKind::UnexpectedEof =>
            {
                break
            }
            Err(e) => return Err(format!("corrupt PNG data: {e}")),
        };
        if y >= h as usize {
            return Err("PNG has more rows than its header says".into());
        }
        convert_row(r.data(), color, width, &mut converted);
        row(y, &converted);
        y += 1;
    }
    if y != h as usize {
        return Err(format!("PNG image data ends after {y} of {h} rows"));
    }
    Ok(())
}
