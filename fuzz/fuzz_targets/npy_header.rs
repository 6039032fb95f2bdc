//! The `.npy` header parser (stagefs-npy), as `stream` and the Python side meet it: any bytes,
//! then (for a parsed header of sane rank) a re-encode that must parse back to the same header.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stagefs_fuzz::count_only_escaping_panics;
use stagefs_npy::NpyHeader;

fuzz_target!(init: count_only_escaping_panics(), |data: &[u8]| {
    if let Ok((header, offset)) = NpyHeader::parse(data) {
        assert!(offset <= data.len(), "data offset {offset} past the input");
        // NumPy allows 64 dimensions; the encoder's u16 length field is sized for that.
        if header.shape.len() <= 64 {
            let bytes = header.encode();
            let (again, end) = NpyHeader::parse(&bytes).expect("own encoding must parse");
            assert_eq!(again, header);
            assert_eq!(end, bytes.len());
        }
    }
});
