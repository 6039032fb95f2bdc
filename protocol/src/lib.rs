//! The control socket of a stagefs mount, as the daemon (`stagefs-fs`) and its clients
//! (`stagefs.Loader`'s hints, the direct-read preload library) speak it: message formats,
//! bounds (defined here once) and descriptor passing.
//!
//! **Channel.** A Unix stream socket, [`SOCKET_NAME`] in the mount's cache directory. That
//! directory is 0700 and owned by the user who mounted, so only they can connect; the socket is
//! 0600 as well. A path too long for a socket address ([`MAX_ADDR`]) is reached through
//! `/proc/self/fd/N/hints.sock` with `N` a descriptor of the directory ([`connect`]).
//!
//! **Requests**, one JSON object per line, at most [`MAX_LINE`] bytes:
//! - a read-order hint, no reply: `{"path": REL, "ranges": [[offset, len], ...]}` (an `"op":
//!   "hint"` field is allowed); at most [`MAX_RANGES`] ranges naming at most
//!   [`MAX_HINT_BYTES`] bytes. With `"scope": GENERATION` (an integer) the ranges are not bytes
//!   to fetch now but this node's declared part of the file (a node-partitioned loader's rows
//!   for an epoch): the mount stages that and keeps its speculation inside it, a newer
//!   generation replacing an older one's ranges; the byte bound does not apply to such lines;
//! - `{"op": "direct_open", "path": REL}`: asks for a read-only descriptor of the cache's
//!   verified, exact copy of `REL` (relative to the mount root). Exactly one reply line;
//! - `{"op": "direct_close", "pin": N}`: the client closed the descriptor of grant `N`; no
//!   reply;
//! - `{"op": "direct_table"}`: the direct table's descriptors ([`table`]). Exactly one reply
//!   line;
//! - `{"op": "stats_now"}`: the mount's counters rendered now (not the stats file's rendering,
//!   which is kept up to a second while it is read), as one compact JSON object on one line of
//!   at most [`MAX_STATS_REPLY`] bytes, no descriptor: what a test or a monitor waits on
//!   instead of sleeping until the stats file is rendered again. Exactly one reply line.
//!
//! `REL` is a plain relative path: no root, no `.` or `..`, no empty component, no NUL, at
//! most [`MAX_PATH`] bytes ([`check_path`]).
//!
//! **Replies** (to `direct_open` only), one JSON line of at most [`MAX_REPLY`] bytes:
//! `{"pin": N, "size": BYTES, "mtime_ns": NS}` with the descriptor attached to it as
//! `SCM_RIGHTS` (size and mtime are the source's, as in the mount's snapshot), or
//! `{"refused": CODE}` with a [`Refusal`] code and no descriptor. The client checks what it
//! got ([`DirectClient::open`]): a regular file opened read-only, of the granted size.
//!
//! **Pins.** A grant pins the copy against eviction (eviction punches holes in the copy, which
//! an open descriptor would then read as zeros) until the client sends `direct_close` or its
//! connection ends, whichever comes first: a client that crashes releases its pins with its
//! socket. At most [`MAX_PINS_PER_CONNECTION`] per connection (the default soft limit on a
//! process's descriptors: a client holding more is leaking) and [`MAX_PINS`] in all (enough
//! for [`MAX_CONNECTIONS`] / 8 processes at their limit; the pinned copies can never be evicted
//! so the bound also bounds what eviction must skip); beyond either, the answer is
//! [`Refusal::PinsFull`] and the client reads through the mount.
//!
//! **Waiting.** A client waits at most [`REPLY_TIMEOUT`] for a reply or a write: the daemon
//! answers from the client's own connection thread without waiting on the source, so a late
//! reply means a daemon in trouble, and the client then reads through the mount. Writes never
//! raise `SIGPIPE` (`MSG_NOSIGNAL`): the preload library lives in programs that do not ignore
//! it.

use std::io::{self, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Component, Path};
use std::time::Duration;

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use serde_json::Value;

pub mod table;

