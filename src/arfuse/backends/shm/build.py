"""Build the shm kernel at first use with ``torch.utils.cpp_extension``, cached per user.

The kernel is ``csrc/*.cpp`` plus the headers they include (``csrc/*.h`` and the core's
``arfuse/csrc/*.h``, the constants every backend shares), compiled as one translation unit
(``csrc/kernel.cpp`` includes every other ``.cpp``): torch's headers, most of a build's time,
are then read once, not once per file. The build directory
is keyed by a hash of every one of those files, the compiler flags, torch's version, Python's
extension suffix, the CPU's instruction-set flags and the instruction set built for, so an
edit, an upgrade or another machine never loads a stale binary. No compiler (or a failed
build) is not an error: the shm backend then runs its pure-torch path, which ``arfuse doctor``
reports and the log says once. A build takes about a minute, so the log says so, once, before it
starts (with where it is cached).

Instruction sets: the best this CPU has of its architecture's (x86-64: ``avx512`` (AVX-512
F/BW/VL/DQ, with AVX512_BF16 when present), ``avx2`` (with F16C and FMA when present); aarch64:
``neon`` (Advanced SIMD, with BF16's conversions when the CPU has BF16)) and ``scalar`` (no
vector code), or the one ``ARFUSE_SHM_ISA`` names (also ``avx512-nobf16`` and ``neon-nobf16``:
without the BF16 conversion, as on CPUs that lack it; tests build every path the machine has;
one that it lacks is refused, not built). The build names its instruction set to the compiler
(``-DARFUSE_ISA_<NAME>``, read by ``csrc/vec.h``), never leaving it to the compiler's own target
macros: aarch64 compilers always define ``__ARM_NEON``, and the scalar path must stay
buildable. Every path gives the same bytes.

Where the kernel is cached, and how an entry is checked, verified and loaded: ``cache`` (the
path's checks: ``trust``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

from ... import ctables, log
from ...machine import cpu_flags
from . import cache
from .trust import Untrusted, fd_path

CSRC = Path(__file__).resolve().parent / "csrc"
# Python 3.11's sysconfig fills its variables at the first call without a lock, and a thread
# calling meanwhile reads them half filled (no EXT_SUFFIX: another build key; torch's
# cpp_extension reads them too). Filled here, at import, before any build runs in a thread.
sysconfig.get_config_vars()
_lock = threading.Lock()
_state: dict[str, object] = {}
_fake_registered: list[bool] = []


UNIT = "kernel.cpp"


def sources() -> list[Path]:
    """The one translation unit the compiler is given (``kernel.cpp``, which includes
    ``parts()``)."""
    return [CSRC / UNIT]


def parts() -> list[Path]:
    """The kernel's ``.cpp`` files that ``kernel.cpp`` includes."""
    return sorted(p for p in CSRC.glob("*.cpp") if p.name != UNIT)


def unit_problem() -> str:
    """What ``kernel.cpp`` gets wrong about ``parts()`` ("" when it includes each once): a file
    it leaves out would be missing from the module, one included twice defined twice."""
    included = re.findall(r'^#include "([^"]+\.cpp)"', (CSRC / UNIT).read_text(), re.MULTILINE)
    wanted = [p.name for p in parts()]
    if sorted(included) == wanted:
        return ""
    return (f"{CSRC / UNIT} must include each of {', '.join(wanted)} once; it includes "
            f"{', '.join(included) or 'none'}")


def include_dirs() -> list[Path]:
    """Where the kernel's headers are: its own, then the core's shared constants
    (``arfuse/csrc``: the call signature, the quantised outputs, the call limits)."""
    return [CSRC, ctables.CSRC]


def kernel_files() -> list[Path]:
    """Every file the build reads: the sources and the headers they include."""
    return sorted(p for directory in include_dirs() for p in directory.iterdir()
                  if p.suffix in (".cpp", ".h"))


