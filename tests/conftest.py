from __future__ import annotations

import os
import sys

import pytest

# the rank bodies (ranks_*.py) and the tests import the modules here by name
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("ARFUSE_LOG", "warning")


@pytest.fixture(scope="session", autouse=True)
def shm_kernel_built() -> None:
    """Build the shm kernel once, before any test starts ranks (about a minute the first time on
    a 2-core machine; cached per user afterwards)."""
    from arfuse.backends.shm import build as shm_build

    shm_build.load()


# What makes a test slow: it starts processes (ranks, jobs, a CLI) or builds kernels. Tests
# marked ``smoke`` stay in the quick set anyway (one multi-rank check per backend).
_STARTS_PROCESSES = ("run_ranks(", "subprocess", "Popen(", "run_one(", "_exit_after",
                     "build_for(", "targets.main(", "mp.get_context", "os.fork(")
_SLOW_MODULES = {"test_scenarios", "test_two_hosts", "test_soak", "test_isa_paths",
                 "test_process_exit", "test_cli"}


def _starts_processes(item: pytest.Item) -> bool:
    import inspect

    function = getattr(item, "function", None)
    if function is None:
        return False
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return False
    return any(word in source for word in _STARTS_PROCESSES)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """``pytest -m "not slow"``: the pure and single-process tests and the smoke tests, for
    running often; the whole suite (what CI runs) includes the slow ones."""
    for item in items:
        if "smoke" in item.keywords:
            continue
        module = getattr(item, "module", None)
        name = module.__name__.rsplit(".", 1)[-1] if module is not None else ""
        if name in _SLOW_MODULES or _starts_processes(item):
            item.add_marker(pytest.mark.slow)