/// Name of the control socket in the cache directory (named for its first use, hints).
pub const SOCKET_NAME: &str = "hints.sock";
/// Longest request line: [`MAX_RANGES`] ranges of two 20-digit numbers need ~45 KiB.
pub const MAX_LINE: usize = 64 << 10;
/// Most ranges in one hint: a few batches of rows.
pub const MAX_RANGES: usize = 1024;
/// Most bytes one hint may name: the fetcher's queue holds 256 blocks of 1 MiB, more would
/// only be dropped.
pub const MAX_HINT_BYTES: u64 = 256 << 20;
/// Longest path in a request: `PATH_MAX`.
pub const MAX_PATH: usize = 4096;
/// Most clients connected at once: a node's loaders and, with the preload library, one
/// connection per process of a job (data-loader workers included). One thread each.
pub const MAX_CONNECTIONS: usize = 256;
/// Most direct descriptors one connection may hold pinned: the default soft limit on open
/// descriptors (1024), so only a client that leaks them reaches it.
pub const MAX_PINS_PER_CONNECTION: usize = 1024;
/// Most direct descriptors pinned in all.
pub const MAX_PINS: usize = 8192;
/// Longest reply line: the largest has three 20-digit numbers.
pub const MAX_REPLY: usize = 512;
/// Longest `stats_now` reply line: the stats file's rendering is a few KiB (its error list is
/// bounded to a few dozen messages); 64 KiB leaves room for paths and per-code counters, and
/// a client reading it allocates at most this.
pub const MAX_STATS_REPLY: usize = 64 << 10;
/// The `stats_now` request line (with its newline).
pub const STATS_NOW_LINE: &str = "{\"op\":\"stats_now\"}\n";
/// How long a client waits for a reply (or to write a request) before it gives up: 10 s. A
/// direct open of a copy not yet verified in this mount verifies it first (all of its bytes,
/// through the page cache the reader reads next): at the ~1 GB/s of a node's NVMe that is a
/// few GB, and a process's opens share one connection. (With 2 s, eight 256 MB copies opened
/// at once by one process on a RAM-backed scratch outran it and the epoch read through FUSE.)
/// A hung daemon costs a process this wait once: the preload library then leaves it alone.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(10);
/// Room for a socket path in a socket address (108 bytes with its NUL, with a margin).
pub const MAX_ADDR: usize = 100;
/// Files of at most this many bytes are *small*: their copies are evicted whole, so a
/// descriptor of one needs no pin (a grant's `pin` is 0) and the direct table lists them for
/// readers to open themselves ([`table`]). The daemon checks at compile time that this is its
/// staging threshold.
pub const SMALL_FILE: u64 = 4 << 20;

/// Why a request line was not accepted.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Rejected {
    /// The line is longer than [`MAX_LINE`].
    #[error("line longer than {MAX_LINE} bytes")]
    TooLong,
    /// Not the expected JSON object.
    #[error("malformed request: {0}")]
    Malformed(String),
    /// Not a plain relative path inside the mount.
    #[error("path {0:?} is not a relative path inside the mount")]
    BadPath(String),
    /// No such regular file (or view file) in the mount.
    #[error("no file {0:?} in the mount")]
    Unknown(String),
    /// More than [`MAX_RANGES`] ranges.
    #[error("{0} ranges in one hint, at most {MAX_RANGES}")]
    TooManyRanges(usize),
    /// More than [`MAX_HINT_BYTES`] bytes.
    #[error("{0} bytes in one hint, at most {MAX_HINT_BYTES}")]
    TooManyBytes(u64),
    /// A range outside the file.
    #[error("range [{offset}, {len}] is outside {path:?} ({size} bytes)")]
    OutOfRange {
        /// The file.
        path: String,
        /// Range start.
        offset: u64,
        /// Range length.
        len: u64,
        /// The file's size.
        size: u64,
    },
}

/// A parsed hint: a path under the mount and the byte ranges a reader will read next, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hint {
    /// Path relative to the mount root (`.npy/...` for views).
    pub path: String,
    /// `(offset, len)` pairs, in the order they will be read.
    pub ranges: Vec<(u64, u64)>,
    /// A scope line (`"scope": generation`): the ranges are this node's declared part, not
    /// bytes to fetch now, so the per-line byte bound does not apply.
    pub scope: Option<u64>,
}

/// One request line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// A read-order hint (no reply).
    Hint(Hint),
    /// Asks for a direct descriptor of the file at this path (one reply).
    DirectOpen(String),
    /// The client closed the descriptor of this grant (no reply).
    DirectClose(u64),
    /// Asks for the mount's direct table, its counters and the cache's `files/` directory (one
    /// reply, three descriptors): [`table`].
    DirectTable,
    /// Asks for the mount's counters rendered now (one reply line, a JSON object, no
    /// descriptor).
    StatsNow,
}

