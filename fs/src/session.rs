//! A mount's life: starting the core (the cache, the snapshot, the background work) and
//! stopping it.
//!
//! **Start.** The cache log replays on one thread while the snapshot loads on another. The
//! snapshot is `--index`, else the one kept in the cache for this source, else a fresh listing
//! ([`SnapshotOrigin`]). The parts are then built in order, each from those before it: the
//! fetcher, the files, the views (prepared on first use), the verification queue, the direct
//! and hint services ([`crate::handle`]: they get handles of the parts, not the core), and
//! last the core. Then the background work starts: the walker and pushers, the cache log
//! flusher (every [`FLUSH_INTERVAL`]), the verifier of complete copies, and, once the listing
//! is complete, the binding of the previous mount's cache entries, the snapshot kept in the
//! cache ([`SNAPSHOT_FILE`]), the verification of the copies bound, and staging. The hint
//! socket starts later, once the kernel session runs ([`FsCore::start_hints`]).
//!
//! **Stop.** [`FsCore::shutdown`] (unmount) and [`FsCore::abandon`] (a killed daemon, for
//! tests) end every background thread and wait for them, then write the cache log or not.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use stagefs_prefetch::cachedir::CacheDir;
use stagefs_prefetch::locks::lock;
use stagefs_prefetch::store::FORMAT_DIR;
use stagefs_prefetch::{CacheStore, Fetcher, LocalSource, Source, Stats, StoreConfig};
use stagefs_views::ViewOptions;
use tracing::{info, warn};

use crate::control::StatsFile;
use crate::direct::DirectService;
use crate::error::FsError;
use crate::files::Files;
use crate::fscore::{FsConfig, FsCore, SnapshotOrigin, VIEWS_BY_INO};
use crate::handle::{MountHandle, VerifyQueue};
use crate::hints::HintService;
use crate::inode::InodeTable;
use crate::offload::Offload;
use crate::snapshot::{NodeId, ScanOptions, Snapshot};
use crate::views::MountViews;

/// Interval between flushes of the cache log, bounding what a killed daemon forgets.
pub const FLUSH_INTERVAL: Duration = Duration::from_secs(2);
/// Name of the snapshot persisted in the cache directory.
pub const SNAPSHOT_FILE: &str = "snapshot";

/// How the mount's views render, from its configuration.
fn view_options(cfg: &FsConfig) -> ViewOptions {
    ViewOptions {
        image_size: cfg.image_size,
        strict: cfg.strict_views,
        // One budget for the daemon: FUSE threads and the background renderer share it.
        decode: stagefs_views::image::DecodeSettings {
            fast: cfg.fast_decode,
            max_pixels: cfg.max_image_pixels,
            budget: stagefs_views::image::DecodeBudget::new(cfg.decode_budget),
        },
        ..ViewOptions::default()
    }
}

impl FsCore {
    /// Opens the cache, takes (or loads) the snapshot and starts the background work: fetch
    /// workers, index flusher, cross-file prefetch, binding of the previous mount's cache, and
    /// staging when the tree fits.
    pub fn new(cfg: FsConfig) -> Result<Arc<FsCore>, FsError> {
        let source: Arc<dyn Source> = Arc::new(LocalSource::new(cfg.source.clone())?);
        FsCore::with_source(cfg, source)
    }

