//! The view pool: requests that may take long run on threads of their own, so the FUSE request
//! threads stay free for metadata, the control files and reads of other files.
//!
//! What may take long is everything under `.npy/`: a view's size needs its table's footer or
//! its image folder's scan, and a read renders (decodes images, table pages). A valid but slow
//! input (a 6144² progressive JPEG costs ~4 CPU-s; a Parquet file of 10^5 row groups) held every
//! FUSE thread before, so an `ls` of an unrelated folder waited tens of seconds, `stagefs
//! umount` hung on the stats file, and the session could not end. Now the adapter hands such a
//! request, with its reply, to this pool and returns at once.
//!
//! Threads: one per core the job has (`stagefs_views::job_cores`: its affinity mask and cgroup
//! quota, not the host's count; at least two): rendering is CPU work, more threads than cores
//! would only interleave it. Queue: [`QUEUE`] jobs; a job is a request and its reply (a few hundred
//! bytes), and the kernel itself bounds how many requests are outstanding (one per blocked
//! reader thread plus `max_background` read-ahead), so the bound is only a backstop: when it is
//! reached the FUSE thread waits for room (back-pressure), which is the old behaviour.
//! Threads are detached: the process ends them at exit, whatever they are rendering, so
//! unmounting and SIGTERM never wait for a render.

use crossbeam_channel::{bounded, Sender};

/// Jobs waiting for a thread before the FUSE threads wait too.
pub const QUEUE: usize = 4096;

type Job = Box<dyn FnOnce() + Send>;

/// A fixed set of threads running jobs from one bounded queue (clones share them).
#[derive(Clone)]
pub struct Offload {
    tx: Sender<Job>,
}

impl Offload {
    /// Starts `threads` threads (one per core when 0).
    pub fn new(threads: usize) -> std::io::Result<Offload> {
        let threads = match threads {
            0 => stagefs_views::job_cores().max(2),
            n => n,
        };
        let (tx, rx) = bounded::<Job>(QUEUE);
        for i in 0..threads {
            let rx = rx.clone();
            std::thread::Builder::new()
                .name(format!("stagefs-view-{i}"))
                .spawn(move || {
                    // Ends when every sender is gone (the session dropped its adapter).
                    for job in rx {
                        job();
                    }
                })?;
        }
        Ok(Offload { tx })
    }

    /// Runs `job` on a pool thread (waits for queue room only when [`QUEUE`] jobs are waiting).
    pub fn run(&self, job: impl FnOnce() + Send + 'static) {
        if let Err(e) = self.tx.send(Box::new(job)) {
            // Only when every pool thread is gone (they never exit while the adapter lives,
            // and a panicking job is caught inside it): run it here rather than drop a reply.
            (e.into_inner())();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc::channel;
    use std::time::{Duration, Instant};

    #[test]
    fn a_slow_job_does_not_hold_up_the_caller_or_other_jobs() {
        let pool = Offload::new(2).unwrap();
        let (tx, rx) = channel();
        let t0 = Instant::now();
        let slow = tx.clone();
        pool.run(move || {
            std::thread::sleep(Duration::from_millis(500));
            slow.send("slow").unwrap();
        });
        // The caller returned at once.
        assert!(t0.elapsed() < Duration::from_millis(400));
        pool.run(move || tx.send("fast").unwrap());
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap(), "fast");
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap(), "slow");
    }
}