/// Parses and bounds one request line (without its newline).
pub fn parse_request(line: &[u8]) -> Result<Request, Rejected> {
    if line.len() > MAX_LINE {
        return Err(Rejected::TooLong);
    }
    let v: Value = serde_json::from_slice(line).map_err(|e| Rejected::Malformed(e.to_string()))?;
    let obj = v
        .as_object()
        .ok_or_else(|| Rejected::Malformed("not a JSON object".into()))?;
    match obj.get("op").map(|o| o.as_str()) {
        None | Some(Some("hint")) => hint_of(obj).map(Request::Hint),
        Some(Some("direct_open")) => {
            let path = obj
                .get("path")
                .and_then(Value::as_str)
                .ok_or_else(|| Rejected::Malformed("no string \"path\"".into()))?;
            check_path(path)?;
            Ok(Request::DirectOpen(path.to_string()))
        }
        Some(Some("direct_table")) => Ok(Request::DirectTable),
        Some(Some("stats_now")) => Ok(Request::StatsNow),
        Some(Some("direct_close")) => obj
            .get("pin")
            .and_then(Value::as_u64)
            .map(Request::DirectClose)
            .ok_or_else(|| Rejected::Malformed("no integer \"pin\"".into())),
        Some(_) => Err(Rejected::Malformed("unknown \"op\"".into())),
    }
}

/// Whether `line` is a request that gets a reply (`direct_open`, `direct_table`,
/// `stats_now`), valid or not: the daemon answers those even when it rejects them, so the
/// client does not wait.
pub fn is_direct_open(line: &[u8]) -> bool {
    line.len() <= MAX_LINE
        && serde_json::from_slice::<Value>(line)
            .ok()
            .and_then(|v| {
                v.get("op")
                    .and_then(Value::as_str)
                    .map(|o| matches!(o, "direct_open" | "direct_table" | "stats_now"))
            })
            .unwrap_or(false)
}

/// Parses one line that must be a hint.
pub fn parse(line: &[u8]) -> Result<Hint, Rejected> {
    match parse_request(line)? {
        Request::Hint(h) => Ok(h),
        _ => Err(Rejected::Malformed("not a hint".into())),
    }
}

fn hint_of(obj: &serde_json::Map<String, Value>) -> Result<Hint, Rejected> {
    let path = obj
        .get("path")
        .and_then(Value::as_str)
        .ok_or_else(|| Rejected::Malformed("no string \"path\"".into()))?;
    let ranges = obj
        .get("ranges")
        .and_then(Value::as_array)
        .ok_or_else(|| Rejected::Malformed("no array \"ranges\"".into()))?;
    if ranges.len() > MAX_RANGES {
        return Err(Rejected::TooManyRanges(ranges.len()));
    }
    let scope = match obj.get("scope") {
        None => None,
        Some(g) => Some(
            g.as_u64()
                .ok_or_else(|| Rejected::Malformed("\"scope\" is not an integer".into()))?,
        ),
    };
    let mut out = Vec::with_capacity(ranges.len());
    let mut total = 0u64;
    for r in ranges {
        let pair = r
            .as_array()
            .filter(|a| a.len() == 2)
            .and_then(|a| Some((a[0].as_u64()?, a[1].as_u64()?)))
            .ok_or_else(|| {
                Rejected::Malformed(format!("range {r} is not [offset, len] in integers"))
            })?;
        total = total.saturating_add(pair.1);
        if total > MAX_HINT_BYTES && scope.is_none() {
            return Err(Rejected::TooManyBytes(total));
        }
        out.push(pair);
    }
    check_path(path)?;
    Ok(Hint {
        path: path.to_string(),
        ranges: out,
        scope,
    })
}

/// Only plain relative paths: no root, no `.` or `..`, no empty components, no NUL, at most
/// [`MAX_PATH`] bytes.
pub fn check_path(path: &str) -> Result<(), Rejected> {
    let bad = || Rejected::BadPath(path.chars().take(200).collect());
    if path.is_empty() || path.len() > MAX_PATH || path.contains('\0') || path.contains("//") {
        return Err(bad());
    }
    if path.ends_with('/')
        || !Path::new(path)
            .components()
            .all(|c| matches!(c, Component::Normal(_)))
    {
        return Err(bad());
    }
    Ok(())
}

/// The `direct_open` request line for `path` (with its newline).
pub fn direct_open_line(path: &str) -> Result<String, Rejected> {
    let mut buf = [0u8; MAX_OPEN_LINE];
    let n = encode_direct_open(path, &mut buf)?;
    Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
}

/// Room for the longest `direct_open` line: every byte of a [`MAX_PATH`]-byte path escaped as
/// `\u00XX`, and the rest of the object.
pub const MAX_OPEN_LINE: usize = MAX_PATH * 6 + 64;

/// Writes the `direct_open` request line for `path` (with its newline) into `out`, without
/// allocating (the preload library builds it inside `open`, which a signal handler may call);
/// its length.
pub fn encode_direct_open(path: &str, out: &mut [u8; MAX_OPEN_LINE]) -> Result<usize, Rejected> {
    check_path(path)?;
    let mut n = 0;
    let mut put = |b: &[u8]| {
        out[n..n + b.len()].copy_from_slice(b);
        n += b.len();
    };
    put(b"{\"op\":\"direct_open\",\"path\":\"");
    for &c in path.as_bytes() {
        match c {
            b'"' => put(b"\\\""),
            b'\\' => put(b"\\\\"),
            c if c < 0x20 => {
                let hex = b"0123456789abcdef";
                put(&[
                    b'\\',
                    b'u',
                    b'0',
                    b'0',
                    hex[usize::from(c >> 4)],
                    hex[usize::from(c & 15)],
                ]);
            }
            c => put(&[c]),
        }
    }
    put(b"\"}\n");
    Ok(n)
}

