//! NumPy `.npy` format 1.0 headers: writing them for views, parsing them for the GPU streamer.
//!
//! A header is the magic `\x93NUMPY`, version `1.0`, a little-endian `u16` header length and a
//! Python dict literal, padded with spaces and a final `\n` so that the data starts on a multiple
//! of [`ALIGN`] bytes — numpy's own alignment, which lets `np.load(mmap_mode="r")` map the data
//! with aligned element access. Only little-endian, C-order arrays of fixed-size numeric types
//! are produced or accepted: that is all the views ever write.

use thiserror::Error;

/// Data starts at a multiple of this many bytes (numpy's `ARRAY_ALIGN`).
pub const ALIGN: usize = 64;

/// The six magic bytes every `.npy` file starts with.
pub const MAGIC: &[u8; 6] = b"\x93NUMPY";

/// The longest header this module accepts when parsing; format 1.0 stores its length in a `u16`.
pub const MAX_HEADER_LEN: usize = 10 + u16::MAX as usize;

/// An element type of a `.npy` array.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// `|b1`: one byte, 0 or 1.
    Bool,
    /// `|i1`
    I8,
    /// `<i2`
    I16,
    /// `<i4`
    I32,
    /// `<i8`
    I64,
    /// `|u1`
    U8,
    /// `<u2`
    U16,
    /// `<u4`
    U32,
    /// `<u8`
    U64,
    /// `<f2`
    F16,
    /// `<f4`
    F32,
    /// `<f8`
    F64,
}

impl DType {
    /// The numpy type string (`descr`), e.g. `<f4`.
    pub fn descr(self) -> &'static str {
        match self {
            DType::Bool => "|b1",
            DType::I8 => "|i1",
            DType::I16 => "<i2",
            DType::I32 => "<i4",
            DType::I64 => "<i8",
            DType::U8 => "|u1",
            DType::U16 => "<u2",
            DType::U32 => "<u4",
            DType::U64 => "<u8",
            DType::F16 => "<f2",
            DType::F32 => "<f4",
            DType::F64 => "<f8",
        }
    }

    /// The numpy dtype name, e.g. `float32` (as `str(arr.dtype)` prints it).
    pub fn name(self) -> &'static str {
        match self {
            DType::Bool => "bool",
            DType::I8 => "int8",
            DType::I16 => "int16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::U8 => "uint8",
            DType::U16 => "uint16",
            DType::U32 => "uint32",
            DType::U64 => "uint64",
            DType::F16 => "float16",
            DType::F32 => "float32",
            DType::F64 => "float64",
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::Bool | DType::I8 | DType::U8 => 1,
            DType::I16 | DType::U16 | DType::F16 => 2,
            DType::I32 | DType::U32 | DType::F32 => 4,
            DType::I64 | DType::U64 | DType::F64 => 8,
        }
    }

    /// Parses a numpy type string; `=` and `<` are both little-endian here (x86-64, aarch64).
    pub fn from_descr(descr: &str) -> Option<DType> {
        // strip_prefix, not split_at(1): the first character may be several bytes long.
        let code = descr.strip_prefix(['<', '|', '='])?;
        Some(match code {
            "b1" => DType::Bool,
            "i1" => DType::I8,
            "i2" => DType::I16,
            "i4" => DType::I32,
            "i8" => DType::I64,
            "u1" => DType::U8,
            "u2" => DType::U16,
            "u4" => DType::U32,
            "u8" => DType::U64,
            "f2" => DType::F16,
            "f4" => DType::F32,
            "f8" => DType::F64,
            _ => return None,
        })
    }
}

/// Why a byte string is not a `.npy` header this module understands.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum NpyError {
    /// The first bytes are not `\x93NUMPY`.
    #[error("not a .npy file (bad magic bytes)")]
    BadMagic,
    /// Fewer bytes than the header claims.
    #[error("truncated .npy header: need {need} bytes, have {have}")]
    Truncated {
        /// Bytes the header needs.
        need: usize,
        /// Bytes available.
        have: usize,
    },
    /// A format version other than 1.0, 2.0 or 3.0.
    #[error("unsupported .npy format version {0}.{1}")]
    Version(u8, u8),
    /// The dict literal could not be read.
    #[error("malformed .npy header: {0}")]
    Malformed(String),
    /// A dtype other than little-endian fixed-size numbers.
    #[error("unsupported .npy dtype {0:?} (only little-endian bool/int/uint/float)")]
    DType(String),
    /// `fortran_order: True`.
    #[error("Fortran-order .npy arrays are not supported")]
    FortranOrder,
    /// The shape's byte count does not fit in 64 bits (a hostile or corrupt header).
    #[error("shape {0:?} is too large: its byte count overflows 64 bits")]
    TooLarge(Vec<u64>),
}

/// The header of a `.npy` file: element type and shape (C order, little-endian).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NpyHeader {
    /// Element type.
    pub dtype: DType,
    /// Dimensions, outermost first.
    pub shape: Vec<u64>,
}

