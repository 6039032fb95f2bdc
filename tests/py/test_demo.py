"""The README's first command, scripts/demo, passes end to end: mount, cold and warm epochs,
views, the Loader, stat, unmount (issue 18). It exits non-zero naming the failed step."""

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_demo_runs_the_main_job_on_the_sample(tmp_path):
    run = subprocess.run(
        [str(ROOT / "scripts" / "demo")],
        cwd=ROOT,
        env={**os.environ, "DEMO_DIR": str(tmp_path), "STAGEFS_ENV_READY": "1"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    for step in ["epoch 1", "epoch 2", "tensor views", "stagefs.Loader", "stagefs stat", "demo passed"]:
        assert step in out, (step, out[-4000:])
    assert "FAILED at step" not in out
