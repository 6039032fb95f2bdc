//! The mount's cache log loader (stagefs-prefetch): any bytes as `v2/cache.log` of a cache
//! directory, then opening the cache and reading every slot it claims to hold. The loader
//! must never panic, abort or allocate from a size it read without checking it; whatever it
//! accepts must be served only after the block's checksum verifies (so a read is `None` or
//! bytes, never a panic).
#![no_main]

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use libfuzzer_sys::fuzz_target;
use stagefs_fuzz::count_only_escaping_panics;
use stagefs_prefetch::{CacheStore, Stats, StoreConfig};

/// One cache directory for the whole run (in RAM when /dev/shm is there): a fresh one per
/// input would make the fuzzer measure mkdir.
fn dir() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let base = if std::path::Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        let d = base.join(format!("stagefs-fuzz-cache-{}", std::process::id()));
        std::fs::create_dir_all(d.join("v2")).expect("fuzz cache directory");
        use std::os::unix::fs::PermissionsExt;
        for p in [d.clone(), d.join("v2")] {
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o700)).expect("mode");
        }
        d
    })
}

fuzz_target!(init: count_only_escaping_panics(), |data: &[u8]| {
    let dir = dir();
    std::fs::write(dir.join("v2/cache.log"), data).expect("write the index");
    let cfg = StoreConfig {
        dir: dir.clone(),
        capacity: 64 << 20,
        direct_reads: false,
    };
    if let Ok((store, loaded)) = CacheStore::open(&cfg, Arc::new(Stats::default())) {
        for e in &loaded.entries {
            let _ = loaded.key(e);
            for slot in 0..e.slots.min(4) {
                let _ = store.read(e.id, slot);
            }
        }
    }
});
