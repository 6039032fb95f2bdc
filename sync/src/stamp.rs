//! File identity stamps: what "unchanged" means for a pass, for torn-write detection, and
//! for "the file opened is the file planned" ([`Stamp::same_inode`]).
//!
//! Two files are taken as equal when their sizes and modification times match. Destination
//! filesystems differ in timestamp resolution (ext4/XFS: ns, some NFS/Lustre set-ups: µs or s),
//! so a destination mtime that is the source mtime truncated to µs or to the second also counts
//! as equal; otherwise such a filesystem would make every pass copy everything again.

use std::fs::Metadata;
use std::os::unix::fs::MetadataExt;
use std::time::{Duration, SystemTime};

/// Size, modification time, change time and inode of a file at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp {
    /// Size in bytes.
    pub size: u64,
    /// Modification time, seconds part.
    pub mtime_sec: i64,
    /// Modification time, nanoseconds part.
    pub mtime_nsec: i64,
    /// Status change time, seconds part (changes on every write as well).
    pub ctime_sec: i64,
    /// Status change time, nanoseconds part.
    pub ctime_nsec: i64,
    /// Inode number (a file replaced by rename has a new one).
    pub ino: u64,
    /// Device of the inode.
    pub dev: u64,
    /// Owner.
    pub uid: u32,
    /// Permission bits (`mode & 0o7777`).
    pub mode: u32,
}

impl Stamp {
    /// Takes the stamp of already fetched metadata.
    pub fn of(meta: &Metadata) -> Stamp {
        Stamp {
            size: meta.len(),
            mtime_sec: meta.mtime(),
            mtime_nsec: meta.mtime_nsec(),
            ctime_sec: meta.ctime(),
            ctime_nsec: meta.ctime_nsec(),
            ino: meta.ino(),
            dev: meta.dev(),
            uid: meta.uid(),
            mode: meta.mode() & 0o7777,
        }
    }

    /// Takes the stamp of an `fstatat`/`fstat` result.
    // The stat field types differ between architectures; the casts are no-ops on x86_64 only.
    #[allow(clippy::unnecessary_cast)]
    pub fn from_stat(st: &rustix::fs::Stat) -> Stamp {
        Stamp {
            size: u64::try_from(st.st_size).unwrap_or(0),
            mtime_sec: st.st_mtime as i64,
            mtime_nsec: st.st_mtime_nsec as i64,
            ctime_sec: st.st_ctime as i64,
            ctime_nsec: st.st_ctime_nsec as i64,
            ino: st.st_ino as u64,
            dev: st.st_dev as u64,
            uid: st.st_uid,
            mode: st.st_mode & 0o7777,
        }
    }

    /// Whether `other` is the same inode (same device and inode number).
    pub fn same_inode(&self, other: &Stamp) -> bool {
        self.dev == other.dev && self.ino == other.ino
    }

    /// The mode a copy of this file gets: the permission bits without setuid, setgid and
    /// sticky. A sync run as root creates root-owned files, so copying a user's setuid bit
    /// would hand that user a root-owned setuid program; outputs never need these bits.
    pub fn copy_mode(&self) -> u32 {
        self.mode & 0o777
    }

    /// The modification time as a `SystemTime` (before the epoch is clamped to the epoch).
    pub fn mtime(&self) -> SystemTime {
        let secs = u64::try_from(self.mtime_sec).unwrap_or(0);
        let nanos = u32::try_from(self.mtime_nsec).unwrap_or(0);
        SystemTime::UNIX_EPOCH + Duration::new(secs, nanos)
    }

    /// Whether a destination file with stamp `dst` holds the same version as this source.
    pub fn same_version(&self, dst: &Stamp) -> bool {
        self.size == dst.size
            && self.mtime_sec == dst.mtime_sec
            && (self.mtime_nsec == dst.mtime_nsec
                || dst.mtime_nsec == self.mtime_nsec / 1000 * 1000
                || dst.mtime_nsec == 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stamp(size: u64, sec: i64, nsec: i64) -> Stamp {
        Stamp {
            size,
            mtime_sec: sec,
            mtime_nsec: nsec,
            ctime_sec: 0,
            ctime_nsec: 0,
            ino: 1,
            dev: 1,
            uid: 0,
            mode: 0o644,
        }
    }

    #[test]
    fn coarser_destination_times_count_as_equal() {
        let src = stamp(10, 100, 123_456_789);
        assert!(src.same_version(&stamp(10, 100, 123_456_789)));
        assert!(src.same_version(&stamp(10, 100, 123_456_000)));
        assert!(src.same_version(&stamp(10, 100, 0)));
        assert!(!src.same_version(&stamp(10, 100, 123_456_788)));
        assert!(!src.same_version(&stamp(10, 101, 123_456_789)));
        assert!(!src.same_version(&stamp(11, 100, 123_456_789)));
    }
}