# The machine's architecture, as the kernel's instruction sets are named for it.
ARCH = "aarch64" if platform.machine().lower() in ("aarch64", "arm64") else "x86_64"
# best first; a -nobf16 path is its family without the BF16 conversion, as on CPUs that lack
# it (Skylake-X, Ice Lake; Neoverse N1, Graviton 2): the tests build it to check that path where
# the CPU has BF16
_X86_ISAS = ("avx512", "avx512-nobf16", "avx2", "scalar")
_ARM_ISAS = ("neon", "neon-nobf16", "scalar")
ISAS = _ARM_ISAS if ARCH == "aarch64" else _X86_ISAS
# what each needs of /proc/cpuinfo's flags (x86 ``flags``, Arm ``Features``), and what it uses
# where the CPU has it
_AVX512 = ("avx2", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq")
_ISA_NEEDS = {"avx512": _AVX512, "avx512-nobf16": _AVX512, "avx2": ("avx2",),
              "neon": ("asimd",), "neon-nobf16": ("asimd",), "scalar": ()}
# Arm's extensions go into one -march; x86's are one -m option each
_ISA_OPTIONS = {"avx2": "-mavx2", "f16c": "-mf16c", "fma": "-mfma", "avx512f": "-mavx512f",
                "avx512bw": "-mavx512bw", "avx512vl": "-mavx512vl",
                "avx512dq": "-mavx512dq", "avx512_bf16": "-mavx512bf16",
                "3dnowprefetch": "-mprfchw",  # Linux's name for PREFETCHW
                "bf16": "+bf16"}
_ISA_USES = {"avx512": (*_AVX512, "fma", "avx512_bf16", "3dnowprefetch"),
             "avx512-nobf16": (*_AVX512, "fma", "3dnowprefetch"),
             "avx2": ("avx2", "f16c", "fma", "3dnowprefetch"),
             "neon": ("bf16",), "neon-nobf16": (),
             "scalar": ("3dnowprefetch",) if ARCH == "x86_64" else ()}
# BF16 came with Armv8.6; its conversions need no more of it than +bf16 on top of Armv8.2
_ARM_BASE = "-march=armv8.2-a"


def host_isas() -> list[str]:
    """The instruction sets this CPU can run the kernel in, best first."""
    cpu = cpu_flags()
    return [isa for isa in ISAS if all(flag in cpu for flag in _ISA_NEEDS[isa])]


def isa_problem(isa: str) -> str:
    """Why the kernel cannot be built for ``isa`` here ("" when it can)."""
    if isa not in ISAS:
        return (f"ARFUSE_SHM_ISA={isa!r} is not one of {', '.join(ISAS)} (the instruction sets "
                f"of {ARCH})")
    missing = [flag for flag in _ISA_NEEDS[isa] if flag not in cpu_flags()]
    if missing:
        return f"ARFUSE_SHM_ISA={isa}: this CPU lacks {' '.join(missing)}"
    return ""


def isa_reason(isa: str | None = None) -> str:
    """Why the kernel is built for ``isa`` (``target_isa()`` by default): named by
    ``ARFUSE_SHM_ISA``, or the best this CPU has, and which of the CPU's features it uses
    (``arfuse doctor`` and ``arfuse explain`` say it)."""
    isa = target_isa() if isa is None else isa
    cpu = cpu_flags()
    uses = [flag for flag in _ISA_USES.get(isa, ()) if flag in cpu]
    lacks = [flag for flag in ("avx512_bf16", "bf16") if flag in _ISA_USES.get(isa, ())
             and flag not in cpu]
    why = ("ARFUSE_SHM_ISA names it" if os.environ.get("ARFUSE_SHM_ISA", "").strip()
           else f"the best of {', '.join(ISAS)} this {ARCH} CPU has")
    detail = f"; uses {' '.join(uses)}" if uses else ""
    if lacks:
        detail += f"; the CPU lacks {' '.join(lacks)} (its conversion is done in integers)"
    return f"{isa}: {why}{detail}"


def target_isa() -> str:
    """``ARFUSE_SHM_ISA`` when set, else the best instruction set this CPU has."""
    return os.environ.get("ARFUSE_SHM_ISA", "").strip().lower() or host_isas()[0]


def compile_flags(isa: str | None = None) -> list[str]:
    """-O3, no FP contraction (results must not depend on FMA), the instruction set named to
    the kernel (``-DARFUSE_ISA_<NAME>``, see ``csrc/vec.h``), the target options of ``isa``
    (``target_isa()`` by default) that the CPU has, and hidden symbols (only the module's entry
    point is exported, as pybind11 advises)."""
    isa = target_isa() if isa is None else isa
    flags = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-std=c++17", "-fvisibility=hidden",
             "-fopenmp", f"-DARFUSE_ISA_{isa.split('-')[0].upper()}"]
    cpu = cpu_flags()
    options = [_ISA_OPTIONS[flag] for flag in _ISA_USES.get(isa, ()) if flag in cpu]
    if ARCH == "aarch64":
        flags.extend([_ARM_BASE + "".join(options)] if options else [])
    else:
        flags.extend(options)
    return flags


