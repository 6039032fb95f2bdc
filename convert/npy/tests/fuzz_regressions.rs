//! Inputs the fuzzer (`fuzz/`, target `npy_header`) found to crash the `.npy` header parser,
//! each rebuilt in code; every one must be an error, never a panic.

use stagefs_npy::{DType, NpyError, NpyHeader};

/// A version-2.0 header around `dict`.
fn header_v2(dict: &[u8]) -> Vec<u8> {
    let mut v = b"\x93NUMPY\x02\x00".to_vec();
    v.extend_from_slice(&(dict.len() as u32).to_le_bytes());
    v.extend_from_slice(dict);
    v
}

/// `DType::from_descr` split the descr after its first *byte*: a descr starting with a
/// multi-byte character ('ٹ', 2 bytes in UTF-8) panicked ("not a char boundary").
#[test]
fn npy_descr_starting_with_multibyte_char_is_an_error_not_a_panic() {
    assert_eq!(DType::from_descr("ٹf4"), None);
    assert_eq!(DType::from_descr("é"), None);
    assert_eq!(DType::from_descr(""), None);
    assert_eq!(DType::from_descr("<f4"), Some(DType::F32));
    let bytes = header_v2("{'descr': 'ٹf4', 'fortran_order': False, 'shape': (), }\n".as_bytes());
    assert!(matches!(
        NpyHeader::parse(&bytes),
        Err(NpyError::DType(d)) if d == "ٹf4"
    ));
}
