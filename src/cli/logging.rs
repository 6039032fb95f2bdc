//! Logging set-up shared by the subcommands: `tracing` to stderr, level from `STAGEFS_LOG`
//! (`RUST_LOG` syntax), `info` by default for long-running commands.
//!
//! Colour only when stderr is a terminal (and `NO_COLOR` is unset): the mount daemon's stderr
//! is its log file (`CACHE/stagefs.log`), and SLURM jobs send stderr to files, where ANSI
//! escape codes are only noise for `grep` and editors.

use std::io::IsTerminal;
use tracing_subscriber::EnvFilter;

/// Whether log lines may carry ANSI colour codes: stderr is a terminal and `NO_COLOR` is unset
/// (<https://no-color.org>).
pub fn colour() -> bool {
    std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty()) && std::io::stderr().is_terminal()
}

/// Installs the stderr subscriber; `default` is the filter used when `STAGEFS_LOG` is unset.
pub fn init(default: &str) {
    // fuser logs routine events (a second unmount attempt at exit) as warnings: keep its errors only.
    let filter = EnvFilter::try_from_env("STAGEFS_LOG")
        .unwrap_or_else(|_| EnvFilter::new(format!("{default},fuser=error")));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(colour())
        .with_target(false)
        .try_init();
}
