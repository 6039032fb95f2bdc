//! A Parquet page header, decoded from bytes with no I/O: only the fields that say what
//! decoding the page will allocate (its sizes and value count), everything else skipped.
//!
//! Page headers are Thrift structs in the compact protocol. The parquet crate keeps its own
//! decoder private and allocates a page's buffers straight from the header it reads, so the
//! sizes are read here first, by this small decoder, and checked before the parquet crate sees
//! the page ([`crate::scan_chunk`]).
//!
//! The input is hostile: every length is checked against the bytes present, nesting is limited
//! to [`MAX_DEPTH`] and no allocation is made from anything read.

use thiserror::Error;

/// Deepest nesting of structs, lists and maps skipped inside a header. Real headers nest three
/// deep (header → data page header → statistics); 16 leaves room and stops a recursion bomb.
pub const MAX_DEPTH: u32 = 16;

/// The kinds of page (the `PageType` enum of the Parquet format).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageKind {
    /// A data page (format v1).
    Data,
    /// An index page (unused by writers; skipped by readers).
    Index,
    /// The dictionary page of a column chunk.
    Dictionary,
    /// A data page (format v2).
    DataV2,
    /// A page type this decoder does not know (readers skip it).
    Other(i32),
}

/// What a page header says about the memory decoding its page costs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageHeader {
    /// The kind of page.
    pub kind: PageKind,
    /// Bytes the page claims once decompressed: the buffer a reader allocates for it.
    pub uncompressed: i64,
    /// Bytes of the page in the file, after the header.
    pub compressed: i64,
    /// Values the page claims (data and dictionary pages), when its kind says.
    pub num_values: Option<i64>,
}

/// Why a header could not be decoded.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum HeaderError {
    /// The bytes end inside the header: read more and try again.
    #[error("the page header continues past the bytes read")]
    Incomplete,
    /// The bytes are not a page header.
    #[error("malformed page header: {0}")]
    Malformed(&'static str),
}

/// Decodes the page header at the start of `buf`; returns it and its length in bytes.
pub fn parse(buf: &[u8]) -> Result<(PageHeader, usize), HeaderError> {
    let mut r = Reader { buf, pos: 0 };
    let mut h = PageHeader {
        kind: PageKind::Other(-1),
        uncompressed: -1,
        compressed: -1,
        num_values: None,
    };
    let mut kind = None;
    r.read_struct(0, &mut |r, id, ty| {
        match (id, ty) {
            (1, I32) => kind = Some(r.read_i64()?),
            (2, I32) => h.uncompressed = r.read_i64()?,
            (3, I32) => h.compressed = r.read_i64()?,
            // data_page_header, dictionary_page_header, data_page_header_v2: field 1 of each is
            // num_values.
            (5 | 7 | 8, STRUCT) => {
                let mut n = None;
                r.read_struct(1, &mut |r, id, ty| {
                    match (id, ty) {
                        (1, I32) => n = Some(r.read_i64()?),
                        _ => r.skip(ty, 1)?,
                    }
                    Ok(())
                })?;
                h.num_values = n;
            }
            _ => r.skip(ty, 1)?,
        }
        Ok(())
    })?;
    let kind = kind.ok_or(HeaderError::Malformed("no page type"))?;
    h.kind = match kind {
        0 => PageKind::Data,
        1 => PageKind::Index,
        2 => PageKind::Dictionary,
        3 => PageKind::DataV2,
        k => PageKind::Other(i32::try_from(k).map_err(|_| HeaderError::Malformed("page type"))?),
    };
    if h.uncompressed < 0 || h.compressed < 0 {
        return Err(HeaderError::Malformed("a negative or missing page size"));
    }
    if h.num_values.is_some_and(|n| n < 0) {
        return Err(HeaderError::Malformed("a negative value count"));
    }
    Ok((h, r.pos))
}

// Compact-protocol type ids.
const BOOL_TRUE: u8 = 1;
const BOOL_FALSE: u8 = 2;
const BYTE: u8 = 3;
const I16: u8 = 4;
const I32: u8 = 5;
const I64: u8 = 6;
const DOUBLE: u8 = 7;
const BINARY: u8 = 8;
const LIST: u8 = 9;
const SET: u8 = 10;
const MAP: u8 = 11;
const STRUCT: u8 = 12;