    /// [`new`](Self::new) over any [`Source`] (tests inject slow or failing ones).
    pub fn with_source(cfg: FsConfig, source: Arc<dyn Source>) -> Result<Arc<FsCore>, FsError> {
        let stats = Arc::new(Stats::default());
        let store_cfg = StoreConfig {
            dir: cfg.cache_dir.clone(),
            capacity: cfg.cache_size,
            direct_reads: cfg.direct_scratch,
        };
        // The directory first (created and checked once), then the cache log replays on one
        // thread while the snapshot loads on this one: a remount with a million cached files is
        // both, on different files, and each is a second of CPU.
        let dir = CacheDir::open(&cfg.cache_dir)?.subdir(FORMAT_DIR)?;
        let (opened, snapshot) = std::thread::scope(|sc| {
            let replay = sc.spawn(|| CacheStore::open(&store_cfg, stats.clone()));
            let snapshot = Self::open_snapshot(&cfg, &dir, source.clone());
            (replay.join(), snapshot)
        });
        let (store, loaded) = opened.map_err(|_| FsError::Internal)??;
        let store = Arc::new(store);
        let (snapshot, origin) = snapshot?;
        let fetcher = Fetcher::new(store.clone(), source, stats.clone(), cfg.fetch.clone())?;
        let files = Files::new(snapshot.clone(), fetcher.clone(), cfg.cross_file);
        let stop = Arc::new(AtomicBool::new(false));
        let verify = Arc::new(VerifyQueue::new());
        let inodes = Arc::new(InodeTable::default());
        let views = Arc::new(MountViews::new(
            snapshot.clone(),
            files.clone(),
            view_options(&cfg),
        ));
        let mount = MountHandle::new(files.clone(), stop.clone());
        let direct = Arc::new(DirectService::new(
            mount.clone(),
            cfg.revalidate.is_some(),
            verify.clone(),
        ));
        let hints = Arc::new(HintService::new(
            mount,
            views.clone(),
            inodes.clone(),
            direct.clone(),
        ));
        let core = Arc::new(FsCore {
            snapshot,
            files,
            fetcher,
            store,
            stats,
            inodes,
            handles: Mutex::new(std::collections::HashMap::new()),
            views_by_ino: Mutex::new(lru::LruCache::new(VIEWS_BY_INO)),
            next_fh: AtomicU64::new(1),
            stop,
            threads: Mutex::new(Vec::new()),
            views,
            verify,
            origin,
            stats_file: StatsFile::default(),
            hints,
            hint_server: Mutex::new(None),
            direct,
            cfg,
        });
        core.start(loaded, origin.persisted())?;
        Ok(core)
    }

    /// The snapshot to serve: `--index`, else the one persisted in the cache for this source,
    /// else a fresh listing; and which it is.
    fn open_snapshot(
        cfg: &FsConfig,
        dir: &CacheDir,
        source: Arc<dyn Source>,
    ) -> Result<(Arc<Snapshot>, SnapshotOrigin), FsError> {
        if let Some(index) = &cfg.index {
            let s = Snapshot::load(index)?;
            if s.source_root() != cfg.source {
                return Err(FsError::IndexMismatch {
                    index: index.clone(),
                    of: s.source_root().to_path_buf(),
                    mounted: cfg.source.clone(),
                });
            }
            // For --revalidate (and directories the index could not list): read lazily.
            s.attach_source(source);
            return Ok((s, SnapshotOrigin::Index));
        }
        if !cfg.rescan && dir.exists(SNAPSHOT_FILE) {
            match Snapshot::load_from(dir, SNAPSHOT_FILE) {
                Ok(s) if s.source_root() == cfg.source && s.root_unchanged(&*source) => {
                    info!(
                        nodes = s.len(),
                        "serving the snapshot kept in the cache (no listing)"
                    );
                    s.attach_source(source);
                    return Ok((s, SnapshotOrigin::Cache));
                }
                Ok(_) => info!(
                    "the cache's snapshot is of another source, or the source root changed since \
                     (a regenerated tree): listing again"
                ),
                Err(e) => warn!(error = %e, "the cache's snapshot is unusable: listing again"),
            }
        }
        let s = Snapshot::scan(
            source,
            &cfg.source,
            ScanOptions {
                threads: cfg.scan_threads.max(1),
                ..ScanOptions::default()
            },
        )?;
        Ok((s, SnapshotOrigin::Listed))
    }

    fn spawn(&self, name: &str, f: impl FnOnce() + Send + 'static) -> std::io::Result<()> {
        let t = std::thread::Builder::new().name(name.into()).spawn(f)?;
        lock(&self.threads).push(t);
        Ok(())
    }

