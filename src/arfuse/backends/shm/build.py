"""Build the shm kernel at first use with ``torch.utils.cpp_extension``, cached per user.

The kernel is ``csrc/*.cpp`` plus the headers they include (``csrc/*.h``). The build directory
is keyed by a hash of every one of those files, the compiler flags, torch's version, Python's
extension suffix, the CPU's instruction-set flags and the instruction set built for, so an
edit, an upgrade or another machine never loads a stale binary. No compiler (or a failed
build) is not an error: the shm backend then runs its pure-torch path, which ``arfuse doctor``
reports and the log says once.

Instruction sets (``csrc/vec.h`` picks the vector header from the compiler's target): the best
this CPU has of ``avx512`` (AVX-512 F/BW/VL/DQ, with AVX512_BF16 when present), ``avx2`` (with
F16C and FMA when present) and ``scalar`` (no vector code), or the one ``ARFUSE_SHM_ISA`` names
(also ``avx512-nobf16``: AVX-512 without AVX512_BF16; tests build every path the machine has;
one that it lacks is refused, not built). Every path gives the same bytes.

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


# best first; avx512-nobf16 is avx512 without AVX512_BF16's conversion, as on CPUs that lack
# it (Skylake-X, Ice Lake): the tests build it to check that path where the CPU has BF16
ISAS = ("avx512", "avx512-nobf16", "avx2", "scalar")
# what each needs of /proc/cpuinfo's flags, and what it uses where the CPU has it
_AVX512 = ("avx2", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq")
_ISA_NEEDS = {"avx512": _AVX512, "avx512-nobf16": _AVX512, "avx2": ("avx2",), "scalar": ()}
_ISA_OPTIONS = {"avx2": "-mavx2", "f16c": "-mf16c", "fma": "-mfma", "avx512f": "-mavx512f",
                "avx512bw": "-mavx512bw", "avx512vl": "-mavx512vl",
                "avx512dq": "-mavx512dq", "avx512_bf16": "-mavx512bf16",
                "3dnowprefetch": "-mprfchw"}  # Linux's name for PREFETCHW
_ISA_USES = {"avx512": (*_AVX512, "fma", "avx512_bf16", "3dnowprefetch"),
             "avx512-nobf16": (*_AVX512, "fma", "3dnowprefetch"),
             "avx2": ("avx2", "f16c", "fma", "3dnowprefetch"), "scalar": ("3dnowprefetch",)}


def host_isas() -> list[str]:
    """The instruction sets this CPU can run the kernel in, best first."""
    cpu = cpu_flags()
    return [isa for isa in ISAS if all(flag in cpu for flag in _ISA_NEEDS[isa])]


def isa_problem(isa: str) -> str:
    """Why the kernel cannot be built for ``isa`` here ("" when it can)."""
    if isa not in ISAS:
        return f"ARFUSE_SHM_ISA={isa!r} is not one of {', '.join(ISAS)}"
    missing = [flag for flag in _ISA_NEEDS[isa] if flag not in cpu_flags()]
    if missing:
        return f"ARFUSE_SHM_ISA={isa}: this CPU lacks {' '.join(missing)}"
    return ""


def target_isa() -> str:
    """``ARFUSE_SHM_ISA`` when set, else the best instruction set this CPU has."""
    return os.environ.get("ARFUSE_SHM_ISA", "").strip().lower() or host_isas()[0]


def compile_flags(isa: str | None = None) -> list[str]:
    """-O3, no FP contraction (results must not depend on FMA), the -m options of ``isa``
    (``target_isa()`` by default) that the CPU has, and hidden symbols (only the module's entry
    point is exported, as pybind11 advises)."""
    isa = target_isa() if isa is None else isa
    flags = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-std=c++17", "-fvisibility=hidden"]
    cpu = cpu_flags()
    flags.extend(_ISA_OPTIONS[flag] for flag in _ISA_USES.get(isa, ()) if flag in cpu)
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
    digest.update(target_isa().encode() + b"\0")
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
        if quant in (1, 4):
            result.append(x.new_empty((tokens, hidden), dtype=torch.float8_e4m3fn))
            if quant == 4:  # fp8_dynamic: a float32 scale per token
                result.append(x.new_empty((tokens, 1), dtype=torch.float32))
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
    problem = isa_problem(target_isa())
    if problem:  # a binary for an instruction set the CPU lacks would die of SIGILL
        return None, problem
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
