"""Build the shm kernel at first use with ``torch.utils.cpp_extension``, cached per user.

The build directory is keyed by a hash of the source, the compiler flags, torch's version and
the CPU's instruction-set flags, so an upgrade or another machine never loads a stale binary.
No compiler (or a failed build) is not an error: the shm backend then runs its pure-torch path,
which ``arfuse doctor`` reports and the log says once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
from pathlib import Path
from types import ModuleType

from ... import log
from ...machine import cpu_flags

SOURCE = Path(__file__).resolve().parent / "csrc" / "shm_kernel.cpp"
_lock = threading.Lock()
_state: dict[str, object] = {}


def compile_flags() -> list[str]:
    """-O3, no FP contraction (results must not depend on FMA), and the ISA the CPU has."""
    flags = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-std=c++17"]
    cpu = cpu_flags()
    for flag, option in (("avx2", "-mavx2"), ("f16c", "-mf16c"), ("fma", "-mfma")):
        if flag in cpu:
            flags.append(option)
    return flags


def cache_root() -> Path:
    env = os.environ.get("ARFUSE_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "arfuse"


def build_key() -> str:
    import torch

    digest = hashlib.sha256()
    digest.update(SOURCE.read_bytes())
    digest.update(" ".join(compile_flags()).encode())
    digest.update(torch.__version__.encode())
    digest.update(" ".join(sorted(cpu_flags())).encode())
    return digest.hexdigest()[:16]


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")


def load() -> ModuleType | None:
    """The compiled kernel, or ``None`` with the reason in ``why_not()`` (built once)."""
    with _lock:
        if "module" in _state:
            module = _state["module"]
            return module if isinstance(module, ModuleType) else None
        module, why = _build()
        _state["module"], _state["why"] = module, why
        if module is None:
            log.once(logging.WARNING, "shm-build", "arfuse shm: using the pure-torch path "
                     "(slower): %s", why)
        return module


def why_not() -> str:
    """Why the compiled kernel is not used ("" when it is, or before the first ``load``)."""
    return str(_state.get("why", ""))


def _import(name: str, path: Path) -> ModuleType:
    import importlib.machinery
    import importlib.util

    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    if spec is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _build() -> tuple[ModuleType | None, str]:
    if os.environ.get("ARFUSE_SHM_PURE_TORCH") == "1":
        return None, "ARFUSE_SHM_PURE_TORCH=1"
    if compiler() is None:
        return None, "no C++ compiler found (install g++ or set CXX)"
    try:
        from torch.utils import cpp_extension
    except ImportError as exc:  # pragma: no cover - torch without cpp_extension
        return None, f"torch.utils.cpp_extension unavailable: {exc}"
    key = build_key()
    build_dir = cache_root() / f"shm-{key}"
    built = build_dir / f"arfuse_shm_{key}.so"
    if built.is_file():  # cached: import it directly (ninja's up-to-date check costs ~0.3 s)
        try:
            return _import(f"arfuse_shm_{key}", built), ""
        except ImportError:
            pass  # a broken cache entry: rebuild below
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        module = cpp_extension.load(
            name=f"arfuse_shm_{key}", sources=[str(SOURCE)], extra_cflags=compile_flags(),
            build_directory=str(build_dir), verbose=False)
    except Exception as exc:  # a broken toolchain means the pure path, not a crash
        return None, f"building the kernel failed: {type(exc).__name__}: {str(exc)[-500:]}"
    return module, ""