    /// Starts the background work.
    fn start(
        self: &Arc<Self>,
        loaded: stagefs_prefetch::Loaded,
        persisted: bool,
    ) -> Result<(), FsError> {
        if let Some(t) = crate::walk::start(&self.files)? {
            lock(&self.threads).push(t);
        }
        crate::pushers::start(&self.files)?;
        {
            let store = self.store.clone();
            let stop = self.stop.clone();
            self.spawn("stagefs-flush", move || {
                // Short sleeps so shutdown is prompt; a flush every FLUSH_INTERVAL.
                let mut last = Instant::now();
                while !stop.load(Relaxed) {
                    std::thread::sleep(Duration::from_millis(100));
                    if last.elapsed() >= FLUSH_INTERVAL && !stop.load(Relaxed) {
                        if let Err(e) = store.flush() {
                            warn!(error = %e, "writing the cache log failed (will retry)");
                        }
                        last = Instant::now();
                    }
                }
            })?;
        }
        {
            let queue = self.verify.clone();
            let store = self.store.clone();
            self.spawn("stagefs-verify", move || {
                while let Some(id) = queue.next() {
                    // An earlier mount's record first (one fstatat), else the bytes.
                    if !store.check_trust(id) {
                        store.verify(id);
                    }
                }
            })?;
            // A copy completed in this mount is verified as soon as it is complete, so the
            // next epoch's opens get passthrough or direct reads at once (else the first open
            // of each file in the second epoch read through FUSE). Dropped when the core stops
            // (stop_background).
            let queue = self.verify.clone();
            self.store
                .set_on_complete(Some(Box::new(move |id| queue.queue(id))));
            // What the cache trusts is what the direct table lists.
            let table = self.direct.table().clone();
            let snapshot = self.snapshot.clone();
            self.store.set_on_trust(Some(Box::new(move |ev| {
                table.on_event(&snapshot, ev);
            })));
        }
        // Binding the previous mount's cache entries needs the whole snapshot; with a snapshot
        // loaded from disk it is there now, and the mount serves nothing before it is done.
        if self.snapshot.is_complete() {
            self.after_listing(loaded, persisted);
        } else {
            let me = Arc::downgrade(self);
            self.spawn("stagefs-bind", move || {
                let Some(core) = me.upgrade() else { return };
                match core.snapshot.wait_complete() {
                    Ok(()) => core.after_listing(loaded, persisted),
                    Err(e) => {
                        warn!(error = %e, "listing the source failed; the cache is not reused")
                    }
                }
            })?;
        }
        Ok(())
    }

    /// Once the snapshot is complete: bind cached entries, persist the snapshot, start staging.
    fn after_listing(self: &Arc<Self>, loaded: stagefs_prefetch::Loaded, persisted: bool) {
        self.views.set_loaded(self.files.bind_loaded(loaded));
        // The table is sized from the tree; made before the bound copies are checked, so each
        // one trusted is listed as it is (`--revalidate` mounts hand nothing out direct).
        if self.cfg.revalidate.is_none() {
            self.direct.table().make(&self.snapshot, &self.store);
        }
        // The copies bound now were verified in an earlier mount, not this one: verify them in
        // the background so passthrough and direct descriptors serve the warm epoch.
        let direct = Arc::downgrade(&self.direct);
        let verify = self.spawn("stagefs-verify-copies", move || {
            if let Some(direct) = direct.upgrade() {
                direct.verify_copies();
            }
        });
        if let Err(e) = verify {
            warn!(error = %e, "could not start verifying the cached copies");
        }
        if !persisted {
            match self.snapshot.save_to(self.store.dir(), SNAPSHOT_FILE) {
                Ok(()) => info!(nodes = self.snapshot.len(), "snapshot kept in the cache"),
                Err(e) => warn!(error = %e, "could not keep the snapshot in the cache"),
            }
        }
        for e in self.snapshot.errors() {
            self.stats.error(e);
        }
        if !self.cfg.stage {
            return;
        }
        let capacity = self.store.capacity();
        match crate::scope_stager::spawn_stager(self.files.clone(), capacity, self.stop.clone()) {
            Ok(t) => lock(&self.threads).push(t),
            Err(e) => warn!(error = %e, "could not start staging of the declared part"),
        }
        if self.cfg.stage_hinted {
            info!("staging waits for a loader to declare this node's part");
            return;
        }
        let planner = self.files.clone();
        let plan = move || {
            let (plan, total) = planner.staging_plan();
            if total > capacity {
                info!(
                    total,
                    capacity, "tree larger than the cache: no background staging"
                );
                return None;
            }
            Some((plan, total))
        };
        let files = self.files.clone();
        let wants: stagefs_prefetch::staging::WantsOf<NodeId> =
            Arc::new(move |node: &NodeId| files.missing_blocks(*node));
        match stagefs_prefetch::staging::spawn(self.fetcher.clone(), plan, wants, self.stop.clone())
        {
            Ok(t) => lock(&self.threads).push(t),
            Err(e) => warn!(error = %e, "could not start background staging"),
        }
    }

