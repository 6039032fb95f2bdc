//! `stagefs stat`.

/// Arguments of `stagefs stat`.
#[derive(clap::Args, Debug)]
pub struct Args {}

/// Runs `stagefs stat`; returns the process exit code.
pub fn run(_args: Args) -> anyhow::Result<i32> {
    anyhow::bail!("stagefs stat is not available in this build yet")
}