/// Writes `v` in decimal at the start of `out` without allocating (a signal handler's or a
/// vfork child's path may run it); the digits' length. `out` holds at least 20 bytes.
pub fn write_decimal(out: &mut [u8], mut v: u64) -> usize {
    let mut digits = [0u8; 20];
    let mut k = 0;
    loop {
        digits[k] = b'0' + (v % 10) as u8;
        k += 1;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    for (o, d) in out.iter_mut().zip(digits[..k].iter().rev()) {
        *o = *d;
    }
    k
}

/// Writes the `direct_close` line for grant `pin` into `out` without allocating; its length.
pub fn encode_direct_close(pin: u64, out: &mut [u8; 64]) -> usize {
    let head = b"{\"op\":\"direct_close\",\"pin\":";
    out[..head.len()].copy_from_slice(head);
    let mut n = head.len();
    n += write_decimal(&mut out[n..], pin);
    out[n..n + 2].copy_from_slice(b"}\n");
    n + 2
}

/// The `direct_table` request line (with its newline).
pub const DIRECT_TABLE_LINE: &str = "{\"op\":\"direct_table\"}\n";

/// The `direct_close` request line for grant `pin` (with its newline).
pub fn direct_close_line(pin: u64) -> String {
    let mut buf = [0u8; 64];
    let n = encode_direct_close(pin, &mut buf);
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

/// Why the daemon gave no direct descriptor (the client then reads through the mount).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// The file is not (wholly) in the cache yet.
    #[error("not staged yet")]
    NotStaged,
    /// The copy is complete but not yet verified in this mount (verification is queued).
    #[error("not verified in this mount yet")]
    Verifying,
    /// A `.npy/` view: rendered bytes, no copy on disk.
    #[error("a view")]
    View,
    /// The mount re-checks metadata (`--revalidate`): every read goes through it.
    #[error("the mount revalidates")]
    Revalidate,
    /// The pin bounds are reached ([`MAX_PINS_PER_CONNECTION`], [`MAX_PINS`]).
    #[error("pins full")]
    PinsFull,
    /// Not a regular file (a directory, a device, a control file).
    #[error("not a regular file")]
    NotRegular,
    /// A symbolic link (the client reads through the mount, which follows it).
    #[error("a symbolic link")]
    Symlink,
    /// No such file in the mount's snapshot.
    #[error("no such file")]
    NotFound,
    /// The path is not a plain relative path inside the mount.
    #[error("bad path")]
    BadPath,
    /// The request was malformed.
    #[error("malformed request")]
    Malformed,
    /// The mount is stopping.
    #[error("the mount is stopping")]
    Stopping,
    /// The direct table is not made yet (the listing is still under way).
    #[error("not ready yet")]
    NotReady,
}

impl Refusal {
    /// Every refusal, for tests and the code table.
    pub const ALL: [Refusal; 12] = [
        Refusal::NotStaged,
        Refusal::Verifying,
        Refusal::View,
        Refusal::Revalidate,
        Refusal::PinsFull,
        Refusal::NotRegular,
        Refusal::Symlink,
        Refusal::NotFound,
        Refusal::BadPath,
        Refusal::Malformed,
        Refusal::Stopping,
        Refusal::NotReady,
    ];

    /// The code on the wire.
    pub fn code(self) -> &'static str {
        match self {
            Refusal::NotStaged => "not_staged",
            Refusal::Verifying => "verifying",
            Refusal::View => "view",
            Refusal::Revalidate => "revalidate",
            Refusal::PinsFull => "pins_full",
            Refusal::NotRegular => "not_regular",
            Refusal::Symlink => "symlink",
            Refusal::NotFound => "not_found",
            Refusal::BadPath => "bad_path",
            Refusal::Malformed => "malformed",
            Refusal::Stopping => "stopping",
            Refusal::NotReady => "not_ready",
        }
    }

    /// The refusal with wire code `code`.
    pub fn from_code(code: &str) -> Option<Refusal> {
        Refusal::ALL.into_iter().find(|r| r.code() == code)
    }
}

/// What a granted `direct_open` carries besides the descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Granted {
    /// The grant's number, for `direct_close`.
    pub pin: u64,
    /// The file's size (the source's, per the snapshot; the copy's is the same).
    pub size: u64,
    /// The source's mtime in nanoseconds since the epoch, per the snapshot.
    pub mtime_ns: i64,
}

