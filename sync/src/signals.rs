//! Stop signals for `--every` loops: record the last SIGTERM/SIGINT/SIGUSR1 instead of dying, so
//! that the loop can run one last pass before it exits.
//!
//! Sleeping polls the flag every [`POLL`]: simpler than a self-pipe, and 50 ms is instant next to
//! sync periods of seconds to minutes.

use signal_hook::SigId;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often a sleeping loop looks at the flag.
const POLL: Duration = Duration::from_millis(50);

/// Catches a set of signals and remembers the last one received.
pub struct StopSignals {
    last: Arc<AtomicUsize>,
    ids: Vec<SigId>,
}

impl StopSignals {
    /// Installs handlers for `signals` (e.g. `[SIGTERM, SIGINT, SIGUSR1]`).
    pub fn install(signals: &[i32]) -> std::io::Result<StopSignals> {
        let last = Arc::new(AtomicUsize::new(0));
        let mut ids = Vec::with_capacity(signals.len());
        for &sig in signals {
            let value = usize::try_from(sig).unwrap_or(0);
            ids.push(signal_hook::flag::register_usize(
                sig,
                Arc::clone(&last),
                value,
            )?);
        }
        Ok(StopSignals { last, ids })
    }

    /// The signal received so far, if any.
    pub fn received(&self) -> Option<i32> {
        match self.last.load(Ordering::SeqCst) {
            0 => None,
            s => i32::try_from(s).ok(),
        }
    }

    /// Sleeps for `duration` or until a signal arrives; returns the signal, if any.
    pub fn sleep(&self, duration: Duration) -> Option<i32> {
        let end = Instant::now() + duration;
        loop {
            if let Some(sig) = self.received() {
                return Some(sig);
            }
            let now = Instant::now();
            if now >= end {
                return None;
            }
            std::thread::sleep(POLL.min(end - now));
        }
    }
}

impl Drop for StopSignals {
    fn drop(&mut self) {
        for id in self.ids.drain(..) {
            signal_hook::low_level::unregister(id);
        }
    }
}

/// The conventional name of a signal number ("SIGTERM"), for messages.
pub fn name(sig: i32) -> String {
    signal_hook::low_level::signal_name(sig)
        .map(str::to_string)
        .unwrap_or_else(|| format!("signal {sig}"))
}
