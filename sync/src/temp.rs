//! Temporary names in destination directories, and which leftovers a pass may remove.
//!
//! A temporary is named
//! `.stagefs-tmp.<host>.<boot>-<pidns>.<pid>.<start>.<rand>.<name>`:
//! - `host`: the short host name (first label, only `[A-Za-z0-9_-]`, at most 32 bytes), for
//!   people reading a directory listing;
//! - `boot` (16 hex digits of `/proc/sys/kernel/random/boot_id`) and `pidns` (the inode of
//!   our pid namespace) name the *node*: the one kernel and pid namespace in which `pid`
//!   means something. Another machine, the same machine after a reboot, or a container with
//!   its own pid namespace is another node;
//! - `pid` and `start` (its start time in clock ticks after boot, field 22 of
//!   `/proc/<pid>/stat`): the process, so that a pid reused by a later process is not taken
//!   for the writer;
//! - `rand`: 16 hex digits from the kernel's random generator, so that nobody can predict the
//!   name and pre-create it (the temporary is created with `O_EXCL`, so a planted file would
//!   make the copy fail rather than be written through, but only randomness prevents that);
//! - `name`: the final name, truncated so that the whole stays within `NAME_MAX`.
//!
//! [`judge`] decides whether a temporary found in DST may be removed:
//! - written on this node: stale iff no process with that pid *and* that start time exists
//!   (our own process: iff this process does not hold it open), so a crashed run's leftovers
//!   go at once;
//! - written on another node, whose processes cannot be seen from here: stale only once its
//!   ctime is older than [`STALE_AFTER`]. ctime, not mtime: a copy sets the temporary's mtime
//!   to the source's before renaming it, while ctime moves with every write and attribute
//!   change and cannot be set back. A copy in progress changes it continuously; an hour
//!   without any change means its writer is gone — or stopped (a suspended job): its rename
//!   then fails, that one file is reported and copied again by the next pass, and DST keeps
//!   its complete old version, so nothing already synced is lost;
//! - the names of earlier stagefs versions (`.stagefs-tmp.<pid>.<seq>.<name>`, whose pid says
//!   nothing about the node): by age, like another node's;
//! - anything else, including a user's file that merely starts with `.stagefs-tmp.`, is not a
//!   temporary: never removed, and synced like any other file.
//!
//! Why names and ages rather than a lock or lease: `flock`/`fcntl` locks on HPC file systems
//! are cluster-wide only on some mounts (Lustre without `-o flock` gives node-local locks or
//! none), and a lock that is silently node-local would make node B see node A's live
//! temporary as abandoned — exactly the failure this must prevent. A name and a ctime mean the
//! same thing on every file system.

use std::collections::HashSet;
use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

/// Prefix of every temporary file name stagefs creates.
pub const TEMP_PREFIX: &str = ".stagefs-tmp.";

/// Age (since the last change of its ctime) after which another node's temporary counts as
/// abandoned; see the module note. An hour is far longer than any pause of a live copy (a
/// copy writes continuously, and its final fsync and rename follow its last write within
/// seconds), and leaving a leftover that long only costs its space until a later pass.
pub const STALE_AFTER: Duration = Duration::from_secs(3600);

/// Longest file name most Linux filesystems accept.
const NAME_MAX: usize = 255;

/// Longest host name part.
const HOST_MAX: usize = 32;

/// Who this process is, as written into its temporaries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    /// Short host name.
    pub host: String,
    /// `<boot>-<pidns>`: the node (kernel boot and pid namespace).
    pub node: String,
    /// Process id.
    pub pid: u32,
    /// Process start time (clock ticks after boot).
    pub start: u64,
}

/// The parts of a temporary's name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TempName {
    /// This version's names.
    Current {
        /// `<boot>-<pidns>` of the writer.
        node: String,
        /// Writer's pid.
        pid: u32,
        /// Writer's start time.
        start: u64,
    },
    /// `.stagefs-tmp.<pid>.<seq>.<name>`, from earlier versions.
    Legacy,
}

/// Whether a temporary may be removed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Its writer may still be running: leave it.
    Live,
    /// Left behind by a writer that is gone: remove it.
    Stale,
}