/// A reply line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reply {
    /// A descriptor comes with it.
    Granted(Granted),
    /// The direct table and the `files/` directory come with it (in that order).
    Table,
    /// No descriptor, and why.
    Refused(Refusal),
}

impl Reply {
    /// The reply's line, with its newline.
    pub fn line(&self) -> String {
        match self {
            Reply::Granted(g) => format!(
                "{{\"pin\":{},\"size\":{},\"mtime_ns\":{}}}\n",
                g.pin, g.size, g.mtime_ns
            ),
            Reply::Table => "{\"table\":1}\n".to_string(),
            Reply::Refused(r) => format!("{{\"refused\":\"{}\"}}\n", r.code()),
        }
    }

    /// Parses a reply line (without its newline), without allocating: the fields are read
    /// into a borrowed struct (a refusal code with escapes in it is no code of ours).
    pub fn parse(line: &[u8]) -> Result<Reply, ClientError> {
        #[derive(serde::Deserialize)]
        struct Wire<'a> {
            pin: Option<u64>,
            size: Option<u64>,
            mtime_ns: Option<i64>,
            #[serde(borrow)]
            refused: Option<&'a str>,
            table: Option<u64>,
        }
        if line.len() > MAX_REPLY {
            return Err(ClientError::BadReply("too long"));
        }
        let w: Wire<'_> =
            serde_json::from_slice(line).map_err(|_| ClientError::BadReply("not a reply"))?;
        if let Some(code) = w.refused {
            let r = Refusal::from_code(code).ok_or(ClientError::BadReply("unknown refusal"))?;
            return Ok(Reply::Refused(r));
        }
        if w.table == Some(1) {
            return Ok(Reply::Table);
        }
        match (w.pin, w.size, w.mtime_ns) {
            (Some(pin), Some(size), Some(mtime_ns)) => Ok(Reply::Granted(Granted {
                pin,
                size,
                mtime_ns,
            })),
            _ => Err(ClientError::BadReply("neither a grant nor a refusal")),
        }
    }
}

/// What a client's direct open ended with, when it got no descriptor.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The daemon refused.
    #[error("refused: {0}")]
    Refused(Refusal),
    /// The socket failed or timed out (the connection is then unusable).
    #[error("control socket: {0}")]
    Io(#[from] io::Error),
    /// The daemon's answer was not a valid reply (the connection is then unusable).
    #[error("bad reply: {0}")]
    BadReply(&'static str),
    /// The reply came without its descriptors: the kernel dropped them because this process
    /// is at its descriptor limit (`EMFILE`). The connection is still in step (the reply was
    /// read whole, a grant's pin given back): ask again later.
    #[error("the reply's descriptors did not fit under the process's descriptor limit")]
    NoDescriptor,
}

/// Writes all of `bytes` to `sock` without `SIGPIPE`, attaching `fd` (if any) to the first
/// byte. Waits as the socket's write timeout allows.
pub fn send(sock: BorrowedFd<'_>, bytes: &[u8], fd: Option<BorrowedFd<'_>>) -> io::Result<()> {
    match fd {
        Some(f) => send_fds(sock, bytes, &[f]),
        None => send_fds(sock, bytes, &[]),
    }
}

/// Most descriptors one reply carries: the direct table, its counters and the `files/`
/// directory.
pub const MAX_REPLY_FDS: usize = 3;

/// [`send`] with up to [`MAX_REPLY_FDS`] descriptors attached to the first byte.
pub fn send_fds(sock: BorrowedFd<'_>, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    if fds.len() > MAX_REPLY_FDS {
        return Err(io::ErrorKind::InvalidInput.into());
    }
    let mut at = 0;
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_REPLY_FDS))];
    let mut first = true;
    while at < bytes.len() {
        let iov = [IoSlice::new(&bytes[at..])];
        let mut control = SendAncillaryBuffer::new(&mut space);
        if first && !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
            return Err(io::Error::other("no room for the descriptor"));
        }
        let n = match rustix::net::sendmsg(sock, &iov, &mut control, SendFlags::NOSIGNAL) {
            Ok(n) => n,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        };
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        first = false;
        at += n;
    }
    Ok(())
}

