//! Which descriptors of the process are direct ones, and what each needs at `fstat`, `close`,
//! `dup` and `mmap`: one word per descriptor number in a static array, read and written with
//! atomics, so these calls take no lock and allocate nothing (a signal handler may close a
//! descriptor; another thread may close one while this one opens).
//!
//! A record is set right after the open that made the descriptor returns (the kernel gives a
//! number to one open at a time) and taken before the `close` that ends it, so a number reused
//! by the next open never inherits a stale record. Numbers past [`TRACKED_FDS`] are served
//! like the rest but not tracked: their `fstat` shows the copy's own metadata and a granted
//! one's pin is released with the connection (at process exit), not at `close`.

use std::sync::atomic::{AtomicU64, Ordering};

/// Descriptors tracked: 65536, far above the default limit of 1024 (1 MiB of zero pages until
/// used).
pub const TRACKED_FDS: usize = 1 << 16;

static INFO: [AtomicU64; TRACKED_FDS] = [const { AtomicU64::new(0) }; TRACKED_FDS];
static PIN: [AtomicU64; TRACKED_FDS] = [const { AtomicU64::new(0) }; TRACKED_FDS];

/// How a direct descriptor came to be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A small copy the process opened itself through the direct table: no pin.
    Table = 1,
    /// A descriptor the daemon granted over the socket (pinned if its pin is not 0).
    Granted = 2,
    /// A duplicate of a direct descriptor: same file, the original's pin is kept for it.
    Dup = 3,
}

/// What is known of one direct descriptor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Info {
    /// How it came to be.
    pub kind: Kind,
    /// Duplicated or mapped: its pin is held until the process ends, not released at close.
    pub kept: bool,
    /// Index of its mount.
    pub mount: u8,
    /// The process that opened it (a forked child's inherited descriptor is its parent's:
    /// the child never releases its pin).
    pub pid: u32,
    /// Its slot in the mount's direct table (what its `fstat` shows), if listed.
    pub slot: Option<u32>,
}

const NO_SLOT: u64 = 0xffff_ffff;

impl Info {
    fn encode(self) -> u64 {
        let slot = self.slot.map_or(NO_SLOT, u64::from);
        (self.kind as u64)
            | (u64::from(self.kept) << 2)
            | (u64::from(self.mount & 0x1f) << 3)
            | (u64::from(self.pid & 0x3f_ffff) << 8)
            | (slot << 30)
    }

    fn decode(w: u64) -> Option<Info> {
        let kind = match w & 3 {
            1 => Kind::Table,
            2 => Kind::Granted,
            3 => Kind::Dup,
            _ => return None,
        };
        let slot = (w >> 30) & 0xffff_ffff;
        Some(Info {
            kind,
            kept: w & 4 != 0,
            mount: ((w >> 3) & 0x1f) as u8,
            pid: ((w >> 8) & 0x3f_ffff) as u32,
            slot: (slot != NO_SLOT).then_some(slot as u32),
        })
    }
}

fn index(fd: i32) -> Option<usize> {
    usize::try_from(fd).ok().filter(|&f| f < TRACKED_FDS)
}

/// Records direct descriptor `fd` and its pin (0: none).
pub fn set(fd: i32, info: Info, pin: u64) {
    if let Some(i) = index(fd) {
        PIN[i].store(pin, Ordering::Relaxed);
        INFO[i].store(info.encode(), Ordering::Release);
    }
}

/// The record of `fd`, if it is a direct descriptor.
pub fn get(fd: i32) -> Option<Info> {
    let i = index(fd)?;
    Info::decode(INFO[i].load(Ordering::Acquire))
}

/// Whether `fd` is a direct descriptor: one load, for `close` of any descriptor.
pub fn tracked(fd: i32) -> bool {
    index(fd).is_some_and(|i| INFO[i].load(Ordering::Relaxed) != 0)
}

/// Takes the record of `fd` (before it is closed): the record and its pin.
pub fn take(fd: i32) -> Option<(Info, u64)> {
    let i = index(fd)?;
    let info = Info::decode(INFO[i].swap(0, Ordering::AcqRel))?;
    Some((info, PIN[i].swap(0, Ordering::Relaxed)))
}

/// Marks `fd` as read beyond its own life (duplicated, mapped): its pin is kept.
pub fn keep(fd: i32) {
    if let Some(i) = index(fd) {
        let _ = INFO[i].fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
            (w != 0).then_some(w | 4)
        });
    }
}

/// Records `new` as a duplicate of direct descriptor `old` (same file and path; no pin of its
/// own), and keeps `old`'s pin.
pub fn duplicate(old: i32, new: i32) {
    let Some(info) = get(old) else { return };
    keep(old);
    set(
        new,
        Info {
            kind: Kind::Dup,
            kept: true,
            ..info
        },
        0,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_numbers_out_of_range_are_not_tracked() {
        for slot in [None, Some(0), Some(u32::MAX - 1)] {
            let info = Info {
                kind: Kind::Granted,
                kept: false,
                mount: 15,
                pid: 4_194_303,
                slot,
            };
            set(7, info, 99);
            assert_eq!(get(7), Some(info));
            assert_eq!(take(7), Some((info, 99)));
            assert_eq!(get(7), None);
        }
        set(
            TRACKED_FDS as i32,
            Info {
                kind: Kind::Table,
                kept: false,
                mount: 0,
                pid: 1,
                slot: None,
            },
            0,
        );
        assert!(!tracked(TRACKED_FDS as i32));
        assert!(!tracked(-1));
    }
}
