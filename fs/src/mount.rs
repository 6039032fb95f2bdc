//! Mounting a [`FsCore`] with fuser: session options and the handle that unmounts it.
//!
//! The session runs [`MountOptions::threads`] request threads, each on its own cloned
//! `/dev/fuse` descriptor, so a reader waiting on the source never blocks readers of cached
//! data. As root fuser mounts directly; otherwise it goes through `fusermount3`.

use std::io;
use std::path::Path;
use std::sync::Arc;

use fuser::{BackgroundSession, Config, MountOption, Session, SessionACL, SessionUnmounter};

use crate::fscore::FsCore;
use crate::fuse::{FuseFs, Lookups};

/// Session options.
#[derive(Clone, Debug)]
pub struct MountOptions {
    /// Ask the kernel for FUSE passthrough of fully cached files.
    pub passthrough: bool,
    /// FUSE request threads.
    pub threads: usize,
    /// Let other users read the mount (needs `user_allow_other` in /etc/fuse.conf for non-root).
    pub allow_other: bool,
    /// Let the kernel open files without asking the daemon (see [`FuseFs::new`]).
    pub skip_open: bool,
    /// Push cached files into the kernel's page cache ahead of in-order readers
    /// ([`crate::walk`]).
    pub push: bool,
    /// Listings carry attributes (readdirplus): no lookup per file after a listing.
    pub readdirplus: bool,
    /// Large files are opened for direct I/O (a lever to measure; needs daemon opens).
    pub direct_io_large: bool,
    /// Also push the next [`crate::stream::PUSH_AHEAD`] of a large file ahead of a reader
    /// streaming it (with `push`; a lever to measure, see [`crate::stream`]).
    pub push_ahead: bool,
}

impl MountOptions {
    /// Default [`MountOptions::threads`] (`stagefs mount --fuse-threads`): enough that eight
    /// readers of a DataLoader each have a request in flight.
    pub const DEFAULT_THREADS: usize = 8;
}

/// What `stagefs mount` asks unless told otherwise: passthrough (as root), skipped opens,
/// pushes of in-order readers and block rests, readdirplus; no direct I/O, no push-ahead.
impl Default for MountOptions {
    fn default() -> Self {
        MountOptions {
            passthrough: true,
            threads: Self::DEFAULT_THREADS,
            allow_other: false,
            skip_open: true,
            push: true,
            readdirplus: true,
            direct_io_large: false,
            push_ahead: false,
        }
    }
}

impl MountOptions {
    /// These options under the rules every mount holds, whatever it was asked:
    /// - passthrough needs `CAP_SYS_ADMIN` (registering backing files): off for other users;
    /// - with revalidation (`revalidating`) a file may change while mounted, and pages the
    ///   kernel keeps across opens, or that were pushed, would outlive its old version: the
    ///   kernel asks at every open and nothing is pushed;
    /// - direct I/O for large files is chosen at open: the daemon's opens are needed.
    pub fn settled(&self, revalidating: bool) -> MountOptions {
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        MountOptions {
            passthrough: self.passthrough && root,
            skip_open: self.skip_open && !revalidating && !self.direct_io_large,
            push: self.push && !revalidating,
            push_ahead: self.push_ahead && self.push && !revalidating,
            ..self.clone()
        }
    }
}

/// Pushes pages through the session's notifier (`FUSE_NOTIFY_STORE`).
/// Only inodes the kernel holds: it drops pages pushed to others (and answers ENOENT, which
/// fuser does not pass on).
struct NotifySink(fuser::Notifier, Arc<Lookups>);

impl crate::sink::PageSink for NotifySink {
    fn store(&self, ino: u64, offset: u64, data: &[u8]) -> bool {
        self.1.held(ino) && self.0.store(fuser::INodeNo(ino), offset, data).is_ok()
    }

    fn holds(&self, ino: u64) -> bool {
        self.1.held(ino)
    }
}

/// A live mount.
pub struct Mounted {
    session: BackgroundSession,
    unmounter: Option<SessionUnmounter>,
}

impl Mounted {
    /// Takes the handle that unmounts from another thread (e.g. a signal-handling thread).
    pub fn take_unmounter(&mut self) -> Option<SessionUnmounter> {
        self.unmounter.take()
    }

    /// Waits until the filesystem is unmounted (by `umount`, `fusermount3 -u` or [`Self::unmounter`]).
    pub fn join(self) -> io::Result<()> {
        self.session.join()
    }
}

/// Mounts `core` at `mountpoint`; returns once the kernel has completed the FUSE handshake.
pub fn mount(core: Arc<FsCore>, mountpoint: &Path, opts: &MountOptions) -> io::Result<Mounted> {
    let opts = &opts.settled(core.revalidating());
    let mut cfg = Config::default();
    cfg.mount_options = vec![
        MountOption::RO,
        MountOption::NoDev,
        MountOption::NoSuid,
        MountOption::DefaultPermissions,
        MountOption::FSName(format!("stagefs:{}", core.source().display())),
        MountOption::Subtype("stagefs".into()),
    ];
    cfg.acl = if opts.allow_other {
        SessionACL::All
    } else {
        SessionACL::Owner
    };
    cfg.n_threads = Some(opts.threads.max(1));
    cfg.clone_fd = true;
    let lookups = Arc::new(Lookups::default());
    let pool = crate::offload::Offload::new(0)?;
    let mut fs = FuseFs::new(
        core.clone(),
        opts.passthrough,
        opts.skip_open,
        opts.readdirplus,
        lookups.clone(),
        pool.clone(),
    );
    fs.set_direct_io_large(opts.direct_io_large);
    let mut session = Session::new(fs, mountpoint, &cfg)?;
    let unmounter = session.unmount_callable();
    let session = session.spawn()?;
    if opts.push {
        core.set_page_sink(Some(Arc::new(NotifySink(session.notifier(), lookups))));
        core.set_push_ahead(opts.push_ahead);
    }
    // Read-order hints render on the same view pool; without the socket the mount still serves.
    if let Err(e) = core.start_hints(Some(pool)) {
        tracing::warn!(error = %e, "no read-order hint socket (hints are off for this mount)");
    }
    Ok(Mounted {
        session,
        unmounter: Some(unmounter),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn asked() -> MountOptions {
        MountOptions {
            passthrough: true,
            threads: 8,
            allow_other: false,
            skip_open: true,
            push: true,
            readdirplus: true,
            direct_io_large: false,
            push_ahead: true,
        }
    }

    #[test]
    fn revalidation_and_direct_io_keep_the_daemons_opens_and_stop_pushes() {
        let s = asked().settled(false);
        assert!(s.skip_open && s.push && s.push_ahead);
        let s = asked().settled(true);
        assert!(!s.skip_open && !s.push && !s.push_ahead, "{s:?}");
        let s = MountOptions {
            direct_io_large: true,
            ..asked()
        }
        .settled(false);
        assert!(!s.skip_open && s.push);
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        assert_eq!(asked().settled(false).passthrough, root);
    }
}
