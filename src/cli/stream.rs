//! `stagefs stream`.

/// Arguments of `stagefs stream`.
#[derive(clap::Args, Debug)]
pub struct Args {}

/// Runs `stagefs stream`; returns the process exit code.
pub fn run(_args: Args) -> anyhow::Result<i32> {
    anyhow::bail!("stagefs stream is not available in this build yet")
}