/// This process's identity (computed once).
pub fn me() -> &'static Identity {
    static ME: OnceLock<Identity> = OnceLock::new();
    ME.get_or_init(|| {
        let pid = std::process::id();
        Identity {
            host: short_host(),
            node: node_id(),
            pid,
            start: start_time(pid).unwrap_or(0),
        }
    })
}

fn short_host() -> String {
    let uname = rustix::system::uname();
    let full = uname.nodename().to_bytes();
    let first = full.split(|&b| b == b'.').next().unwrap_or(&[]);
    let host: String = first
        .iter()
        .filter(|b| b.is_ascii_alphanumeric() || **b == b'-' || **b == b'_')
        .take(HOST_MAX)
        .map(|&b| char::from(b))
        .collect();
    if host.is_empty() {
        "_".into()
    } else {
        host
    }
}

/// `<16 hex of the boot id>-<pid namespace inode>`; zeros where /proc cannot tell (such a
/// node's temporaries are then judged by age, as another node's).
fn node_id() -> String {
    let boot: String = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .unwrap_or_default()
        .chars()
        .filter(char::is_ascii_hexdigit)
        .map(|c| c.to_ascii_lowercase())
        .take(16)
        .collect();
    let boot = if boot.len() == 16 {
        boot
    } else {
        "0".repeat(16)
    };
    // The link reads "pid:[4026531836]".
    let ns: u64 = std::fs::read_link("/proc/self/ns/pid")
        .ok()
        .and_then(|l| {
            let s = l.to_string_lossy().into_owned();
            let digits: String = s.chars().filter(char::is_ascii_digit).collect();
            digits.parse().ok()
        })
        .unwrap_or(0);
    format!("{boot}-{ns}")
}

/// Whether this node's identity is known (else its temporaries are judged by age).
fn node_known(node: &str) -> bool {
    !node.starts_with("0000000000000000") && !node.ends_with("-0")
}

/// Start time of process `pid` in clock ticks after boot (field 22 of `/proc/<pid>/stat`).
pub fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may contain anything: count fields
    // after the last ')'. Field 3 is the first one after it, so field 22 is its 20th.
    let close = stat.iter().rposition(|&b| b == b')')?;
    let rest = std::str::from_utf8(&stat[close + 1..]).ok()?;
    rest.split_ascii_whitespace().nth(19)?.parse().ok()
}

/// Temporaries this process holds open now (their names; each name is unique by its random
/// part).
fn held() -> &'static Mutex<HashSet<OsString>> {
    static HELD: OnceLock<Mutex<HashSet<OsString>>> = OnceLock::new();
    HELD.get_or_init(|| Mutex::new(HashSet::new()))
}

/// Marks `name` as held open by this process (until [`release`]).
pub fn hold(name: &OsStr) {
    if let Ok(mut h) = held().lock() {
        h.insert(name.to_os_string());
    }
}

/// Ends [`hold`] for `name` (renamed into place or removed).
pub fn release(name: &OsStr) {
    if let Ok(mut h) = held().lock() {
        h.remove(name);
    }
}

fn random_hex() -> String {
    let mut buf = [0u8; 8];
    if rustix::rand::getrandom(&mut buf, rustix::rand::GetRandomFlags::empty()).is_err() {
        // No getrandom (very old kernel): time and a counter still make names unique, and
        // O_EXCL makes a guessed name a failed copy, never a hijacked one.
        use std::sync::atomic::{AtomicU64, Ordering};
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        buf = (t ^ SEQ.fetch_add(1, Ordering::Relaxed).rotate_left(32)).to_le_bytes();
    }
    buf.iter().map(|b| format!("{b:02x}")).collect()
}

/// A fresh temporary name for a file that will be renamed to `name`.
pub fn temp_name(name: &OsStr) -> OsString {
    temp_name_for(me(), &random_hex(), name)
}

fn temp_name_for(id: &Identity, rand: &str, name: &OsStr) -> OsString {
    let mut out = format!(
        "{TEMP_PREFIX}{}.{}.{}.{}.{rand}.",
        id.host, id.node, id.pid, id.start
    )
    .into_bytes();
    let room = NAME_MAX.saturating_sub(out.len());
    let bytes = name.as_bytes();
    out.extend_from_slice(&bytes[..bytes.len().min(room)]);
    OsString::from_vec(out)
}

