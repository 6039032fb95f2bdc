//! `stagefs run`.

/// Arguments of `stagefs run`.
#[derive(clap::Args, Debug)]
pub struct Args {}

/// Runs `stagefs run`; returns the process exit code.
pub fn run(_args: Args) -> anyhow::Result<i32> {
    anyhow::bail!("stagefs run is not available in this build yet")
}