/// Connects to `socket`, through a descriptor of its directory when the path is too long for a
/// socket address. Allocates nothing for a path that fits (the preload library connects from
/// inside `open`).
pub fn connect(socket: &Path) -> io::Result<UnixStream> {
    if socket.as_os_str().len() < MAX_ADDR {
        return UnixStream::connect(socket);
    }
    let (dir, name) = match (socket.parent(), socket.file_name()) {
        (Some(d), Some(n)) => (d, n),
        _ => return Err(io::ErrorKind::InvalidInput.into()),
    };
    let d = rustix::fs::open(
        dir,
        rustix::fs::OFlags::PATH | rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )?;
    // "/proc/self/fd/N/NAME" in a stack buffer.
    let mut buf = [0u8; MAX_ADDR + 64];
    let head = b"/proc/self/fd/";
    let mut n = head.len();
    buf[..n].copy_from_slice(head);
    let fd = std::os::fd::AsRawFd::as_raw_fd(&d);
    n += write_decimal(&mut buf[n..], u64::from(fd.unsigned_abs()));
    let name = name.as_encoded_bytes();
    if n + 1 + name.len() > MAX_ADDR {
        return Err(io::ErrorKind::InvalidInput.into());
    }
    buf[n] = b'/';
    buf[n + 1..n + 1 + name.len()].copy_from_slice(name);
    n += 1 + name.len();
    // SAFETY: the bytes are "/proc/self/fd/" + digits + "/" + a file name, all from OsStr.
    let via = unsafe { std::ffi::OsStr::from_encoded_bytes_unchecked(&buf[..n]) };
    UnixStream::connect(via)
}

/// A client's connection for direct opens (and hints).
#[derive(Debug)]
pub struct DirectClient {
    stream: UnixStream,
}

impl DirectClient {
    /// Connects to the control socket at `socket`, with [`REPLY_TIMEOUT`] on reads and writes.
    pub fn connect(socket: &Path) -> io::Result<DirectClient> {
        DirectClient::from_stream(connect(socket)?)
    }

    /// Wraps a connected stream, setting [`REPLY_TIMEOUT`] on reads and writes.
    pub fn from_stream(stream: UnixStream) -> io::Result<DirectClient> {
        stream.set_read_timeout(Some(REPLY_TIMEOUT))?;
        stream.set_write_timeout(Some(REPLY_TIMEOUT))?;
        Ok(DirectClient { stream })
    }

    /// The connection's socket.
    pub fn stream(&self) -> &UnixStream {
        &self.stream
    }

    /// Asks for a direct descriptor of `path` (relative to the mount root). The descriptor is
    /// close-on-exec, opened read-only, checked to be a regular file of the granted size.
    /// After an [`ClientError::Io`] or [`ClientError::BadReply`] the connection is out of step:
    /// drop it. Allocates nothing (the preload library calls it inside `open`).
    pub fn open(&mut self, path: &str) -> Result<(OwnedFd, Granted), ClientError> {
        let mut line = [0u8; MAX_OPEN_LINE];
        let n = encode_direct_open(path, &mut line)
            .map_err(|_| ClientError::Refused(Refusal::BadPath))?;
        send_fds(self.stream.as_fd(), &line[..n], &[])?;
        let (reply, [fd, _, _]) = self.read_reply()?;
        match (reply, fd) {
            (Reply::Refused(r), _) => Err(ClientError::Refused(r)),
            (Reply::Granted(g), Some(fd)) => match check_descriptor(&fd, g.size) {
                Ok(()) => Ok((fd, g)),
                Err(why) => {
                    // Not what was promised: give the pin back, refuse the descriptor.
                    if g.pin != 0 {
                        let _ = self.close(g.pin);
                    }
                    Err(ClientError::BadReply(why))
                }
            },
            (Reply::Granted(g), None) => {
                // Dropped by the kernel (descriptor limit): give the pin back.
                if g.pin != 0 {
                    self.close(g.pin)?;
                }
                Err(ClientError::NoDescriptor)
            }
            (Reply::Table, _) => Err(ClientError::BadReply("a table for an open")),
        }
    }

    /// Asks for the mount's direct table ([`table`]): the table's memory file, its counters'
    /// and a descriptor of the cache's `files/` directory, all close-on-exec. The table and
    /// counters are checked when mapped ([`table::TableReader::map`]); the directory here.
    pub fn table(&mut self) -> Result<(OwnedFd, OwnedFd, OwnedFd), ClientError> {
        send_fds(self.stream.as_fd(), DIRECT_TABLE_LINE.as_bytes(), &[])?;
        match self.read_reply()? {
            (Reply::Refused(r), _) => Err(ClientError::Refused(r)),
            (Reply::Table, [Some(table), Some(counters), Some(dir)]) => {
                let st = rustix::fs::fstat(&dir).map_err(io::Error::from)?;
                if rustix::fs::FileType::from_raw_mode(st.st_mode)
                    != rustix::fs::FileType::Directory
                {
                    return Err(ClientError::BadReply("the files directory is not one"));
                }
                Ok((table, counters, dir))
            }
            (Reply::Table, _) => Err(ClientError::NoDescriptor),
            _ => Err(ClientError::BadReply("not a table reply")),
        }
    }

