//! The positioned read both table readers make of a source file: [`read_full_at`].
//!
//! `FileExt::read_at` may return fewer bytes than asked for before end of file (a signal, a
//! network file system's short read), and `read_exact_at` fails at end of file, where a
//! reader of an untrusted file wants the bytes that are there. So the read loops until the
//! buffer is full or a read returns 0, retrying `EINTR`. (`stagefs-prefetch` keeps its own
//! copy: the cache depends on no table crate; see `prefetch/src/source.rs`.)

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

/// Reads `buf.len()` bytes of `file` at `offset`, or fewer at end of file; returns how many.
pub fn read_full_at(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}
