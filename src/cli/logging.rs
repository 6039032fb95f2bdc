//! Logging set-up shared by the subcommands: `tracing` to stderr, level from `STAGEFS_LOG`
//! (`RUST_LOG` syntax), `info` by default for long-running commands.

use tracing_subscriber::EnvFilter;

/// Installs the stderr subscriber; `default` is the filter used when `STAGEFS_LOG` is unset.
pub fn init(default: &str) {
    let filter = EnvFilter::try_from_env("STAGEFS_LOG").unwrap_or_else(|_| EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .try_init();
}