def build_key(isa: str | None = None) -> str:
    """The cache key of the kernel of ``isa`` (``target_isa()`` by default)."""
    import torch

    isa = target_isa() if isa is None else isa
    digest = hashlib.sha256()
    digest.update(f"entry format {cache.ENTRY_FORMAT}\0".encode())
    for path in kernel_files():  # a header edit must rebuild as much as a source edit
        digest.update(path.name.encode() + b"\0")
        digest.update(path.read_bytes())
    digest.update(isa.encode() + b"\0")
    digest.update(" ".join(compile_flags(isa)).encode())
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


def loaded() -> ModuleType | None:
    """The kernel if ``load`` has made or found it, without building it."""
    module = _state.get("module")
    return module if isinstance(module, ModuleType) else None


def why_not() -> str:
    """Why the compiled kernel is not used ("" when it is, or before the first ``load``)."""
    return str(_state.get("why", ""))


def summary() -> str:
    """Which kernel this process runs: the instruction set it was compiled for and why
    (``isa_reason``), or why the pure-torch path (builds it at the first look, as ``load``;
    ``arfuse doctor`` and ``arfuse explain`` print it)."""
    module = load()
    if module is None:
        return f"pure-torch path: {why_not()}"
    return f"compiled for {module.isa} ({isa_reason()})"


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

    from ...pattern import quant_output_of_code

    def outputs(x: torch.Tensor, weight: torch.Tensor | None, quant: int,
                out: torch.Tensor | None, residual_out: torch.Tensor | None,
                group_size: int) -> list[Any]:
        if x.dim() != 2:
            raise ValueError(f"x must be 2-D [tokens, hidden], got shape {tuple(x.shape)}")
        tokens, hidden = x.shape
        result = [out if out is not None else x.new_empty((tokens, hidden))]
        if weight is not None:
            result.append(residual_out if residual_out is not None
                          else x.new_empty((tokens, hidden)))
        made = quant_output_of_code(quant, "quant")  # quant_out, scale_out as its row says
        data_shape = made.data_shape(tokens, hidden)
        if data_shape is not None and made.data_dtype is not None:
            result.append(x.new_empty(data_shape, dtype=getattr(torch, made.data_dtype)))
        if made.scale_dtype is not None:
            shape, strides, _ = made.scale_geometry(tokens, hidden, group_size)
            result.append(x.new_empty_strided(shape, strides,
                                              dtype=getattr(torch, made.scale_dtype)))
        return result

    def fake(handle: int, x: torch.Tensor, residual: torch.Tensor | None,
             weight: torch.Tensor | None, eps: float, weight_bias: float, quant: int,
             scale: float, out: torch.Tensor | None = None,
             residual_out: torch.Tensor | None = None, group_size: int = 0) -> list[Any]:
        return outputs(x, weight, quant, out, residual_out, group_size)

    def fake_functional(handle: int, x: torch.Tensor, residual: torch.Tensor | None,
                        weight: torch.Tensor | None, eps: float, weight_bias: float, quant: int,
                        scale: float, group_size: int = 0) -> list[Any]:
        return outputs(x, weight, quant, None, None, group_size)

    try:
        torch.library.register_fake("arfuse::shm_fused_allreduce")(fake)
        torch.library.register_fake("arfuse::shm_fused_allreduce_functional")(fake_functional)
    except (AttributeError, RuntimeError) as exc:  # an older torch: no torch.compile support
        log.logger.debug("arfuse shm: no fake for the torch operator: %s", exc)


def load_file(path: str) -> ModuleType:
    """The built kernel at ``path`` as a module of its own (named as the file: its
    ``PyInit_<name>``), beside any other build loaded into this process (each has its own
    ``ShmComm``): how two builds are compared in one process."""
    return cache.import_extension(Path(path).name.split(".")[0], path)


