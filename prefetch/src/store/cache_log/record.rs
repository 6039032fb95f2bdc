//! The cache log's record format.
//!
//! Framing: `[len: u16][tag: u8][payload][crc32(tag + payload): u32]`, little-endian. A torn or
//! corrupt record ends the replay there (the log is truncated to the last good record): the
//! cache is private and checksummed, so a bad log costs cached blocks, never wrong bytes.

use crate::source::Version;

/// Magic at the start of the log.
pub const MAGIC: &[u8; 12] = b"STAGEFS-IDX\0";
/// Bumped when the record layout changes; a log of another version is discarded.
/// 3: entry records carry the source's ctime (part of [`Version`]).
/// 4: every source file is an exact copy of its own (small ones too, so they can be handed
/// out direct); `Trusted` records keep a verification across mounts.
pub const LOG_VERSION: u32 = 4;
/// Header: magic, version, snapshot id (16 bytes).
pub const HEADER_LEN: usize = 12 + 4 + 16;
/// Longest key accepted (a path beneath the source: Linux's PATH_MAX).
pub const MAX_KEY: usize = 4096;

const TAG_ENTRY: u8 = 1;
const TAG_BLOCK: u8 = 2;
const TAG_DROP_BLOCK: u8 = 3;
const TAG_DROP_ENTRY: u8 = 4;
const TAG_BIND: u8 = 5;
const TAG_TRUSTED: u8 = 6;

/// An entry's id: dense, stable for the life of a mount.
pub type EntryId = u32;

/// What an entry caches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum KeyKind {
    /// A source file's bytes; the key is its path relative to the source root.
    Raw = 1,
    /// A rendered tensor view's bytes; the key is its path under `.npy/`.
    View = 2,
}

/// Where a stored block lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Loc {
    /// Segment number, or [`OWN_FILE`] | the entry's own data file number.
    pub seg: u32,
    /// Offset in 4 KiB units.
    pub off4k: u32,
    /// Length in bytes.
    pub len: u32,
    /// CRC-32 of the bytes.
    pub crc: u32,
}

/// Bit of [`Loc::seg`] marking a block in the entry's own data file (large files, which are
/// kept as exact copies so the kernel can read them through FUSE passthrough).
pub const OWN_FILE: u32 = 1 << 31;

/// An entry's creation: what it caches and for whom (the one record with a key).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EntryRecord<'a> {
    /// Its id.
    pub id: EntryId,
    /// What it caches.
    pub kind: KeyKind,
    /// Blocks kept in an own data file (not packed in segments).
    pub own_file: bool,
    /// The owner's node id when it was made (a hint for rebinding).
    pub owner: u32,
    /// Number of blocks (slots).
    pub slots: u32,
    /// Version of the cached contents.
    pub version: Version,
    /// The key.
    pub key: &'a [u8],
}

/// One decoded record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Record<'a> {
    /// An entry was created.
    Entry(EntryRecord<'a>),
    /// A block was stored.
    Block {
        /// Entry.
        id: EntryId,
        /// Block index.
        slot: u32,
        /// Where.
        loc: Loc,
    },
    /// A block was dropped (evicted or found corrupt).
    DropBlock {
        /// Entry.
        id: EntryId,
        /// Block index.
        slot: u32,
    },
    /// An entry was dropped (its source changed, or nobody owns it any more).
    DropEntry {
        /// Entry.
        id: EntryId,
    },
    /// An entry now belongs to another node id (after a new snapshot).
    Bind {
        /// Entry.
        id: EntryId,
        /// New owner.
        owner: u32,
    },
    /// An entry's copy was verified whole, and this identifies the copy as verified: a later
    /// mount that finds the same inode with the same change time trusts it without reading
    /// it again (any write, truncation, hole punched or replacement changes one of them).
    Trusted {
        /// Entry.
        id: EntryId,
        /// The copy's inode.
        ino: u64,
        /// The copy's change time (ns since the epoch).
        ctime_ns: i64,
    },
}

fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// Appends the encoding of `rec` to `out`; returns the offset in `out` where it starts.
pub fn encode(rec: &Record<'_>, out: &mut Vec<u8>) -> usize {
    let start = out.len();
    out.extend_from_slice(&[0, 0]);
    match rec {
        Record::Entry(EntryRecord {
            id,
            kind,
            own_file,
            owner,
            slots,
            version,
            key,
        }) => {
            out.push(TAG_ENTRY);
            put_u32(out, *id);
            out.push(*kind as u8);
            out.push(u8::from(*own_file));
            put_u32(out, *owner);
            put_u32(out, *slots);
            put_u64(out, version.size);
            put_u64(out, version.mtime_ns as u64);
            put_u64(out, version.ctime_ns as u64);
            put_u64(out, version.ino);
            let key = &key[..key.len().min(MAX_KEY)];
            out.extend_from_slice(&(key.len() as u16).to_le_bytes());
            out.extend_from_slice(key);
        }
        Record::Block { id, slot, loc } => {
            out.push(TAG_BLOCK);
            for v in [*id, *slot, loc.seg, loc.off4k, loc.len, loc.crc] {
                put_u32(out, v);
            }
        }
        Record::DropBlock { id, slot } => {
            out.push(TAG_DROP_BLOCK);
            put_u32(out, *id);
            put_u32(out, *slot);
        }
        Record::DropEntry { id } => {
            out.push(TAG_DROP_ENTRY);
            put_u32(out, *id);
        }
        Record::Bind { id, owner } => {
            out.push(TAG_BIND);
            put_u32(out, *id);
            put_u32(out, *owner);
        }
        Record::Trusted { id, ino, ctime_ns } => {
            out.push(TAG_TRUSTED);
            put_u32(out, *id);
            put_u64(out, *ino);
            put_u64(out, *ctime_ns as u64);
        }
    }
    let body_len = out.len() - start - 2;
    let crc = crc32fast::hash(&out[start + 2..]);
    put_u32(out, crc);
    // Bodies are at most ~4.2 KB (a key of MAX_KEY bytes plus fixed fields).
    out[start..start + 2].copy_from_slice(&(body_len as u16).to_le_bytes());
    start
}

/// Reads little-endian fields from a record body, failing (not panicking) past its end.
struct Reader<'a> {
    b: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.b.len() < n {
            return None;
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Some(h)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }
    fn u16(&mut self) -> Option<u16> {
        self.take(2)?.try_into().ok().map(u16::from_le_bytes)
    }
    fn u32(&mut self) -> Option<u32> {
        self.take(4)?.try_into().ok().map(u32::from_le_bytes)
    }
    fn u64(&mut self) -> Option<u64> {
        self.take(8)?.try_into().ok().map(u64::from_le_bytes)
    }
}

/// Decodes the record at the start of `buf`: the record and its encoded length, or `None` if
/// `buf` does not start with a complete, intact record.
pub fn decode(buf: &[u8]) -> Option<(Record<'_>, usize)> {
    let body_len = usize::from(u16::from_le_bytes(buf.get(..2)?.try_into().ok()?));
    let total = 2 + body_len + 4;
    let body = buf.get(2..2 + body_len)?;
    let crc = u32::from_le_bytes(buf.get(2 + body_len..total)?.try_into().ok()?);
    if crc32fast::hash(body) != crc {
        return None;
    }
    let mut r = Reader { b: body };
    let rec = match r.u8()? {
        TAG_ENTRY => {
            let id = r.u32()?;
            let kind = match r.u8()? {
                1 => KeyKind::Raw,
                2 => KeyKind::View,
                _ => return None,
            };
            let own_file = match r.u8()? {
                0 => false,
                1 => true,
                _ => return None,
            };
            let owner = r.u32()?;
            let slots = r.u32()?;
            let version = Version {
                size: r.u64()?,
                mtime_ns: r.u64()? as i64,
                ctime_ns: r.u64()? as i64,
                ino: r.u64()?,
            };
            let klen = usize::from(r.u16()?);
            if klen > MAX_KEY {
                return None;
            }
            let key = r.take(klen)?;
            Record::Entry(EntryRecord {
                id,
                kind,
                own_file,
                owner,
                slots,
                version,
                key,
            })
        }
        TAG_BLOCK => Record::Block {
            id: r.u32()?,
            slot: r.u32()?,
            loc: Loc {
                seg: r.u32()?,
                off4k: r.u32()?,
                len: r.u32()?,
                crc: r.u32()?,
            },
        },
        TAG_DROP_BLOCK => Record::DropBlock {
            id: r.u32()?,
            slot: r.u32()?,
        },
        TAG_DROP_ENTRY => Record::DropEntry { id: r.u32()? },
        TAG_BIND => Record::Bind {
            id: r.u32()?,
            owner: r.u32()?,
        },
        TAG_TRUSTED => Record::Trusted {
            id: r.u32()?,
            ino: r.u64()?,
            ctime_ns: r.u64()? as i64,
        },
        _ => return None,
    };
    if !r.b.is_empty() {
        return None;
    }
    Some((rec, total))
}