    /// Lets in-order readers be served from pages pushed through `sink` ([`crate::walk`]).
    pub fn set_page_sink(&self, sink: Option<Arc<dyn crate::sink::PageSink>>) {
        self.files.set_page_sink(sink);
    }

    /// Whether streaming readers of large files get the file pushed ahead of them
    /// ([`crate::stream`]; off by default).
    pub fn set_push_ahead(&self, on: bool) {
        self.files.set_push_ahead(on);
    }

    /// Starts the hint socket in the cache directory; view renders go to `pool` (the mount's
    /// view pool; `None`: on the hint worker itself). Returns the socket's path.
    pub fn start_hints(self: &Arc<Self>, pool: Option<Offload>) -> std::io::Result<PathBuf> {
        // Weak: the server belongs to the core, which must not keep itself alive.
        let core = Arc::downgrade(self);
        let stats_now: crate::hints::StatsNow = Arc::new(move || {
            let c = core.upgrade()?;
            let mut s = c.snapshot();
            let json = serde_json::to_string(&s).ok()?;
            if json.len() < stagefs_protocol::MAX_STATS_REPLY {
                return Some(json);
            }
            // Long error messages: the counters matter more than the list.
            s.errors.clear();
            serde_json::to_string(&s).ok()
        });
        let server = self.hints.start(&self.cfg.cache_dir, pool, stats_now)?;
        let path = server.path().to_path_buf();
        *lock(&self.hint_server) = Some(server);
        Ok(path)
    }

    /// The hint socket, while it runs.
    pub fn hint_socket(&self) -> Option<PathBuf> {
        lock(&self.hint_server)
            .as_ref()
            .map(|s| s.path().to_path_buf())
    }

    /// Stops background work and writes the cache log; call after the session ends.
    pub fn shutdown(&self) {
        self.stop_background();
        if let Err(e) = self.store.close() {
            warn!(error = %e, "could not write the cache log at unmount");
        }
    }

    /// Stops background work *without* writing the cache log, as a killed daemon would
    /// (what the last flush wrote is all a later mount finds). For crash tests.
    pub fn abandon(&self) {
        self.stop_background();
        self.store.abandon();
    }

    /// Ends every background thread (hints, fetches, walker, pushers, verification, staging)
    /// and waits for them: what [`shutdown`](Self::shutdown) and [`abandon`](Self::abandon)
    /// share before they close or drop the cache.
    fn stop_background(&self) {
        self.stop.store(true, Relaxed);
        // Taken out first: the server's threads are joined without the lock held.
        let hint_server = lock(&self.hint_server).take();
        if let Some(s) = hint_server {
            s.stop();
        }
        // The sink holds a descriptor of the FUSE session: let it go with the session.
        self.files.set_page_sink(None);
        self.fetcher.shutdown();
        self.files.stop();
        self.store.set_on_complete(None);
        self.store.set_on_trust(None);
        self.direct.table().close();
        self.verify.close();
        let threads: Vec<_> = lock(&self.threads).drain(..).collect();
        for t in threads {
            let _ = t.join();
        }
    }

    /// Whether [`shutdown`](Self::shutdown) (or [`abandon`](Self::abandon)) has begun.
    pub fn stopped(&self) -> bool {
        self.stop.load(Relaxed)
    }
}
