//! Logging set-up shared by the subcommands: `tracing` to stderr, level from `STAGEFS_LOG`
//! (`RUST_LOG` syntax), `info` by default for long-running commands.
//!
//! Colour only when stderr is a terminal (and `NO_COLOR` is unset): the mount daemon's stderr
//! is its log file (`CACHE/stagefs.log`), and SLURM jobs send stderr to files, where ANSI
//! escape codes are only noise for `grep` and editors.

use std::io::IsTerminal;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, OnceLock};

use stagefs_prefetch::Stats;
use tracing_subscriber::EnvFilter;

/// Whether log lines may carry ANSI colour codes: stderr is a terminal and `NO_COLOR` is unset
/// (<https://no-color.org>).
pub fn colour() -> bool {
    std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty()) && std::io::stderr().is_terminal()
}

/// fuser's one error-level message from its reply path: a reply the kernel no longer wanted
/// (the request was interrupted, e.g. a reader killed mid-read). Routine, not an error of the
/// mount: counted into the stats (`replies_dropped`) instead of logged as ERROR.
fn is_dropped_reply(m: &tracing::Metadata<'_>) -> bool {
    *m.level() == tracing::Level::ERROR && m.target().starts_with("fuser::reply")
}

/// Where dropped replies are counted: the mount's statistics, once the mount has them (the
/// log is set up before the cache is opened).
static REPLY_STATS: OnceLock<Arc<Stats>> = OnceLock::new();

/// Counts the replies [`is_dropped_reply`] matches from now on into `stats`
/// (`replies_dropped`). The first call wins: a process serves one mount.
pub fn count_dropped_replies_in(stats: Arc<Stats>) {
    let _ = REPLY_STATS.set(stats);
}

/// Counts the replies [`is_dropped_reply`] matches.
struct DroppedReplies;

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for DroppedReplies {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        if is_dropped_reply(event.metadata()) {
            if let Some(stats) = REPLY_STATS.get() {
                stats.replies_dropped.fetch_add(1, Relaxed);
            }
        }
    }
}

/// Installs the stderr subscriber; `default` is the filter used when `STAGEFS_LOG` is unset.
pub fn init(default: &str) {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::Layer;
    // fuser logs routine events (a second unmount attempt at exit) as warnings: keep its errors only.
    let filter = EnvFilter::try_from_env("STAGEFS_LOG")
        .unwrap_or_else(|_| EnvFilter::new(format!("{default},fuser=error")));
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(colour())
        .with_target(false)
        .with_filter(tracing_subscriber::filter::filter_fn(|m| {
            !is_dropped_reply(m)
        }));
    let _ = tracing_subscriber::registry()
        .with(filter)
        .with(fmt)
        .with(DroppedReplies)
        .try_init();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_fuse_replies_are_counted_not_logged_as_errors() {
        // The message fuser logs (through the `log` crate) when the kernel gave up on a request.
        init("info");
        let stats = Arc::new(Stats::default());
        count_dropped_replies_in(stats.clone());
        tracing::error!(target: "fuser::reply", "Failed to send FUSE reply: No such file or directory");
        tracing::error!(target: "stagefs::other", "a real error is not counted");
        assert_eq!(stats.replies_dropped.load(Relaxed), 1);
    }
}