/// Field callback of [`Reader::read_struct`]: the reader, the field id, its type.
type Field<'f, 'b> = dyn FnMut(&mut Reader<'b>, i16, u8) -> Result<(), HeaderError> + 'f;

struct Reader<'b> {
    buf: &'b [u8],
    pos: usize,
}

impl<'b> Reader<'b> {
    fn byte(&mut self) -> Result<u8, HeaderError> {
        let b = *self.buf.get(self.pos).ok_or(HeaderError::Incomplete)?;
        self.pos += 1;
        Ok(b)
    }

    fn advance(&mut self, n: u64) -> Result<(), HeaderError> {
        let left = (self.buf.len() - self.pos) as u64;
        if n > left {
            return Err(HeaderError::Incomplete);
        }
        self.pos += n as usize;
        Ok(())
    }

    fn varint(&mut self) -> Result<u64, HeaderError> {
        let mut v = 0u64;
        for shift in (0..70).step_by(7) {
            let b = self.byte()?;
            v |= u64::from(b & 0x7f).checked_shl(shift).unwrap_or(0);
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(HeaderError::Malformed("a varint of more than 10 bytes"))
    }

    /// A zigzag varint (i16, i32 and i64 alike), widened.
    fn read_i64(&mut self) -> Result<i64, HeaderError> {
        let v = self.varint()?;
        Ok((v >> 1) as i64 ^ -((v & 1) as i64))
    }

    /// Reads a struct's fields, handing each to `field` (which must consume it).
    fn read_struct(&mut self, depth: u32, field: &mut Field<'_, 'b>) -> Result<(), HeaderError> {
        if depth > MAX_DEPTH {
            return Err(HeaderError::Malformed("nested too deep"));
        }
        let mut last: i16 = 0;
        loop {
            let b = self.byte()?;
            if b == 0 {
                return Ok(());
            }
            let (delta, ty) = (b >> 4, b & 0x0f);
            let id = if delta == 0 {
                i16::try_from(self.read_i64()?).map_err(|_| HeaderError::Malformed("field id"))?
            } else {
                last.checked_add(i16::from(delta))
                    .ok_or(HeaderError::Malformed("field id"))?
            };
            last = id;
            field(self, id, ty)?;
        }
    }

    /// Skips one value of type `ty` (a struct field's: booleans carry their value in the type).
    fn skip(&mut self, ty: u8, depth: u32) -> Result<(), HeaderError> {
        if depth > MAX_DEPTH {
            return Err(HeaderError::Malformed("nested too deep"));
        }
        match ty {
            BOOL_TRUE | BOOL_FALSE => Ok(()),
            BYTE => self.advance(1),
            I16 | I32 | I64 => self.varint().map(drop),
            DOUBLE => self.advance(8),
            BINARY => {
                let n = self.varint()?;
                self.advance(n)
            }
            LIST | SET => {
                let b = self.byte()?;
                let elem = b & 0x0f;
                let n = match b >> 4 {
                    15 => self.varint()?,
                    n => u64::from(n),
                };
                self.skip_elements(n, elem, depth)
            }
            MAP => {
                let n = self.varint()?;
                if n == 0 {
                    return Ok(());
                }
                let kv = self.byte()?;
                for _ in 0..n {
                    self.skip_element(kv >> 4, depth)?;
                    self.skip_element(kv & 0x0f, depth)?;
                }
                Ok(())
            }
            STRUCT => self.read_struct(depth + 1, &mut |r, _, ty| r.skip(ty, depth + 1)),
            _ => Err(HeaderError::Malformed("unknown field type")),
        }
    }

    fn skip_elements(&mut self, n: u64, elem: u8, depth: u32) -> Result<(), HeaderError> {
        for _ in 0..n {
            // Every element takes at least one byte: a count beyond the bytes left ends here.
            if self.pos >= self.buf.len() {
                return Err(HeaderError::Incomplete);
            }
            self.skip_element(elem, depth)?;
        }
        Ok(())
    }

    /// Skips a list, set or map element: a boolean element is a byte of its own.
    fn skip_element(&mut self, ty: u8, depth: u32) -> Result<(), HeaderError> {
        match ty {
            BOOL_TRUE | BOOL_FALSE => self.advance(1),
            t => self.skip(t, depth + 1),
        }
    }
}

/// Encodes a page header in the compact protocol (for tests and the fuzzer's seeds: the
/// hostile files they need cannot be made with a writer, which computes sizes honestly).
pub fn encode(h: &PageHeader) -> Vec<u8> {
    fn varint(out: &mut Vec<u8>, mut v: u64) {
        loop {
            let b = (v & 0x7f) as u8;
            v >>= 7;
            if v == 0 {
                out.push(b);
                return;
            }
            out.push(b | 0x80);
        }
    }
    fn zigzag(v: i64) -> u64 {
        ((v << 1) ^ (v >> 63)) as u64
    }
    let mut out = Vec::new();
    let kind = match h.kind {
        PageKind::Data => 0,
        PageKind::Index => 1,
        PageKind::Dictionary => 2,
        PageKind::DataV2 => 3,
        PageKind::Other(k) => i64::from(k),
    };
    // Fields 1, 2 and 3 (type, uncompressed and compressed size): each one past the last.
    for v in [kind, h.uncompressed, h.compressed] {
        out.push(0x10 | I32);
        varint(&mut out, zigzag(v));
    }
    let n = h.num_values.unwrap_or(0);
    match h.kind {
        PageKind::Data => {
            // field 5: DataPageHeader { num_values, encoding RLE_DICTIONARY (8), RLE (3), RLE (3) }
            out.push(0x20 | STRUCT);
            for v in [n, 8, 3, 3] {
                out.push(0x10 | I32);
                varint(&mut out, zigzag(v));
            }
            out.push(0);
        }
        PageKind::Dictionary => {
            // field 7: DictionaryPageHeader { num_values, encoding PLAIN (0) }
            out.push(0x40 | STRUCT);
            for v in [n, 0] {
                out.push(0x10 | I32);
                varint(&mut out, zigzag(v));
            }
            out.push(0);
        }
        PageKind::DataV2 => {
            // field 8: DataPageHeaderV2 { num_values, num_nulls 0, num_rows, encoding
            // RLE_DICTIONARY, def length 0, rep length 0 }
            out.push(0x50 | STRUCT);
            for v in [n, 0, n, 8, 0, 0] {
                out.push(0x10 | I32);
                varint(&mut out, zigzag(v));
            }
            out.push(0);
        }
        PageKind::Index | PageKind::Other(_) => {}
    }
    out.push(0);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(kind: PageKind, u: i64, c: i64, n: Option<i64>) -> PageHeader {
        PageHeader {
            kind,
            uncompressed: u,
            compressed: c,
            num_values: n,
        }
    }

    #[test]
    fn encoded_headers_decode_to_themselves() {
        for h in [
            header(PageKind::Data, 1 << 20, 1000, Some(5)),
            header(PageKind::Dictionary, i64::from(i32::MAX), 20, Some(2)),
            header(PageKind::DataV2, 0, 0, Some(0)),
        ] {
            let bytes = encode(&h);
            assert_eq!(parse(&bytes), Ok((h, bytes.len())));
        }
    }

    #[test]
    fn every_truncation_is_incomplete_never_a_panic() {
        let bytes = encode(&header(PageKind::Data, 1 << 20, 1000, Some(5)));
        for n in 0..bytes.len() {
            assert_eq!(parse(&bytes[..n]), Err(HeaderError::Incomplete), "{n}");
        }
    }

    #[test]
    fn deep_nesting_is_refused() {
        // field 9 (unknown) as a struct holding a struct holding ... (no stop bytes).
        let mut bytes = vec![0x10 | I32, 0];
        bytes.extend(std::iter::repeat_n(0x10 | STRUCT, 100));
        assert_eq!(
            parse(&bytes),
            Err(HeaderError::Malformed("nested too deep"))
        );
    }

    #[test]
    fn a_list_claiming_more_elements_than_bytes_ends_quickly() {
        // field 9: a list of 2^60 i32s in 12 bytes.
        let mut bytes = vec![0x90 | LIST, 0xf0 | I32];
        bytes.extend([0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x0f]);
        assert_eq!(parse(&bytes), Err(HeaderError::Incomplete));
    }
}