impl NpyHeader {
    /// A header for `dtype` with `shape`.
    pub fn new(dtype: DType, shape: Vec<u64>) -> Self {
        NpyHeader { dtype, shape }
    }

    /// Number of elements (1 for a 0-d array); `None` if it overflows `u64`.
    pub fn checked_elements(&self) -> Option<u64> {
        checked_product(&self.shape, 1)
    }

    /// Bytes in one row (one index of the first axis; the element size for a 0-d array);
    /// `None` if it overflows `u64`.
    pub fn checked_row_bytes(&self) -> Option<u64> {
        checked_product(self.shape.get(1..).unwrap_or(&[]), self.dtype.size() as u64)
    }

    /// Bytes of array data after the header; `None` if it overflows `u64`.
    pub fn checked_data_len(&self) -> Option<u64> {
        self.checked_elements()?
            .checked_mul(self.dtype.size() as u64)
    }

    /// Number of elements (1 for a 0-d array), saturating at `u64::MAX`.
    ///
    /// Saturating, not wrapping: a wrapped product can be 0, which would make a hostile
    /// header look like an empty array. [`NpyHeader::parse`] refuses such shapes anyway.
    pub fn elements(&self) -> u64 {
        self.checked_elements().unwrap_or(u64::MAX)
    }

    /// Bytes in one row, saturating at `u64::MAX` (see [`NpyHeader::elements`]).
    pub fn row_bytes(&self) -> u64 {
        self.checked_row_bytes().unwrap_or(u64::MAX)
    }

    /// Bytes of array data after the header, saturating at `u64::MAX`.
    pub fn data_len(&self) -> u64 {
        self.checked_data_len().unwrap_or(u64::MAX)
    }

    /// The encoded header, padded so its length is a multiple of [`ALIGN`].
    pub fn encode(&self) -> Vec<u8> {
        let shape = match self.shape.len() {
            1 => format!("({},)", self.shape[0]),
            _ => {
                let dims: Vec<String> = self.shape.iter().map(u64::to_string).collect();
                format!("({})", dims.join(", "))
            }
        };
        let dict = format!(
            "{{'descr': '{}', 'fortran_order': False, 'shape': {}, }}",
            self.dtype.descr(),
            shape
        );
        // magic(6) + version(2) + length(2) + dict + padding + '\n'
        let unpadded = 10 + dict.len() + 1;
        let total = unpadded.div_ceil(ALIGN) * ALIGN;
        let header_len = total - 10;
        let mut out = Vec::with_capacity(total);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&[1, 0]);
        // A dict for up to 32 dimensions fits easily; u16 overflow would need a ~65 KB shape.
        out.extend_from_slice(&(header_len as u16).to_le_bytes());
        out.extend_from_slice(dict.as_bytes());
        out.resize(total - 1, b' ');
        out.push(b'\n');
        out
    }

    /// Length of [`encode`](Self::encode)'s output, i.e. the offset of the data.
    pub fn encoded_len(&self) -> u64 {
        self.encode().len() as u64
    }

    /// Total file size: header plus data, saturating at `u64::MAX`.
    pub fn file_len(&self) -> u64 {
        self.encoded_len().saturating_add(self.data_len())
    }

    /// Parses the start of a `.npy` file; returns the header and the offset where data starts.
    pub fn parse(bytes: &[u8]) -> Result<(NpyHeader, usize), NpyError> {
        if bytes.len() < 10 {
            if bytes.len() >= 6 && &bytes[..6] != MAGIC {
                return Err(NpyError::BadMagic);
            }
            return Err(NpyError::Truncated {
                need: 10,
                have: bytes.len(),
            });
        }
        if &bytes[..6] != MAGIC {
            return Err(NpyError::BadMagic);
        }
        let (len, start) = match (bytes[6], bytes[7]) {
            (1, 0) => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
            (2 | 3, 0) => {
                if bytes.len() < 12 {
                    return Err(NpyError::Truncated {
                        need: 12,
                        have: bytes.len(),
                    });
                }
                let len = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]);
                (len as usize, 12)
            }
            (major, minor) => return Err(NpyError::Version(major, minor)),
        };
        let end = start + len;
        if bytes.len() < end {
            return Err(NpyError::Truncated {
                need: end,
                have: bytes.len(),
            });
        }
        let text = std::str::from_utf8(&bytes[start..end])
            .map_err(|_| NpyError::Malformed("header is not UTF-8".into()))?;
        let descr = dict_value(text, "descr")?;
        let descr = descr.trim_matches(|c| c == '\'' || c == '"');
        let dtype = DType::from_descr(descr).ok_or_else(|| NpyError::DType(descr.to_string()))?;
        match dict_value(text, "fortran_order")? {
            "False" => {}
            "True" => return Err(NpyError::FortranOrder),
            other => return Err(NpyError::Malformed(format!("fortran_order is {other:?}"))),
        }
        let shape_text = dict_value(text, "shape")?;
        let inner = shape_text
            .strip_prefix('(')
            .and_then(|s| s.strip_suffix(')'))
            .ok_or_else(|| NpyError::Malformed(format!("shape is {shape_text:?}")))?;
        let mut shape = Vec::new();
        for dim in inner.split(',').map(str::trim).filter(|d| !d.is_empty()) {
            let dim = dim.trim_end_matches('L');
            shape.push(
                dim.parse::<u64>()
                    .map_err(|_| NpyError::Malformed(format!("shape dimension {dim:?}")))?,
            );
        }
        let header = NpyHeader { dtype, shape };
        // Every size a reader derives from the header (elements, row bytes, data bytes, and the
        // file end) must fit in 64 bits; a product that wrapped could read as 0.
        let fits = header
            .checked_data_len()
            .and_then(|n| n.checked_add(end as u64))
            .is_some();
        if !fits {
            return Err(NpyError::TooLarge(header.shape));
        }
        Ok((header, end))
    }
}

