"""One `pip install` gives a cluster user both the `stagefs` command and `import stagefs`
(issue 18): scripts/wheel packs the module and the binary; installed into a fresh venv, the
command is on the venv's PATH and its version is the package's, and its `stagefs run` has its
direct-read library (the binary carries it: issue 34)."""

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from conftest import fuse_missing

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A fresh venv with the wheel installed: (venv dir, its python)."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    built = subprocess.run(
        [str(ROOT / "scripts" / "wheel")],
        cwd=ROOT,
        env={**os.environ, "STAGEFS_WHEEL_DEBUG": "1", "STAGEFS_ENV_READY": "1"},
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    wheel = Path(built.stdout.strip().splitlines()[-1])
    assert wheel.name.startswith("stagefs-") and wheel.name.endswith(".whl"), wheel
    assert "abi3" in wheel.name and "manylinux" in wheel.name, wheel.name

    env_dir = tmp_path / "fresh"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    pip = subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--no-index", "--no-deps", str(wheel)],
        capture_output=True,
        text=True,
    )
    assert pip.returncode == 0, pip.stderr
    return env_dir, py


def test_wheel_installs_the_command_and_the_module(installed, tmp_path):
    env_dir, py = installed
    command = env_dir / "bin" / "stagefs"
    assert command.is_file() and os.access(command, os.X_OK), list((env_dir / "bin").iterdir())
    # Nothing beside it: the binary carries its direct-read library.
    assert not (env_dir / "bin" / "libstagefs_direct.so").exists()
    # On PATH as a user's activated environment has it, not through an absolute path.
    path_env = {**os.environ, "PATH": f"{env_dir / 'bin'}:/usr/bin:/bin"}
    helped = subprocess.run(["stagefs", "--help"], env=path_env, capture_output=True, text=True)
    assert helped.returncode == 0 and "mount" in helped.stdout, helped.stderr
    version = subprocess.run(["stagefs", "--version"], env=path_env, capture_output=True, text=True)
    module = subprocess.run(
        [str(py), "-c", "import stagefs, importlib.metadata as m; print(m.version('stagefs'))"],
        env=path_env,
        capture_output=True,
        text=True,
        cwd=tmp_path,  # not the checkout: the installed package, not the source tree
    )
    assert module.returncode == 0, module.stderr
    assert version.stdout.split() == ["stagefs", module.stdout.strip()], (version.stdout, module.stdout)


def test_the_installed_command_runs_jobs_with_direct_reads(installed, tmp_path):
    """The wheel's `stagefs run` says direct reads are on, and a small file read twice in the
    job is read direct the second time (through the mount's direct table)."""
    why = fuse_missing()
    if why:
        pytest.skip(f"skipped: needs FUSE: {why}")
    env_dir, _ = installed
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(os.urandom(100_000))
    mnt, cache = tmp_path / "mnt", tmp_path / "cache"
    script = (
        "import os, sys, time\n"
        "p = os.path.join(sys.argv[1], 'a.bin')\n"
        "want = open(sys.argv[2], 'rb').read()\n"
        "assert open(p, 'rb').read() == want\n"
        "deadline = time.time() + 30\n"
        "while True:\n"
        "    fd = os.open(p, os.O_RDONLY)\n"
        "    direct = not os.readlink(f'/proc/self/fd/{fd}').startswith(sys.argv[1])\n"
        "    assert os.read(fd, 1 << 20) == want\n"
        "    os.close(fd)\n"
        "    if direct or time.time() > deadline: break\n"
        "    time.sleep(0.05)\n"
        "print('direct' if direct else 'mount')\n"
    )
    run = subprocess.run(
        [str(env_dir / "bin" / "stagefs"), "run", "--mount", f"{src}:{mnt}:{cache}", "--",
         sys.executable, "-c", script, str(mnt), str(src / "a.bin")],
        capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "direct reads: on" in run.stderr, run.stderr
    assert run.stdout.strip() == "direct", run.stderr