fn decimal(b: &[u8]) -> Option<u64> {
    let ok = !b.is_empty() && b.len() <= 20 && b.iter().all(u8::is_ascii_digit);
    ok.then(|| std::str::from_utf8(b).ok()?.parse().ok())
        .flatten()
}

fn hex(b: &[u8], len: usize) -> bool {
    b.len() == len
        && b.iter()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(c))
}

/// Parses `name` as a stagefs temporary; `None` when it does not match one of stagefs's own
/// patterns exactly (then it is a user's file, whatever it starts with).
pub fn parse(name: &OsStr) -> Option<TempName> {
    let rest = name.as_bytes().strip_prefix(TEMP_PREFIX.as_bytes())?;
    let mut parts = rest.splitn(6, |&b| b == b'.');
    let fields: Vec<&[u8]> = parts.by_ref().collect();
    if let [host, node, pid, start, rand, final_name] = fields[..] {
        let host_ok = !host.is_empty()
            && host.len() <= HOST_MAX
            && host
                .iter()
                .all(|b| b.is_ascii_alphanumeric() || *b == b'-' || *b == b'_');
        let node_ok = match node.iter().position(|&b| b == b'-') {
            Some(dash) => hex(&node[..dash], 16) && decimal(&node[dash + 1..]).is_some(),
            None => false,
        };
        let pid = decimal(pid).and_then(|p| u32::try_from(p).ok());
        let start = decimal(start);
        if host_ok && node_ok && hex(rand, 16) && !final_name.is_empty() {
            if let (Some(pid), Some(start)) = (pid, start) {
                return Some(TempName::Current {
                    node: String::from_utf8_lossy(node).into_owned(),
                    pid,
                    start,
                });
            }
        }
    }
    // Earlier versions: `<pid>.<seq>.<name>`.
    let mut old = rest.splitn(3, |&b| b == b'.');
    match (old.next(), old.next(), old.next()) {
        (Some(pid), Some(seq), Some(n))
            if decimal(pid).is_some() && decimal(seq).is_some() && !n.is_empty() =>
        {
            Some(TempName::Legacy)
        }
        _ => None,
    }
}

/// Whether `name` is a stagefs temporary (exact pattern, see [`parse`]).
pub fn is_temp(name: &OsStr) -> bool {
    parse(name).is_some()
}

/// Decides whether the temporary `name` may be removed; `age` is how long ago its ctime last
/// changed (`None` if unknown: then it counts as young).
pub fn judge(name: &OsStr, temp: &TempName, age: Option<Duration>) -> Verdict {
    judge_with(me(), name, temp, age, &|pid, start| {
        process_alive(pid, start)
    })
}

fn judge_with(
    me: &Identity,
    name: &OsStr,
    temp: &TempName,
    age: Option<Duration>,
    alive: &dyn Fn(u32, u64) -> bool,
) -> Verdict {
    let old = age.is_some_and(|a| a >= STALE_AFTER);
    match temp {
        TempName::Current { node, pid, start } if *node == me.node && node_known(node) => {
            let live = if *pid == me.pid && *start == me.start {
                held().lock().map(|h| h.contains(name)).unwrap_or(true)
            } else {
                alive(*pid, *start)
            };
            if live {
                Verdict::Live
            } else {
                Verdict::Stale
            }
        }
        _ if old => Verdict::Stale,
        _ => Verdict::Live,
    }
}

