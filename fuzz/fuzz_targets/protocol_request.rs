//! The control socket's request decoder (stagefs-protocol), as the daemon runs it on every
//! line a client sends: `parse_request`, the check for lines that need a reply, and the
//! hint-only `parse`. It must never panic, abort, or take more than its bounds: a request it
//! accepts holds only a checked path (re-checked here) and at most `MAX_RANGES` ranges, a
//! non-scope hint names at most `MAX_HINT_BYTES`, and every line over `MAX_LINE` is refused
//! as too long. The line is also split at the first newline and the halves parsed, as the
//! daemon's reader cuts lines.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stagefs_protocol::{
    check_path, is_direct_open, parse, parse_request, Rejected, Request, MAX_HINT_BYTES, MAX_LINE,
    MAX_RANGES,
};

fn check(line: &[u8]) {
    let got = parse_request(line);
    if line.len() > MAX_LINE {
        assert_eq!(got, Err(Rejected::TooLong));
    }
    let _ = is_direct_open(line);
    let _ = parse(line);
    match got {
        Ok(Request::Hint(h)) => {
            assert!(check_path(&h.path).is_ok(), "accepted path {:?}", h.path);
            assert!(h.ranges.len() <= MAX_RANGES);
            if h.scope.is_none() {
                let total = h.ranges.iter().map(|r| r.1).fold(0u64, u64::saturating_add);
                assert!(total <= MAX_HINT_BYTES);
            }
        }
        Ok(Request::DirectOpen(p)) => {
            assert!(check_path(&p).is_ok(), "accepted path {p:?}");
            // The client's encoder writes every path the decoder accepts, and it reads back.
            let enc = stagefs_protocol::direct_open_line(&p).expect("encodes");
            assert_eq!(
                parse_request(enc.trim_end().as_bytes()),
                Ok(Request::DirectOpen(p))
            );
        }
        Ok(Request::DirectClose(_) | Request::DirectTable | Request::StatsNow) | Err(_) => {}
    }
}

fuzz_target!(|data: &[u8]| {
    check(data);
    if let Some(at) = data.iter().position(|&b| b == b'\n') {
        check(&data[..at]);
        check(&data[at + 1..]);
    }
});
