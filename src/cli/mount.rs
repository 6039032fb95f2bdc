//! `stagefs mount` and `stagefs umount`.

/// Arguments of `stagefs mount`.
#[derive(clap::Args, Debug)]
pub struct Args {}

/// Arguments of `stagefs umount`.
#[derive(clap::Args, Debug)]
pub struct UmountArgs {}

/// Runs `stagefs mount`.
pub fn run(_args: Args) -> anyhow::Result<i32> {
    anyhow::bail!("not yet")
}

/// Runs `stagefs umount`.
pub fn umount(_args: UmountArgs) -> anyhow::Result<i32> {
    anyhow::bail!("not yet")
}
