"""Shared by the Python tests: modules that mount FUSE are skipped, with the reason, where this
machine cannot mount (no /dev/fuse, or no fusermount3 for a normal user). Under CI=true they fail
instead: CI must run them (scripts/env.sh sets the machine up as root)."""

import os
import shutil

import pytest

# Test modules that mount stagefs.
NEEDS_FUSE = {"test_mount_views", "test_loader_mount", "test_loader_hints", "test_demo",
              "test_loader_direct", "test_direct_libraries"}


def fuse_missing():
    """Why FUSE mounts cannot work here, or None."""
    try:
        os.close(os.open("/dev/fuse", os.O_RDWR))
    except OSError as e:
        return f"/dev/fuse cannot be opened ({e.strerror}); install fuse3"
    if os.geteuid() != 0 and shutil.which("fusermount3") is None:
        return "fusermount3 is not installed (package fuse3)"
    return None


def pytest_collection_modifyitems(config, items):
    why = fuse_missing()
    if why is None:
        return
    in_ci = os.environ.get("CI") in ("true", "1")
    for item in items:
        if item.module.__name__.rsplit(".", 1)[-1] not in NEEDS_FUSE:
            continue
        if in_ci:
            item.add_marker(pytest.mark.usefixtures("_fail_needs_fuse"))
        else:
            item.add_marker(pytest.mark.skip(reason=f"skipped: needs FUSE: {why}"))


@pytest.fixture
def _fail_needs_fuse():
    pytest.fail(f"CI must run this test, but this machine cannot mount: {fuse_missing()}")
