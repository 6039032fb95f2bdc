//! `stagefs convert --to parquet`.

/// Runs the conversion; returns the process exit code.
pub fn run(_args: &super::convert::Args) -> anyhow::Result<i32> {
    anyhow::bail!("stagefs convert --to parquet is not available in this build yet")
}
