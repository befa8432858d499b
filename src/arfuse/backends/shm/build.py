"""Build the shm kernel at first use with ``torch.utils.cpp_extension``, cached per user.

The kernel is ``csrc/*.cpp`` plus the headers they include (``csrc/*.h``). The build directory
is keyed by a hash of every one of those files, the compiler flags, torch's version, Python's
extension suffix and the CPU's instruction-set flags, so an edit, an upgrade or another machine
never loads a stale binary. No compiler (or a failed build) is not an error: the shm backend
then runs its pure-torch path, which ``arfuse doctor`` reports and the log says once.

The cache is private: its directory is created with mode 0700, and a cache directory, build
directory or binary that another user owns, or that group or others may write, is never
loaded (someone else could have put code there): the kernel is then built in a fresh private
temporary directory instead, and the log says why.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import shutil
import stat
import sysconfig
import tempfile
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

from ... import log
from ...machine import cpu_flags

CSRC = Path(__file__).resolve().parent / "csrc"
_lock = threading.Lock()
_state: dict[str, object] = {}
_fake_registered: list[bool] = []


def sources() -> list[Path]:
    """The translation units, compiled together into one extension module."""
    return sorted(CSRC.glob("*.cpp"))


def kernel_files() -> list[Path]:
    """Every file the build reads: the sources and the headers they include."""
    return sorted(p for p in CSRC.iterdir() if p.suffix in (".cpp", ".h"))


def compile_flags() -> list[str]:
    """-O3, no FP contraction (results must not depend on FMA), the ISA the CPU has, and
    hidden symbols (only the module's entry point is exported, as pybind11 advises)."""
    flags = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-std=c++17", "-fvisibility=hidden"]
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
    for path in kernel_files():  # a header edit must rebuild as much as a source edit
        digest.update(path.name.encode() + b"\0")
        digest.update(path.read_bytes())
    digest.update(" ".join(compile_flags()).encode())
    digest.update(torch.__version__.encode())
    digest.update(str(sysconfig.get_config_var("EXT_SUFFIX")).encode())
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
        if module is not None:
            try:
                _attach(module)
            except Exception as exc:  # an old or foreign binary: the pure path, not a crash
                module, why = None, f"the kernel does not work: {type(exc).__name__}: {exc}"
        _state["module"], _state["why"] = module, why
        if module is None:
            log.once(logging.WARNING, "shm-build", "arfuse shm: using the pure-torch path "
                     "(slower): %s", why)
        return module


def why_not() -> str:
    """Why the compiled kernel is not used ("" when it is, or before the first ``load``)."""
    return str(_state.get("why", ""))


def _attach(module: ModuleType) -> None:
    """Hand the kernel arfuse's error classes and give its torch operator a fake."""
    from ...errors import CallTimeout, MismatchedCall, WorkspaceBroken

    module.set_error_types(CallTimeout, MismatchedCall, WorkspaceBroken)
    _register_fake()


def _register_fake() -> None:
    """Shapes of ``torch.ops.arfuse.shm_fused_allreduce*`` without running it (torch.compile)."""
    if _fake_registered:
        return
    _fake_registered.append(True)
    import torch

    def outputs(x: torch.Tensor, weight: torch.Tensor | None, quant: int, swizzled: bool,
                out: torch.Tensor | None, residual_out: torch.Tensor | None) -> list[Any]:
        if x.dim() != 2:
            raise ValueError(f"x must be 2-D [tokens, hidden], got shape {tuple(x.shape)}")
        tokens, hidden = x.shape
        result = [out if out is not None else x.new_empty((tokens, hidden))]
        if weight is not None:
            result.append(residual_out if residual_out is not None
                          else x.new_empty((tokens, hidden)))
        if quant == 1:
            result.append(x.new_empty((tokens, hidden), dtype=torch.float8_e4m3fn))
        elif quant == 2:
            cols = hidden // 16
            result.append(x.new_empty((tokens, hidden // 2), dtype=torch.uint8))
            shape = (((tokens + 127) // 128 * 128, (cols + 3) // 4 * 4) if swizzled
                     else (tokens, cols))
            result.append(x.new_empty(shape, dtype=torch.uint8))
        return result

    def fake(handle: int, x: torch.Tensor, residual: torch.Tensor | None,
             weight: torch.Tensor | None, eps: float, weight_bias: float, quant: int,
             scale: float, swizzled: bool, out: torch.Tensor | None = None,
             residual_out: torch.Tensor | None = None) -> list[Any]:
        return outputs(x, weight, quant, swizzled, out, residual_out)

    try:
        torch.library.register_fake("arfuse::shm_fused_allreduce")(fake)
        torch.library.register_fake("arfuse::shm_fused_allreduce_functional")(fake)
    except (AttributeError, RuntimeError) as exc:  # an older torch: no torch.compile support
        log.logger.debug("arfuse shm: no fake for the torch operator: %s", exc)


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


def unsafe(path: Path, follow_symlinks: bool = False) -> str:
    """Why ``path`` must not be trusted ("" when it may): a symbolic link (unless followed),
    owned by another user, or writable by group or others."""
    info = os.stat(path, follow_symlinks=follow_symlinks)
    if stat.S_ISLNK(info.st_mode):
        return "is a symbolic link"
    if info.st_uid != os.geteuid():
        return f"is owned by uid {info.st_uid}, not by this user (uid {os.geteuid()})"
    if info.st_mode & 0o022:
        return f"is writable by group or others (mode {stat.S_IMODE(info.st_mode):o})"
    return ""


def _private_temp_dir() -> Path:
    """A fresh directory only this user can enter, removed at exit."""
    path = Path(tempfile.mkdtemp(prefix="arfuse-shm-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def _refuse(path: Path, reason: str) -> Path:
    fallback = _private_temp_dir()
    log.logger.warning("arfuse shm: not using the kernel cache at %s: it %s; building the "
                       "kernel in %s instead (fix the cache's owner and mode, or set "
                       "ARFUSE_CACHE_DIR)", path, reason, fallback)
    return fallback


def _build_dir(key: str) -> Path:
    """This key's build directory in the cache, or a private temporary one when the cache (or
    the entry) is not safe to use."""
    root = cache_root()
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        reason = unsafe(root, follow_symlinks=True)
    except OSError as exc:
        reason = f"cannot be used ({type(exc).__name__}: {exc})"
    if reason:
        return _refuse(root, reason)
    build_dir = root / f"shm-{key}"
    built = build_dir / f"arfuse_shm_{key}.so"
    for path in (build_dir, built):
        if os.path.lexists(path):
            reason = unsafe(path)
            if reason:
                return _refuse(path, reason)
    build_dir.mkdir(mode=0o700, exist_ok=True)
    return build_dir


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
    try:
        build_dir = _build_dir(key)
    except OSError as exc:
        return None, f"no build directory: {type(exc).__name__}: {exc}"
    built = build_dir / f"arfuse_shm_{key}.so"
    if built.is_file():  # cached: import it directly (ninja's up-to-date check costs ~0.3 s)
        try:
            return _import(f"arfuse_shm_{key}", built), ""
        except ImportError:
            pass  # a broken cache entry: rebuild below
    try:
        module = cpp_extension.load(
            name=f"arfuse_shm_{key}", sources=[str(p) for p in sources()],
            extra_cflags=compile_flags(), extra_include_paths=[str(CSRC)],
            build_directory=str(build_dir), verbose=False)
    except Exception as exc:  # a broken toolchain means the pure path, not a crash
        return None, f"building the kernel failed: {type(exc).__name__}: {str(exc)[-500:]}"
    return module, ""
