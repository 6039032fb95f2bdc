"""The build backend of the root pyproject.toml: maturin's, with the `stagefs` binary added.

maturin packs one Rust crate per wheel: here the extension of gpu/python (`import stagefs`). The
`stagefs` command is another crate (the repository root), which maturin cannot build into the
same wheel (PyO3/maturin#368). So `build_wheel` first builds that binary with cargo, as
scripts/wheel does (`--features cuda`: CUDA loaded at run time, no toolkit needed), copies it to
`[tool.maturin] data`/scripts/, from where maturin packs it and pip installs it into the
environment's bin/, then hands over to maturin. maturin refuses a `data` folder that does not
exist, so the other hooks that read the configuration get an empty one; an editable install
(`pip install -e .`) gives the module only, as `maturin develop` does.

STAGEFS_WHEEL_DEBUG=1 builds both in the dev profile, as it does for scripts/wheel.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import maturin

# The PEP 517 hooks this backend leaves as maturin has them.
from maturin import (  # noqa: F401
    get_requires_for_build_editable,
    get_requires_for_build_sdist,
    get_requires_for_build_wheel,
)

ROOT = Path(__file__).resolve().parents[2]
# `[tool.maturin] data` of the root pyproject.toml.
DATA = ROOT / "target" / "pep517" / "stagefs.data"


def _pack_binary() -> None:
    debug = os.environ.get("STAGEFS_WHEEL_DEBUG", "0") == "1"
    profile = "dev" if debug else "release"
    if debug:
        os.environ.setdefault("MATURIN_PEP517_ARGS", "--profile dev")
    cargo = os.environ.get("CARGO", "cargo")
    cmd = [cargo, "build", "--profile", profile, "--features", "cuda", "--bin", "stagefs"]
    # cargo's output to stderr: pip shows it with -v, and on failure.
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=sys.stderr)
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    if not target.is_absolute():
        target = ROOT / target
    built = target / ("debug" if debug else "release") / "stagefs"
    scripts = DATA / "scripts"
    shutil.rmtree(DATA, ignore_errors=True)
    scripts.mkdir(parents=True)
    shutil.copy2(built, scripts / "stagefs")
    (scripts / "stagefs").chmod(0o755)


def _empty_data() -> None:
    DATA.mkdir(parents=True, exist_ok=True)


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    """maturin's, with the (empty) data folder it checks for."""
    _empty_data()
    return maturin.prepare_metadata_for_build_wheel(metadata_directory, config_settings)


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None):
    """maturin's, with the (empty) data folder it checks for."""
    _empty_data()
    return maturin.prepare_metadata_for_build_editable(metadata_directory, config_settings)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    """maturin's editable install: the module only."""
    shutil.rmtree(DATA, ignore_errors=True)
    _empty_data()
    return maturin.build_editable(wheel_directory, config_settings, metadata_directory)


def build_sdist(sdist_directory, config_settings=None):
    """maturin's source distribution."""
    _empty_data()
    return maturin.build_sdist(sdist_directory, config_settings)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    """The wheel: the extension module and the Python sources (maturin), and bin/stagefs."""
    _pack_binary()
    try:
        return maturin.build_wheel(wheel_directory, config_settings, metadata_directory)
    finally:
        shutil.rmtree(DATA, ignore_errors=True)
