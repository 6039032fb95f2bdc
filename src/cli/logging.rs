//! Logging set-up shared by the subcommands: `tracing` to stderr, level from `STAGEFS_LOG`
//! (`RUST_LOG` syntax), `info` by default for long-running commands.

use tracing_subscriber::EnvFilter;

/// Installs the stderr subscriber; `default` is the filter used when `STAGEFS_LOG` is unset.
pub fn init(default: &str) {
    // fuser logs routine events (a second unmount attempt at exit) as warnings: keep its errors only.
    let filter = EnvFilter::try_from_env("STAGEFS_LOG")
        .unwrap_or_else(|_| EnvFilter::new(format!("{default},fuser=error")));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .try_init();
}
