from __future__ import annotations

import os
import sys

import pytest

# the multi-process workers import these test helpers by module name
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("ARFUSE_LOG", "warning")


@pytest.fixture(scope="session", autouse=True)
def shm_kernel_built() -> None:
    """Build the shm kernel once, before any test starts ranks (about 40 s the first time on
    a 2-core machine; cached per user afterwards)."""
    from arfuse.backends.shm import build as shm_build

    shm_build.load()