    /// Asks for the mount's counters rendered now (`stats_now`): the JSON object of the stats
    /// file, read in at most [`MAX_STATS_REPLY`] bytes. Allocates (not for signal handlers).
    pub fn stats_now(&mut self) -> Result<Value, ClientError> {
        send_fds(self.stream.as_fd(), STATS_NOW_LINE.as_bytes(), &[])?;
        let mut line = Vec::with_capacity(4096);
        let mut buf = [0u8; 4096];
        loop {
            let n = match rustix::io::read(self.stream.as_fd(), &mut buf) {
                Ok(n) => n,
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(ClientError::Io(e.into())),
            };
            if n == 0 {
                return Err(ClientError::Io(io::ErrorKind::UnexpectedEof.into()));
            }
            line.extend_from_slice(&buf[..n]);
            if let Some(end) = line.iter().position(|&b| b == b'\n') {
                if end + 1 != line.len() {
                    return Err(ClientError::BadReply("bytes after the reply"));
                }
                line.truncate(end);
                break;
            }
            if line.len() > MAX_STATS_REPLY {
                return Err(ClientError::BadReply("reply too long"));
            }
        }
        if let Ok(Reply::Refused(r)) = Reply::parse(&line) {
            return Err(ClientError::Refused(r));
        }
        match serde_json::from_slice::<Value>(&line) {
            Ok(v) if v.is_object() => Ok(v),
            _ => Err(ClientError::BadReply("not a stats object")),
        }
    }

    /// Tells the daemon the descriptor of grant `pin` is closed (its pin is released).
    pub fn close(&mut self, pin: u64) -> io::Result<()> {
        let mut line = [0u8; 64];
        let n = encode_direct_close(pin, &mut line);
        send_fds(self.stream.as_fd(), &line[..n], &[])
    }

    /// Reads one reply line (bounded by [`MAX_REPLY`]) and the descriptors that came with it
    /// (at most [`MAX_REPLY_FDS`]; any more are closed). Allocates nothing.
    fn read_reply(&mut self) -> Result<(Reply, [Option<OwnedFd>; MAX_REPLY_FDS]), ClientError> {
        let mut line = [0u8; MAX_REPLY + 1];
        let mut len = 0;
        let mut got_fds: [Option<OwnedFd>; MAX_REPLY_FDS] = [None, None, None];
        let mut nfds = 0;
        loop {
            let mut space =
                [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_REPLY_FDS))];
            let mut control = RecvAncillaryBuffer::new(&mut space);
            // One byte at a time past the first read would be slow; a reply is one small
            // message, so this loop runs once in practice. Never read past the newline: the
            // next reply's descriptor must stay with its bytes.
            let mut iov = [IoSliceMut::new(&mut line[len..])];
            let got = match rustix::net::recvmsg(
                self.stream.as_fd(),
                &mut iov,
                &mut control,
                RecvFlags::CMSG_CLOEXEC,
            ) {
                Ok(m) => m,
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(ClientError::Io(e.into())),
            };
            for msg in control.drain() {
                if let RecvAncillaryMessage::ScmRights(fds) = msg {
                    for f in fds {
                        // Ours up to the bound; any other is dropped (closed) here.
                        if nfds < MAX_REPLY_FDS {
                            got_fds[nfds] = Some(f);
                            nfds += 1;
                        }
                    }
                }
            }
            if got.bytes == 0 {
                return Err(ClientError::Io(io::ErrorKind::UnexpectedEof.into()));
            }
            len += got.bytes;
            if let Some(end) = line[..len].iter().position(|&b| b == b'\n') {
                if end + 1 != len {
                    return Err(ClientError::BadReply("bytes after the reply"));
                }
                return Ok((Reply::parse(&line[..end])?, got_fds));
            }
            if len > MAX_REPLY {
                return Err(ClientError::BadReply("reply too long"));
            }
        }
    }
}

