"""One `pip install` gives a cluster user both the `stagefs` command and `import stagefs`
(issue 18): scripts/wheel packs the module and the binary; installed into a fresh venv, the
command is on the venv's PATH and its version is the package's."""

import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_installs_the_command_and_the_module(tmp_path):
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
    command = env_dir / "bin" / "stagefs"
    assert command.is_file() and os.access(command, os.X_OK), list((env_dir / "bin").iterdir())
    # `stagefs run` preloads the direct-read library found next to the command.
    assert (env_dir / "bin" / "libstagefs_direct.so").is_file(), list((env_dir / "bin").iterdir())
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