/// The log header for snapshot `snapshot`.
pub fn header(snapshot: u128) -> Vec<u8> {
    let mut h = Vec::with_capacity(HEADER_LEN);
    h.extend_from_slice(MAGIC);
    h.extend_from_slice(&LOG_VERSION.to_le_bytes());
    h.extend_from_slice(&snapshot.to_le_bytes());
    h
}

/// The snapshot id of a log header, or `None` if `buf` is not a log of this version.
pub fn parse_header(buf: &[u8]) -> Option<u128> {
    if buf.get(..12)? != MAGIC {
        return None;
    }
    let v = u32::from_le_bytes(buf.get(12..16)?.try_into().ok()?);
    if v != LOG_VERSION {
        return None;
    }
    Some(u128::from_le_bytes(buf.get(16..32)?.try_into().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples() -> Vec<Record<'static>> {
        vec![
            Record::Entry(EntryRecord {
                id: 7,
                kind: KeyKind::Raw,
                own_file: false,
                owner: 42,
                slots: 3,
                version: Version {
                    size: 3 << 20,
                    mtime_ns: -5,
                    ctime_ns: 1_700_000_000_123_456_789,
                    ino: 99,
                },
                key: b"train/n01/img.jpg",
            }),
            Record::Block {
                id: 7,
                slot: 2,
                loc: Loc {
                    seg: OWN_FILE | 3,
                    off4k: 512,
                    len: 1 << 20,
                    crc: 0xdead_beef,
                },
            },
            Record::DropBlock { id: 7, slot: 2 },
            Record::DropEntry { id: 7 },
            Record::Bind { id: 1, owner: 2 },
            Record::Trusted {
                id: 7,
                ino: 12345,
                ctime_ns: -3,
            },
        ]
    }

    #[test]
    fn records_round_trip_and_any_damage_is_detected() {
        let mut buf = Vec::new();
        for r in samples() {
            encode(&r, &mut buf);
        }
        let mut at = 0;
        for want in samples() {
            let (got, n) = decode(&buf[at..]).unwrap();
            assert_eq!(got, want);
            at += n;
        }
        assert_eq!(at, buf.len());
        // Every single-byte flip and every truncation of the first record is rejected.
        let (_, n) = decode(&buf).unwrap();
        for i in 0..n {
            let mut b = buf[..n].to_vec();
            b[i] ^= 0x40;
            assert!(decode(&b).is_none(), "flip at byte {i} not detected");
            assert!(decode(&buf[..i]).is_none());
        }
    }

    #[test]
    fn header_round_trips() {
        let h = header(0x1234_5678_9abc_def0_1122_3344_5566_7788);
        assert_eq!(h.len(), HEADER_LEN);
        assert_eq!(
            parse_header(&h),
            Some(0x1234_5678_9abc_def0_1122_3344_5566_7788)
        );
        assert_eq!(parse_header(&h[..20]), None);
    }
}