def build_tree(tree: str) -> str:
    """Compile (or find in the kernel cache) the kernel of the arfuse source tree ``tree`` by
    that tree's own ``build.load()`` (a child Python with the tree first on PYTHONPATH, this
    environment otherwise: ARFUSE_SHM_ISA included); the path of its shared object."""
    env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
    code = ("from arfuse.backends.shm import build; m = build.load(); "
            "print('kernel: ' + m.__file__ if m else 'no kernel: ' + str(build.why_not()))")
    done = subprocess.run([sys.executable, "-c", code], env=env, check=True, text=True,
                          capture_output=True)
    out = done.stdout
    if "kernel: " not in out or "no kernel: " in out:
        raise ValueError(f"{tree}: no compiled kernel:\n{out}{done.stderr}")
    return out.rsplit("kernel: ", 1)[1].strip()


def _build(isa: str | None = None) -> tuple[ModuleType | None, str]:
    """The kernel of ``isa`` (``target_isa()`` by default), from the cache or compiled there,
    or ``None`` and why. Builds of different instruction sets may run in threads side by
    side (each names its own; nothing here reads ``ARFUSE_SHM_ISA`` once ``isa`` is given)."""
    if os.environ.get("ARFUSE_SHM_PURE_TORCH") == "1":
        return None, "ARFUSE_SHM_PURE_TORCH=1"
    if compiler() is None:
        return None, "no C++ compiler found (install g++ or set CXX)"
    isa = target_isa() if isa is None else isa
    problem = isa_problem(isa)
    if problem:  # a binary for an instruction set the CPU lacks would die of SIGILL
        return None, problem
    problem = unit_problem()
    if problem:
        return None, problem
    key = build_key(isa)
    name = f"arfuse_shm_{key}"
    try:
        with cache.build_dir(key) as (directory, binary, cached):
            where = os.path.join(os.path.realpath(fd_path(directory)), f"{name}.so")
            if binary is not None:  # cached: import it directly (ninja's check costs ~0.3 s)
                found, _problem = cache.cached_module(directory, name, binary, where)
                if found is not None:
                    return found, ""
            with cache.one_builder(directory):
                # built by whom we waited for, or the entry found broken above
                binary = cache.binary_if_built(directory, name, where)
                if binary is not None:
                    found, problem = cache.cached_module(directory, name, binary, where)
                    if found is not None:
                        return found, ""
                    log.logger.warning("arfuse shm: the cached kernel %s is broken (%s): "
                                       "removing its cache entry and building it again",
                                       where, problem)
                    cache.clear_entry(directory)
                _say_building(where, cached)
                # imported only to compile: a process that finds its kernel cached is spared
                # it (setuptools and more: seconds under emulation)
                try:
                    from torch.utils import cpp_extension
                except ImportError as exc:  # pragma: no cover - torch without cpp_extension
                    return None, f"torch.utils.cpp_extension unavailable: {exc}"
                return _compile(cpp_extension, name, directory, where, isa)
    except (OSError, Untrusted) as exc:
        return None, f"no safe build directory: {type(exc).__name__}: {exc}"


def _say_building(where: str, cached: bool) -> None:
    """Warn, once per process, that the first use waits for the compiler."""
    log.once(logging.WARNING, "shm-compile", "arfuse shm: compiling the C++ kernel (about a "
             "minute) into %s; %s", os.path.dirname(where),
             "later runs reuse it" if cached else "not cached: each process compiles it again")


def _compile(cpp_extension: Any, name: str, directory: int, where: str,
             isa: str) -> tuple[ModuleType | None, str]:
    """Build the kernel of ``isa`` in the open ``directory`` and import it from there (by its
    descriptor's name, so a path changed meanwhile cannot substitute another directory)."""
    try:
        module = cpp_extension.load(
            name=name, sources=[str(p) for p in sources()],
            extra_cflags=compile_flags(isa), extra_ldflags=["-fopenmp"],
            extra_include_paths=[str(d) for d in include_dirs()],
            build_directory=fd_path(directory), verbose=False)
    except Exception as exc:  # a broken toolchain means the pure path, not a crash
        return None, f"building the kernel failed: {type(exc).__name__}: {str(exc)[-500:]}"
    module.__file__ = where
    try:
        cache.write_record(directory, name, where)
    except (OSError, Untrusted) as exc:  # the kernel works; the next process builds it again
        log.logger.warning("arfuse shm: cannot record the kernel built at %s (%s: %s); the "
                           "next process builds it again", where, type(exc).__name__, exc)
    return module, ""
