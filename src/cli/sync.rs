//! `stagefs sync`.

/// Arguments of `stagefs sync`.
#[derive(clap::Args, Debug)]
pub struct Args {}

/// Runs `stagefs sync`; returns the process exit code.
pub fn run(_args: Args) -> anyhow::Result<i32> {
    anyhow::bail!("stagefs sync is not available in this build yet")
}
