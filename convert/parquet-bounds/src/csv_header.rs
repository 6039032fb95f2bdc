//! Counting a CSV header's fields before anything is built per field: the CSV counterpart of
//! the page checks, shared by the table views and the cleaning job.
//!
//! A table of a million columns costs a decoder builder, a schema field and inference state
//! per column; a hostile header of 64 MiB of commas would make each of them first. So both
//! callers count the header's fields with [`HeaderFields`], a byte scanner that keeps only
//! a counter and the quote state (a comma or newline inside quotes does not count), fed the
//! file's first bytes in whatever pieces the caller reads, and stopping as soon as the count
//! passes the caller's limit. The caller owns the I/O and its own bound on bytes read.

/// The scan of a CSV's first record: fields counted so far, quote-aware.
#[derive(Clone, Copy, Debug)]
pub struct HeaderFields {
    fields: usize,
    in_quotes: bool,
    limit: usize,
}

impl HeaderFields {
    /// A scan that stops once more than `limit` fields are counted.
    pub fn new(limit: usize) -> HeaderFields {
        HeaderFields {
            fields: 1,
            in_quotes: false,
            limit,
        }
    }

    /// Scans the next bytes of the file: `Some(count)` once the header's newline (outside
    /// quotes) is reached or the count passes the limit (then `limit + 1`), `None` while the
    /// header goes on past `bytes`.
    pub fn feed(&mut self, bytes: &[u8]) -> Option<usize> {
        for &b in bytes {
            match b {
                b'"' => self.in_quotes = !self.in_quotes,
                b',' if !self.in_quotes => {
                    self.fields += 1;
                    if self.fields > self.limit {
                        return Some(self.fields);
                    }
                }
                b'\n' if !self.in_quotes => return Some(self.fields),
                _ => {}
            }
        }
        None
    }

    /// The fields counted so far: the count of a header that ends at end of file, or where
    /// the caller stopped reading.
    pub fn fields(&self) -> usize {
        self.fields
    }
}

#[cfg(test)]
mod tests {
    use super::HeaderFields;

    #[test]
    fn quoted_commas_and_newlines_do_not_count_and_pieces_do_not_matter() {
        let header = b"a,\"b,c\",\"d\ne\",f\n1,2,3,4\n";
        for cut in 0..header.len() {
            let mut scan = HeaderFields::new(100);
            let got = scan
                .feed(&header[..cut])
                .or_else(|| scan.feed(&header[cut..]));
            assert_eq!(got, Some(4), "cut at {cut}");
        }
    }

    #[test]
    fn stops_past_the_limit_and_counts_a_header_without_newline() {
        assert_eq!(HeaderFields::new(3).feed(b"a,b,c,d,e,f"), Some(4));
        let mut scan = HeaderFields::new(10);
        assert_eq!(scan.feed(b"a,b"), None);
        assert_eq!(scan.fields(), 2);
    }
}