/// `start` times every dimension; 0 if any dimension is 0 (however large the others), `None`
/// if the product overflows `u64`.
fn checked_product(dims: &[u64], start: u64) -> Option<u64> {
    if dims.contains(&0) {
        return Some(0);
    }
    dims.iter().try_fold(start, |n, &d| n.checked_mul(d))
}

/// The raw text of `key`'s value in a Python dict literal (a tuple value stays parenthesised).
fn dict_value<'a>(text: &'a str, key: &str) -> Result<&'a str, NpyError> {
    let missing = || NpyError::Malformed(format!("no {key:?} key"));
    let pos = text
        .find(&format!("'{key}'"))
        .or_else(|| text.find(&format!("\"{key}\"")))
        .ok_or_else(missing)?;
    let rest = &text[pos + key.len() + 2..];
    let rest = rest
        .trim_start()
        .strip_prefix(':')
        .ok_or_else(missing)?
        .trim_start();
    let end = if rest.starts_with('(') {
        rest.find(')').map(|i| i + 1)
    } else {
        rest.find([',', '}'])
    }
    .ok_or_else(|| NpyError::Malformed(format!("unterminated value of {key:?}")))?;
    Ok(rest[..end].trim())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_is_aligned_and_round_trips() {
        for shape in [
            vec![],
            vec![0],
            vec![7],
            vec![3, 224, 224, 3],
            vec![1 << 40, 2],
        ] {
            for dtype in [DType::Bool, DType::U8, DType::I64, DType::F32, DType::F64] {
                let h = NpyHeader::new(dtype, shape.clone());
                let bytes = h.encode();
                assert_eq!(bytes.len() % ALIGN, 0);
                assert_eq!(*bytes.last().unwrap(), b'\n');
                let (parsed, off) = NpyHeader::parse(&bytes).unwrap();
                assert_eq!(parsed, h);
                assert_eq!(off, bytes.len());
            }
        }
    }

    #[test]
    fn npy_shape_product_wrapping_to_0_is_refused() {
        // 2^32 × 2^32 one-byte elements: the product is 2^64, which wraps to 0 in u64.
        for (dtype, shape) in [
            (DType::U8, vec![1 << 32, 1 << 32]),
            (DType::F32, vec![1 << 62, 1, 1]),
            (DType::U8, vec![3, 1 << 63, 2]),
            // Fits in u64 alone, but not once the header's length is added.
            (DType::U8, vec![u64::MAX]),
        ] {
            let bytes = NpyHeader::new(dtype, shape.clone()).encode();
            assert_eq!(
                NpyHeader::parse(&bytes),
                Err(NpyError::TooLarge(shape.clone()))
            );
            let h = NpyHeader::new(dtype, shape);
            assert_ne!(h.data_len(), 0, "a size must never wrap to 0");
        }
        // A zero dimension anywhere is a real empty array, not an overflow.
        let h = NpyHeader::new(DType::U8, vec![1 << 40, 1 << 40, 0]);
        assert_eq!(
            NpyHeader::parse(&h.encode()).map(|(h, _)| h.data_len()),
            Ok(0)
        );
        assert_eq!(h.checked_row_bytes(), Some(0));
    }

    #[test]
    fn one_dimensional_shape_has_trailing_comma() {
        let h = NpyHeader::new(DType::F32, vec![5]);
        let text = String::from_utf8_lossy(&h.encode()).into_owned();
        assert!(text.contains("'shape': (5,), }"), "{text}");
    }

    #[test]
    fn rejects_bad_input() {
        assert_eq!(
            NpyHeader::parse(b"\x93NUMPX\x01\x00\x00\x00"),
            Err(NpyError::BadMagic)
        );
        let mut h = NpyHeader::new(DType::F32, vec![2]).encode();
        h.truncate(20);
        assert!(matches!(
            NpyHeader::parse(&h),
            Err(NpyError::Truncated { .. })
        ));
        let big =
            b"\x93NUMPY\x01\x00\x20\x00{'descr': '>f4', 'fortran_order': False, 'shape': (1,), }";
        assert!(matches!(
            NpyHeader::parse(big),
            Err(NpyError::Truncated { .. }) | Err(NpyError::DType(_))
        ));
    }
}
