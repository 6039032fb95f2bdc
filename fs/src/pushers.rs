//! The pusher threads: they take pushes from the queue that [`Files`] fills
//! ([`crate::stream`] says what is pushed and why), read and verify the blocks through
//! [`Files::cached_block`] and hand them to the page sink.
//!
//! [`PUSHERS`] threads over one bounded queue of [`QUEUE`] pushes, started and owned by
//! [`crate::fscore::FsCore`]; they end when [`Files::stop`] closes the queue.

use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::{Arc, Mutex};

use stagefs_prefetch::locks::lock;
use stagefs_prefetch::{block_count, BLOCK_SIZE};
use tracing::debug_span;

use crate::files::Files;
use crate::stream::{Push, PUSHERS, QUEUE};

/// Starts the pusher threads over `files` and gives it their queue.
pub(crate) fn start(files: &Arc<Files>) -> std::io::Result<()> {
    let (tx, rx) = sync_channel::<Push>(QUEUE);
    let rx = Arc::new(Mutex::new(rx));
    for i in 0..PUSHERS {
        let (files, rx) = (files.clone(), rx.clone());
        std::thread::Builder::new()
            .name(format!("stagefs-push-{i}"))
            .spawn(move || run(&files, &rx))?;
    }
    files.set_pushers(tx);
    Ok(())
}

fn run(files: &Files, rx: &Mutex<Receiver<Push>>) {
    loop {
        let next = lock(rx).recv();
        let Ok(p) = next else { return };
        let Some(sink) = files.page_sink() else {
            continue;
        };
        let stats = files.fetcher().stats();
        let pushed = |n: usize| stats.bytes_pushed.fetch_add(n as u64, Relaxed);
        match p {
            Push::Blocks {
                ino,
                entry,
                size,
                blocks,
                read_to,
            } => {
                let _span = debug_span!("stream push", ino, from = blocks.start).entered();
                for slot in blocks.start..blocks.end.min(block_count(size)) {
                    let passed = |r: &Arc<AtomicU64>| r.load(Relaxed) > slot * BLOCK_SIZE;
                    if read_to.as_ref().is_some_and(passed) {
                        continue;
                    }
                    // Read and checksummed as for a reader: a corrupt block is dropped, never
                    // pushed.
                    let Some(data) = files.cached_block(entry, slot as u32) else {
                        break;
                    };
                    if !sink.store(ino, slot * BLOCK_SIZE, &data) {
                        break;
                    }
                    pushed(data.len());
                }
            }
            Push::Bytes { ino, offset, data } => {
                let _span = debug_span!("block rest push", ino, offset).entered();
                if sink.store(ino, offset, &data) {
                    pushed(data.len());
                }
            }
        }
    }
}
