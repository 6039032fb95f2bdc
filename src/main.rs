//! `stagefs`: stage HPC datasets onto node-local scratch, view them as tensors, stream them to
//! the GPU and bring job outputs home safely. This binary is a thin CLI over the library crates.

mod cli;

use clap::{Parser, Subcommand};

/// Ends GPU starvation on HPC clusters: mount a dataset from slow shared storage through a
/// read-ahead cache on node-local scratch, see tables and images as NumPy arrays, clean tables
/// out of core, stream tensors to the GPU, and copy job outputs back safely.
#[derive(Parser)]
#[command(name = "stagefs", version, about, long_about = None, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
// Parsed once at start-up: the size of the largest variant does not matter.
#[allow(clippy::large_enum_variant)]
enum Command {
    /// Mount SOURCE at MOUNTPOINT through a read-ahead cache on scratch (read-only).
    Mount(cli::mount::Args),
    /// Write SOURCE's metadata snapshot to a file, so that `mount --index FILE` lists nothing.
    Index(cli::index::Args),
    /// Unmount a stagefs mount cleanly (also clears the mount of a killed daemon).
    ///
    /// Returns once the daemon has written its cache log and exited, so the next mount of the
    /// same cache can start at once (it says what it waits for after a few seconds).
    Umount(cli::mount::UmountArgs),
    /// Show a mount's cache statistics: is the job waiting on storage?
    Stat(cli::stat::Args),
    /// Convert a dataset offline: tables/images to .npy, or clean CSV/Parquet to Parquet.
    Convert(cli::convert::Args),
    /// Copy new and changed files from scratch to persistent storage, crash-safely.
    Sync(cli::sync::Args),
    /// Mount, run a command, sync its outputs periodically and at exit or on SLURM's warning.
    Run(cli::run::Args),
    /// Stream .npy tensors into GPU (or host) memory and report who waited on whom.
    Stream(cli::stream::Args),
}

/// Commands that print a report die quietly when their reader goes away (`stagefs stream --json
/// | head`), as coreutils do, instead of panicking in `println!` on EPIPE. Only these: the
/// daemon keeps SIGPIPE ignored (Rust's default), so a hint-socket peer that closes cannot
/// kill the mount.
fn default_sigpipe() {
    // SAFETY: sets the disposition of one signal to its default, before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

fn main() {
    let cli = Cli::parse();
    if matches!(cli.command, Command::Stat(_) | Command::Stream(_)) {
        default_sigpipe();
    }
    let result = match cli.command {
        Command::Mount(args) => cli::mount::run(args),
        Command::Index(args) => cli::index::run(args),
        Command::Umount(args) => cli::mount::umount(args),
        Command::Stat(args) => cli::stat::run(args),
        Command::Convert(args) => {
            cli::logging::init("warn");
            match args.to {
                cli::convert::Target::Npy => cli::convert_npy::run(&args),
                cli::convert::Target::Parquet => cli::convert_parquet::run(&args),
            }
        }
        Command::Sync(args) => cli::sync::run(args),
        Command::Run(args) => cli::run::run(args),
        Command::Stream(args) => cli::stream::run(args),
    };
    match result {
        Ok(code) => std::process::exit(code),
        Err(err) => {
            eprintln!("stagefs: error: {err:#}");
            std::process::exit(1);
        }
    }
}