/// Checks a granted descriptor: a regular file of `size` bytes, open read-only.
fn check_descriptor(fd: &OwnedFd, size: u64) -> Result<(), &'static str> {
    let st = rustix::fs::fstat(fd).map_err(|_| "fstat failed")?;
    if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::RegularFile {
        return Err("not a regular file");
    }
    if u64::try_from(st.st_size).ok() != Some(size) {
        return Err("not the granted size");
    }
    let flags = rustix::fs::fcntl_getfl(fd).map_err(|_| "fcntl failed")?;
    if flags & rustix::fs::OFlags::ACCMODE != rustix::fs::OFlags::RDONLY {
        return Err("not read-only");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::io::Write;

    #[test]
    fn requests_parse_and_bad_paths_are_rejected() {
        assert_eq!(
            parse_request(direct_open_line("a/b.npy").unwrap().trim_end().as_bytes()),
            Ok(Request::DirectOpen("a/b.npy".into()))
        );
        assert_eq!(
            parse_request(direct_close_line(7).trim_end().as_bytes()),
            Ok(Request::DirectClose(7))
        );
        for bad in [
            "../x",
            "/etc/passwd",
            "a/../b",
            "a//b",
            "./a",
            "a/",
            "",
            "a\0b",
        ] {
            assert!(direct_open_line(bad).is_err(), "{bad:?}");
            let line = format!(
                "{{\"op\":\"direct_open\",\"path\":{}}}",
                serde_json::json!(bad)
            );
            assert!(
                matches!(parse_request(line.as_bytes()), Err(Rejected::BadPath(_))),
                "{bad:?}"
            );
        }
        let long = "a/".repeat(MAX_PATH / 2) + "b";
        assert!(direct_open_line(&long).is_err());
        assert_eq!(
            parse_request(STATS_NOW_LINE.trim_end().as_bytes()),
            Ok(Request::StatsNow)
        );
        assert!(is_direct_open(STATS_NOW_LINE.trim_end().as_bytes()));
        assert!(matches!(
            parse_request(br#"{"op":"direct_nope"}"#),
            Err(Rejected::Malformed(_))
        ));
        assert!(matches!(
            parse_request(br#"{"op":"direct_close","pin":-1}"#),
            Err(Rejected::Malformed(_))
        ));
        assert_eq!(
            parse_request(br#"{"path":"x","ranges":[[0,1]]}"#),
            Ok(Request::Hint(Hint {
                path: "x".into(),
                ranges: vec![(0, 1)],
                scope: None,
            }))
        );
        // A scope line: a declaration, beyond the byte bound of a hint.
        let big = format!(
            r#"{{"path":"x","scope":7,"ranges":[[0,{}]]}}"#,
            MAX_HINT_BYTES * 4
        );
        assert_eq!(
            parse_request(big.as_bytes()),
            Ok(Request::Hint(Hint {
                path: "x".into(),
                ranges: vec![(0, MAX_HINT_BYTES * 4)],
                scope: Some(7),
            }))
        );
        assert!(matches!(
            parse_request(br#"{"path":"x","scope":-1,"ranges":[]}"#),
            Err(Rejected::Malformed(_))
        ));
    }

    #[test]
    fn replies_round_trip_within_their_bound() {
        let g = Reply::Granted(Granted {
            pin: u64::MAX,
            size: u64::MAX,
            mtime_ns: i64::MIN,
        });
        assert!(g.line().len() <= MAX_REPLY);
        assert_eq!(Reply::parse(g.line().trim_end().as_bytes()).unwrap(), g);
        for r in Refusal::ALL {
            let line = Reply::Refused(r).line();
            assert_eq!(
                Reply::parse(line.trim_end().as_bytes()).unwrap(),
                Reply::Refused(r)
            );
        }
        assert!(Reply::parse(br#"{"refused":"nope"}"#).is_err());
        assert!(Reply::parse(br#"{"pin":1}"#).is_err());
    }

    #[test]
    fn a_descriptor_travels_with_its_reply_and_a_writable_one_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("f");
        std::fs::write(&path, b"hello").unwrap();
        for writable in [false, true] {
            let (a, mut b) = UnixStream::pair().unwrap();
            let mut c = DirectClient::from_stream(a).unwrap();
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(writable)
                .open(&path)
                .unwrap();
            let t = std::thread::spawn(move || {
                let mut req = vec![0u8; 256];
                let n = std::io::Read::read(&mut b, &mut req).unwrap();
                let reply = Reply::Granted(Granted {
                    pin: 3,
                    size: 5,
                    mtime_ns: 9,
                });
                send(b.as_fd(), reply.line().as_bytes(), Some(f.as_fd())).unwrap();
                // The client gives a bad descriptor's pin back.
                let mut rest = vec![0u8; 256];
                let m = if writable {
                    std::io::Read::read(&mut b, &mut rest).unwrap()
                } else {
                    0
                };
                b.flush().unwrap();
                (req[..n].to_vec(), rest[..m].to_vec())
            });
            let got = c.open("d/f");
            let (req, rest) = t.join().unwrap();
            assert_eq!(req, direct_open_line("d/f").unwrap().into_bytes());
            if writable {
                assert!(matches!(got, Err(ClientError::BadReply(_))), "{got:?}");
                assert_eq!(rest, direct_close_line(3).into_bytes());
            } else {
                let (fd, g) = got.unwrap();
                assert_eq!(g.size, 5);
                let mut s = String::new();
                std::io::Read::read_to_string(&mut std::fs::File::from(fd), &mut s).unwrap();
                assert_eq!(s, "hello");
            }
        }
    }
}