/// Whether a process `pid` that started at `start` is running on this node.
fn process_alive(pid: u32, start: u64) -> bool {
    let Some(p) = i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
    else {
        return false;
    };
    match rustix::process::test_kill_process(p) {
        Ok(()) | Err(rustix::io::Errno::PERM) => {}
        Err(_) => return false,
    }
    // It exists; it is our writer unless its start time says it is a later process with a
    // reused pid. Unreadable (/proc mounted with hidepid): assume it is.
    start_time(pid).is_none_or(|s| s == start)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap (docs/development.md#conventions)
mod tests {
    use super::*;

    fn id(node: &str, pid: u32, start: u64) -> Identity {
        Identity {
            host: "node1".into(),
            node: node.into(),
            pid,
            start,
        }
    }

    const NODE_A: &str = "0123456789abcdef-4026531836";
    const NODE_B: &str = "fedcba9876543210-4026531836";

    #[test]
    fn temp_names_are_recognised_exactly_and_bounded() {
        let long = OsString::from("x".repeat(300));
        let t = temp_name(&long);
        assert!(t.len() <= NAME_MAX);
        assert!(is_temp(&t), "{t:?}");
        let t = temp_name(OsStr::new("model.pt"));
        assert!(t.as_bytes().ends_with(b".model.pt"));
        // Two names for the same file differ (random part).
        assert_ne!(t, temp_name(OsStr::new("model.pt")));
        for user_file in [
            "model.pt",
            ".stagefs-tmp.",
            ".stagefs-tmp.notes",
            ".stagefs-tmp.garbage.txt",
            ".stagefs-tmp.1.2.",
            ".stagefs-tmp.x.0123456789abcdef-1.2.3.0123456789abcdef.",
            ".stagefs-tmp.x.0123456789ABCDEF-1.2.3.0123456789abcdef.f",
            ".stagefs-tmp.x.0123456789abcdef-1.2.3.0123456789abcde.f",
            ".stagefs-tmp.a b.0123456789abcdef-1.2.3.0123456789abcdef.f",
        ] {
            assert_eq!(parse(OsStr::new(user_file)), None, "{user_file}");
        }
        assert_eq!(
            parse(OsStr::new(".stagefs-tmp.99999999.0.old")),
            Some(TempName::Legacy)
        );
        let me = id(NODE_A, 42, 7);
        let t = temp_name_for(&me, "00112233445566ff", OsStr::new("f.bin"));
        assert_eq!(
            parse(&t),
            Some(TempName::Current {
                node: NODE_A.into(),
                pid: 42,
                start: 7
            })
        );
    }

    #[test]
    fn same_node_temporaries_live_while_their_process_does() {
        let me = id(NODE_A, 42, 7);
        let other = TempName::Current {
            node: NODE_A.into(),
            pid: 43,
            start: 9,
        };
        let n = OsStr::new("x");
        let old = Some(STALE_AFTER * 10);
        assert_eq!(judge_with(&me, n, &other, old, &|_, _| true), Verdict::Live);
        assert_eq!(
            judge_with(&me, n, &other, Some(Duration::ZERO), &|_, _| false),
            Verdict::Stale
        );
        // Our own: live only while held.
        let mine = temp_name_for(&me, "00112233445566ff", OsStr::new("f"));
        let parsed = parse(&mine).unwrap();
        assert_eq!(
            judge_with(&me, &mine, &parsed, None, &|_, _| true),
            Verdict::Stale
        );
        hold(&mine);
        assert_eq!(
            judge_with(&me, &mine, &parsed, None, &|_, _| false),
            Verdict::Live
        );
        release(&mine);
    }

    #[test]
    fn other_node_temporaries_live_until_stale_after() {
        let me = id(NODE_A, 42, 7);
        let theirs = TempName::Current {
            node: NODE_B.into(),
            pid: 42,
            start: 7,
        };
        let n = OsStr::new("x");
        // Their pid means nothing here: a dead pid on this node does not make it stale.
        let dead = |_: u32, _: u64| false;
        for age in [None, Some(Duration::ZERO), Some(STALE_AFTER / 2)] {
            assert_eq!(judge_with(&me, n, &theirs, age, &dead), Verdict::Live);
            assert_eq!(
                judge_with(&me, n, &TempName::Legacy, age, &dead),
                Verdict::Live
            );
        }
        assert_eq!(
            judge_with(&me, n, &theirs, Some(STALE_AFTER), &dead),
            Verdict::Stale
        );
        assert_eq!(
            judge_with(&me, n, &TempName::Legacy, Some(STALE_AFTER), &dead),
            Verdict::Stale
        );
    }

    #[test]
    fn start_time_of_this_process_is_read() {
        let s = start_time(std::process::id()).unwrap();
        assert_eq!(me().start, s);
        assert!(process_alive(std::process::id(), s));
        assert!(!process_alive(std::process::id(), s + 1), "reused pid");
    }
}
