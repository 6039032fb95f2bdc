//! Builds the direct-read library (`direct/preload`, a `cdylib`) and embeds it in the `stagefs`
//! binary, so that every install route — `cargo install --path .`, a plain `cargo build
//! --release`, `pip install .`, the wheel — gives `stagefs run` its library: the binary writes
//! it out at run time (src/cli/preload.rs). Cargo cannot depend on another package's `cdylib`
//! artifact on stable, so this runs a nested `cargo build -p stagefs-preload` of the same
//! workspace, with the same profile and target, into a target directory of its own under
//! `OUT_DIR` (no lock shared with the outer build), through the outer build's jobserver.
//!
//! `STAGEFS_PRELOAD_LIB=PATH` embeds a library built elsewhere instead (packagers). A failed
//! nested build fails this build: a binary without its library would silently read every
//! staged file through FUSE.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    let manifest = PathBuf::from(env("CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(env("OUT_DIR"));
    let dest = out.join("libstagefs_direct.so");
    println!("cargo:rerun-if-env-changed=STAGEFS_PRELOAD_LIB");
    if let Some(lib) = std::env::var_os("STAGEFS_PRELOAD_LIB") {
        println!("cargo:rerun-if-changed={}", Path::new(&lib).display());
        copy(Path::new(&lib), &dest);
        return;
    }
    for p in [
        "direct/preload/src",
        "direct/preload/Cargo.toml",
        "protocol/src",
        "protocol/Cargo.toml",
        "Cargo.lock",
    ] {
        println!("cargo:rerun-if-changed={}", manifest.join(p).display());
    }
    // `release` for release-like profiles (release, profiling), else the dev profile: the
    // library is built as the binary is.
    let profile = if env("PROFILE") == "release" {
        "release"
    } else {
        "dev"
    };
    let target = env("TARGET");
    let host = env("HOST");
    let target_dir = out.join("preload-target");
    let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.arg("build")
        .arg("--quiet")
        .args(["-p", "stagefs-preload", "--profile", profile])
        .arg("--manifest-path")
        .arg(manifest.join("Cargo.toml"))
        .arg("--target-dir")
        .arg(&target_dir)
        // Set for build scripts, they would steer the nested build elsewhere.
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("CARGO_BUILD_TARGET_DIR");
    let mut built = target_dir.clone();
    if target != host {
        cmd.args(["--target", &target]);
        built.push(&target);
    }
    built.push(if profile == "release" {
        "release"
    } else {
        "debug"
    });
    built.push("libstagefs_direct.so");
    match cmd.status() {
        Ok(s) if s.success() => copy(&built, &dest),
        Ok(s) => panic!(
            "building the direct-read library (cargo build -p stagefs-preload) failed: {s}; \
             set STAGEFS_PRELOAD_LIB=PATH to embed one built elsewhere"
        ),
        Err(e) => panic!("cannot run cargo to build the direct-read library: {e}"),
    }
}

fn env(k: &str) -> String {
    std::env::var(k).unwrap_or_else(|_| panic!("{k} is not set for the build script"))
}

fn copy(from: &Path, to: &Path) {
    if let Err(e) = std::fs::copy(from, to) {
        panic!("copying the direct-read library {}: {e}", from.display());
    }
}
