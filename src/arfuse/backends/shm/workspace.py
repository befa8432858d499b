"""CPU shared-memory backend: one segment per group, a fused C++ kernel (or a pure-torch path).

Lifecycle of the segment: group rank 0 makes it unnamed (``O_TMPFILE`` in ``segment_dir()``),
writes its identity (magic, layout version, creator) into the header and reserves its own part;
every other rank opens it through rank 0's descriptor (``/proc/<pid>/fd/<n>``), reserves its
own part and maps it, and closes its descriptor. So the segment never has a name and, once
mapped, no descriptor: the kernel frees it when the last mapping goes, even if the job is
killed. Only where that cannot be done (a peer in another pid namespace, or one that /proc
refuses; a filesystem without unnamed files) does the segment get a name,
``arfuse-<pid>-<start>-<random>``, which rank 0 unlinks as soon as every rank has it open. A
segment left with its name by a creator that died in between is removed by the next creation
on the machine (``clean_stale_segments``, which removes only segments whose header proves them
arfuse's and their creator gone).

The kernel is also a torch operator, ``torch.ops.arfuse.shm_fused_allreduce``, which names a
rank's kernel by an integer handle (``ShmWorkspace.handle`` says how to call it).
"""

from __future__ import annotations

import contextlib
import errno
import os
import platform
import secrets
import stat
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ... import log, signature
from ...call_checks import CallArgs
from ...dtypes import DTYPES
from ...epilogue import FusedOutput, apply, rank_order_sum
from ...errors import (
    CallTimeout,
    CreationFailed,
    MismatchedCall,
    WorkspaceBroken,
)
from ...sizing import ceil_div
from ...spec import Spec
from ...torch_types import TORCH_DTYPES
from ..base import Backend, Workspace
from . import build as shm_build
from . import layout_of
from .layout import (
    ARRIVE_OFFSET,
    CACHE_LINE,
    HEADER_BYTES,
    IDENTITY_OFFSET,
    MAX_WORLD,
    SEGMENT_ID_BYTES,
    SEGMENT_VERSION,
    SIGNATURE_BYTES,
    SIGNATURE_OFFSET,
    SegmentId,
    ShmLayout,
)
from .mapping import map_segment, retire

DEFAULT_SHM_DIR = Path("/dev/shm")
PREFIX = "arfuse-"
# One-shot (every rank reduces and finishes every row, block by block while it is in cache) up
# to this many bytes per rank; two-shot (each rank sums a block of rows and finishes it in the
# same pass, every rank finishes the other blocks from their owners' sums) above. One-shot makes
# every rank read every peer's whole input across cores and run the epilogue on every row;
# two-shot halves both (two ranks) for one more meeting, which pays from the second row of the
# usual hidden sizes on (benchmarks/shm_threshold.py; figures in benchmarks/RESULTS.md), hence
# one-shot for single rows only. With more ranks the crossover can only move down; the two-rank
# value is used for them too.
ONESHOT_MAX_BYTES = 8 * 1024


# How the copy into the slot and a call's own outputs are stored; the kernel's codes are the
# indices.
STORE_MODES = ("auto", "cached", "streaming")


def _store_mode_code(mode: str) -> int:
    if mode not in STORE_MODES:
        raise ValueError(f"mode={mode!r} is not valid; use one of {', '.join(STORE_MODES)}")
    return STORE_MODES.index(mode)


# Every live workspace of each group in this process (by group key): a rank waiting in a call
# of one looks at the others for peers that are in a call there (ops called in another order)
_GROUP_WORKSPACES: dict[str, weakref.WeakSet[ShmWorkspace]] = {}
_GROUP_NUMBERS: dict[str, int] = {}


def _group_number(key: str) -> int:
    """A number per group of this process (from 1), for the kernel's ``set_group``."""
    return _GROUP_NUMBERS.setdefault(key, len(_GROUP_NUMBERS) + 1)



def process_identity(pid: int | None = None) -> tuple[int, int]:
    """(pid, start time in clock ticks): a pid alone can be reused by another process."""
    pid = os.getpid() if pid is None else pid
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return pid, -1
    fields = text[text.rindex(")") + 2:].split()
    return pid, int(fields[19])


def _alive(pid: int, start: int) -> bool:
    _got_pid, got_start = process_identity(pid)
    return got_start >= 0 and got_start == start


def segment_dir() -> Path:
    """Where segments are made: ``ARFUSE_SHM_DIR``, read at each use (empty means unset, as
    for every arfuse variable), else /dev/shm."""
    return Path(os.environ.get("ARFUSE_SHM_DIR", "").strip() or DEFAULT_SHM_DIR)


def pid_namespace() -> int:
    """This process's pid namespace (the inode of /proc/self/ns/pid; 0 when unknown): a pid
    means a process only within its namespace."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def clean_stale_segments(directory: Path | None = None) -> list[str]:
    """Remove the segments a dead creator left in ``directory`` (default: ``segment_dir()``);
    returns their names. Only what is provably arfuse's and provably abandoned goes: a regular
    file of this user, named ``arfuse-*``, whose header has arfuse's magic and names a creator
    (pid and start time) in this pid namespace that is no longer alive. Anything else stays: a
    file merely named like a segment, another user's, one whose creator is unknown (no /proc
    when it was made) or cannot be seen from here."""
    directory = segment_dir() if directory is None else directory
    removed: list[str] = []
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return removed
    try:
        for name in sorted(os.listdir(dir_fd)):
            if name.startswith(PREFIX) and _abandoned(dir_fd, name):
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=dir_fd)
                    removed.append(name)
    except OSError:
        pass
    finally:
        os.close(dir_fd)
    if removed:
        log.logger.info("arfuse shm: removed segments of dead jobs from %s: %s", directory,
                        ", ".join(removed))
    return removed


def _abandoned(dir_fd: int, name: str) -> bool:
    """Whether ``name`` is a segment of this user whose creator is gone (see the sweep)."""
    try:
        # never open anything but a regular file (a FIFO would block, a device could act)
        if not stat.S_ISREG(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            return False
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=dir_fd)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return False
        found = SegmentId.decode(os.pread(fd, SEGMENT_ID_BYTES, 0))
        if (found is None or found.start < 0 or found.pidns == 0
                or found.pidns != pid_namespace() or _alive(found.pid, found.start)):
            return False  # not arfuse's, a creator it could not name, or one alive or unseen
        now = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)  # still the file read
        return (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)
    except OSError:
        return False
    finally:
        os.close(fd)


FileId = tuple[int, int]  # (st_dev, st_ino): which file a name or descriptor is


def _file_id(fd: int) -> FileId:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


@dataclass
class _SegmentFile:
    """Where the segment is in the directory: its name ("" while it has none) and the file
    this rank has open."""

    directory: Path
    name: str = ""
    file: FileId | None = None

    def remove_name(self) -> None:
        """Unlink the name if it is still the file this rank has open (never another one)."""
        if not self.name or self.file is None:
            return
        path = self.directory / self.name
        with contextlib.suppress(OSError):
            st = os.stat(path, follow_symlinks=False)
            if (st.st_dev, st.st_ino) == self.file:
                os.unlink(path)


def _reserve(fd: int, layout: ShmLayout, rank: int) -> None:
    """Reserve this rank's slots (rank 0 also the header), each rank its own: a full directory
    fails here, on the rank that cannot reserve, not as a SIGBUS in a call; and each rank's
    pages are first touched by the rank that writes them."""
    start = 0 if rank == 0 else layout.slot_offset(rank, 0)
    end = layout.slot_offset(rank + 1, 0) if rank + 1 < layout.world_size else layout.total_bytes
    os.posix_fallocate(fd, start, end - start)


def segment_label() -> str:
    """``arfuse-<pid>-<start>-<random>``: the segment's name in logs, and in the directory
    when it has one there."""
    pid, start = process_identity()
    return f"{PREFIX}{pid}-{start}-{secrets.token_hex(6)}"


def _create_segment(directory: Path, layout: ShmLayout, label: str) -> tuple[int, str]:
    """Rank 0's segment, sized, its identity written and rank 0's part reserved: its
    descriptor, and its name in ``directory`` ("": none, ``O_TMPFILE``). Only a filesystem
    without unnamed files names it from the start (``label``; a creator killed before its
    first write then leaves a file that is not provably arfuse's)."""
    pid, start = process_identity()
    name = ""
    try:
        fd = os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise
        name = label
        fd = os.open(directory / name, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.ftruncate(fd, layout.total_bytes)  # sparse: every rank reserves its own part
        os.pwrite(fd, SegmentId(SEGMENT_VERSION, pid, start, pid_namespace()).encode(), 0)
        _reserve(fd, layout, 0)
    except BaseException:
        os.close(fd)
        if name:
            with contextlib.suppress(OSError):
                os.unlink(directory / name)
        raise
    return fd, name


def _name_segment(directory: Path, fd: int, label: str) -> str:
    """Give rank 0's unnamed segment the name ``label`` (for peers that cannot open it
    through /proc)."""
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:  # linkat(AT_SYMLINK_FOLLOW) of the descriptor's /proc link: a directory fd selects it
        os.link(f"/proc/self/fd/{fd}", label, dst_dir_fd=dir_fd, follow_symlinks=True)
    finally:
        os.close(dir_fd)
    return label


def _open_segment(path: Path, layout: ShmLayout, creator: tuple[int, int]) -> int:
    """A peer's descriptor of the segment at ``path``, checked to be the one rank 0 made."""
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        found = SegmentId.decode(os.pread(fd, SEGMENT_ID_BYTES, 0))
        if found is None or found.version != SEGMENT_VERSION or (found.pid,
                                                                 found.start) != creator:
            raise CreationFailed(f"{path} is not the segment rank 0 made (pid {creator[0]}, "
                                 f"layout version {SEGMENT_VERSION}): its header says {found}")
        size = os.fstat(fd).st_size
        if size != layout.total_bytes:
            raise CreationFailed(f"segment has {size} bytes, expected {layout.total_bytes} "
                                 "(ranks disagree on the layout)")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_shared(segment: _SegmentFile, shared: dict[str, Any], layout: ShmLayout) -> int:
    """A peer opens the segment rank 0 announced, in the segment directory they share: by
    its name if it has one, else through rank 0's descriptor (``/proc/PID/fd/N``, so that it
    never needs a name). -1: not that way (rank 0 is in another pid namespace, or its /proc is
    closed to this process: not dumpable), so it needs a name."""
    creator = (int(shared["creator"][0]), int(shared["creator"][1]))
    st = os.stat(segment.directory)
    if [st.st_dev, st.st_ino] != shared["directory"]:
        raise CreationFailed(f"this rank's segment directory {segment.directory} is not rank "
                             "0's (ARFUSE_SHM_DIR): the ranks do not share one")
    if segment.name:
        fd = _open_segment(segment.directory / segment.name, layout, creator)
    elif shared["pidns"] != pid_namespace():
        return -1
    else:
        try:
            fd = _open_segment(Path(f"/proc/{creator[0]}/fd/{shared['fd']}"), layout, creator)
        except (PermissionError, FileNotFoundError):
            return -1
    segment.file = _file_id(fd)
    return fd


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _why_or_none(exc: BaseException | None) -> str:
    return "" if exc is None else _why(exc)


def _discard(workspace: ShmWorkspace | None) -> None:
    """Free a workspace this rank will not keep; never raises (the caller is on its way to
    tell the group why, or to raise the cause)."""
    if workspace is None:
        return
    try:
        workspace.destroy()
    except Exception as exc:
        log.logger.warning("arfuse shm: freeing a failed workspace raised %s: %s",
                           type(exc).__name__, exc)


class ShmWorkspace(Workspace):
    backend = "shm"

    def __init__(self, ctx: Any, spec: Spec, layout: ShmLayout, name: str,
                 segment: torch.Tensor, segment_mode: int):
        """``segment``: the whole segment from ``mapping.map_segment``; ``segment_mode``: its
        file's permission bits (-1: another user's), kept since no descriptor is."""
        super().__init__(ctx, spec, nbytes=ceil_div(layout.total_bytes, ctx.world_size),
                         capacity=spec.max_tokens)
        self.layout, self.name, self.segment_mode = layout, name, segment_mode
        self._view: torch.Tensor | None = segment
        self._base = segment.data_ptr()
        self._private: torch.Tensor | None = None
        # input_buffer views by (slot offset, tokens): making one costs ~10 us of tensor
        # slicing, and a layer asks for one every step
        self._slot_views: dict[tuple[int, int], torch.Tensor] = {}
        self._dtype = TORCH_DTYPES[spec.dtype]
        self.kernel = shm_build.load()
        self._comm: Any = None
        self._seq = 0
        self._broken = ""  # the pure-torch path's failure, once it had one
        # the pure-torch path runs one call at a time, as the kernel does (comm.h: call_mutex_)
        self._call_lock = threading.Lock()
        _GROUP_WORKSPACES.setdefault(ctx.key, weakref.WeakSet()).add(self)
        if self.kernel is not None:
            self._comm = self.kernel.ShmComm(
                self._base, ctx.world_size, ctx.rank, spec.max_tokens, spec.hidden,
                DTYPES[spec.dtype].code, HEADER_BYTES, layout.slot_bytes,
                layout.input_bytes, ctx.timeout_s, ONESHOT_MAX_BYTES)
            self._comm.set_result_type(FusedOutput)
            self._comm.set_group(_group_number(ctx.key))
            self._comm.set_replicated_residual(ctx.settings.replicated_residual.promised)
        if self._comm is None:
            self.use_pure_path()

    # --- identity and liveness ----------------------------------------------------------------

    def _identity_view(self) -> torch.Tensor:
        view = self._view_or_private()
        return view[IDENTITY_OFFSET:ARRIVE_OFFSET].view(torch.int64).view(MAX_WORLD, -1)

    def _view_or_private(self) -> torch.Tensor:
        view = self._private if self._private is not None else self._view
        assert view is not None
        return view

    def publish_identity(self) -> None:
        pid, start = process_identity()
        ids = self._identity_view()
        ids[self.ctx.rank, 0], ids[self.ctx.rank, 1] = pid, start

    def peers(self) -> tuple[list[int], list[int], bool]:
        """Every rank's (pid, start) and whether this rank can watch them all."""
        ids = self._identity_view()
        pids = [int(ids[r, 0]) for r in range(self.ctx.world_size)]
        starts = [int(ids[r, 1]) for r in range(self.ctx.world_size)]
        visible = all(_alive(p, s) for p, s in zip(pids, starts, strict=False))
        return pids, starts, visible

    # --- validation -----------------------------------------------------------------------------

    def _token_view(self, rank: int) -> torch.Tensor:
        offset = self.layout.slot_offset(rank, 0)
        return self._view_or_private()[offset:offset + 16].view(torch.int64)

    def validate(self) -> None:
        """Every rank writes a token into its slot and reads every other rank's (R2)."""
        nonce = self.ctx.all_gather("validate-nonce", secrets.randbits(48), self.backend)[0]
        self._token_view(self.ctx.rank)[0] = nonce + self.ctx.rank
        self._token_view(self.ctx.rank)[1] = self.ctx.rank
        self.ctx.barrier("validate", self.backend)
        wrong = [r for r in range(self.ctx.world_size)
                 if int(self._token_view(r)[0]) != nonce + r or int(self._token_view(r)[1]) != r]
        # everyone has read before anyone's slot is reused by a call
        self.ctx.barrier("validate-read", self.backend)
        if wrong:
            raise CreationFailed(f"shared memory check failed: rank {self.ctx.rank} cannot see "
                                 f"the token of rank(s) {wrong} (not one shared segment)")
        pids, starts, visible = self.peers()
        if self._comm is not None:
            self._comm.set_peers(pids, starts, visible)

    def poison(self) -> None:
        """Like a mapping that is not shared: this rank sees private memory of the same size."""
        self._private = torch.zeros(self.layout.total_bytes, dtype=torch.uint8)
        self._slot_views.clear()
        if self._comm is not None:
            self._comm.set_base(self._private.data_ptr())

    # --- the op ----------------------------------------------------------------------------------

    def mode(self, tokens: int) -> str:
        """The mode a call of ``tokens`` runs in (the pure-torch path is one-shot only)."""
        if self._comm is None:
            return "oneshot"
        return "oneshot" if self._comm.oneshot(tokens) else "twoshot"

    def set_mode(self, mode: str | None) -> None:
        """Force one-shot or two-shot (tests and the threshold benchmark); ``None``: automatic."""
        if mode not in (None, "oneshot", "twoshot"):
            raise ValueError(f"mode={mode!r} is not valid; use oneshot, twoshot or None")
        if self._comm is not None:
            limit = {None: ONESHOT_MAX_BYTES, "oneshot": 2**62, "twoshot": -1}[mode]
            self._comm.set_oneshot_max_bytes(limit)

    def set_copy_mode(self, mode: str) -> None:
        """How the copy into the shared slot stores: ``auto`` (measured per size by the group,
        the default), ``cached`` or ``streaming`` (tests, benchmarks). Results are the same in
        every mode. The pure-torch path has one way to copy and ignores this."""
        code = _store_mode_code(mode)
        if self._comm is not None:
            self._comm.set_copy_mode(code)

    def set_output_stores(self, mode: str) -> None:
        """How a call's own outputs (``out`` other than x, ``residual_out`` other than the
        residual) are stored: ``auto`` (streaming stores once a call's own outputs come to
        the kernel build's ``stream_output_min_bytes`` in all: 16 MiB on AVX-512 and for
        fp32/fp16 on AVX2, e.g. ``out`` and ``residual_out`` of 8 MiB each; 64 MiB for bf16
        on AVX2; never on the scalar build; cached below, where the next op finds the
        outputs in cache), ``cached`` or ``streaming`` (tests, benchmarks). Results are the
        same in every mode; in place (out=x, residual_out=residual) always stores cached. The
        pure-torch path ignores this."""
        code = _store_mode_code(mode)
        if self._comm is not None:
            self._comm.set_output_stores(code)

    @property
    def copy_trial_calls(self) -> int:
        """Calls of one size until ``auto`` has decided its copy mode (0 on the pure-torch
        path): a benchmark warms up past them so that timed calls run the chosen mode."""
        if self._comm is None or self.kernel is None:
            return 0
        return int(self.kernel.copy_trial_calls)

    def copy_modes(self) -> dict[int, str]:
        """The copy mode in use per size class seen in ``auto`` mode, by the class's smallest
        size in bytes: ``cached``/``streaming`` once the group's trial decided, ``cached
        (undecided)`` before it. Empty on the pure-torch path."""
        if self._comm is None:
            return {}
        return {size: ("streaming" if streaming else "cached") + ("" if decided
                                                                    else " (undecided)")
                for size, streaming, decided, _votes, _calls in self._comm.copy_modes()}

    @property
    def fast_call(self) -> Any:
        """The kernel's checked entry (``None`` on the pure-torch path): it returns ``None``
        for anything unusual, and ``FusedAllReduce`` then takes its Python path."""
        return None if self._comm is None else self._comm.call

    @property
    def handle(self) -> int | None:
        """The integer that names this rank's kernel to the torch operator (``None`` on the
        pure-torch path). Every rank of the group calls, alike (it is collective)::

            outs = torch.ops.arfuse.shm_fused_allreduce(
                handle, x, residual, weight, eps, weight_bias, quant, scale, swizzled,
                out, residual_out)

        ``residual``, ``weight``, ``out``, ``residual_out``: tensors or ``None``, with the
        rules of ``FusedAllReduce.__call__``; ``quant``: 0 none, 1 fp8, 2 nvfp4, 4 fp8_dynamic
        (``scale`` as there, any number without quant or with fp8_dynamic); ``swizzled``:
        NVFP4 scales in the ``swizzled_128x4`` layout, else ``linear``. Returns ``[out]``, then
        ``residual_out`` when ``weight`` is given, ``quant_out`` with quant, ``scale_out``
        with nvfp4 and fp8_dynamic (float32 ``[tokens, 1]``). The workspace's settings
        apply (``replicated_residual``). Bad
        arguments raise ``ValueError``; a failed call ``CallTimeout``, ``MismatchedCall`` or
        ``WorkspaceBroken``, as the op does. The operator has a fake (meta) implementation,
        so ``torch.compile`` traces it (backend ``eager``); backends that functionalize
        (``aot_eager``, ``inductor``) refuse operators that write their arguments, so use
        ``torch.ops.arfuse.shm_fused_allreduce_functional`` there: the same without ``out``
        and ``residual_out``. After the workspace is destroyed its handle raises
        ``WorkspaceBroken``, and ``ValueError`` once the kernel object is gone."""
        return None if self._comm is None else int(self._comm.handle)

    def input_buffer(self, tokens: int) -> torch.Tensor:
        """This rank's input slot of the next call, as a ``[tokens, hidden]`` tensor: a layer
        that writes its output here saves the copy into shared memory. Valid for the next
        call only; the slot of the call after it is the other buffer."""
        if self._comm is not None:
            offset = self._comm.next_input_offset()
        else:
            offset = self.layout.slot_offset(self.ctx.rank, (self._seq + 1) & 1)
        cached = self._slot_views.get((offset, tokens))
        if cached is not None:
            return cached
        if isinstance(tokens, bool) or not isinstance(tokens, int):
            raise TypeError(f"tokens must be an int, got {type(tokens).__name__}")
        if not 0 <= tokens <= self.spec.max_tokens:
            raise ValueError(f"tokens={tokens} is not valid; use 0..{self.spec.max_tokens}")
        view = self._view_or_private()
        nbytes = tokens * self.spec.row_bytes
        made = view[offset:offset + nbytes].view(self._dtype).view(tokens, self.spec.hidden)
        if len(self._slot_views) >= 256:
            self._slot_views.clear()
        self._slot_views[(offset, tokens)] = made
        return made

    def use_pure_path(self) -> None:
        """Run the pure-torch path (no compiler here, or on some rank of the group)."""
        self._comm = None
        self.run = self._run_pure  # type: ignore[method-assign]

    @property
    def path(self) -> str:
        return "c++" if self._comm is not None else "pure-torch"

    def run(self, call: CallArgs) -> FusedOutput:
        return FusedOutput(*self._comm.run(call.x, call.residual, call.weight, call.eps,
                                           call.weight_bias, shm_build.QUANT_CODES[call.quant],
                                           call.scale or 0.0, call.layout == "swizzled_128x4",
                                           call.out, call.residual_out, call.op))

    def input_slot_start(self) -> int:
        view = self._view_or_private()
        if self._comm is not None:
            return view.data_ptr() + int(self._comm.next_input_offset())
        return view.data_ptr() + self.layout.slot_offset(self.ctx.rank, (self._seq + 1) & 1)

    def shared_span(self) -> tuple[int, int]:
        """[start, end) addresses of the shared segment: the peers read it during a call, so
        no output may be written there."""
        view = self._view_or_private()
        return view.data_ptr(), view.data_ptr() + view.numel()

    def _run_pure(self, call: CallArgs) -> FusedOutput:
        """One-shot in torch: the kernel's protocol (the call signature beside the arrival
        flag, compared by every rank before it reads a peer's rows; R11), the reference
        epilogue. Calls of zero tokens meet the others too."""
        with self._call_lock:
            return self._run_pure_locked(call)

    def _run_pure_locked(self, call: CallArgs) -> FusedOutput:
        if self._broken:
            raise WorkspaceBroken.after("arfuse shm", self._broken)
        x = call.x
        tokens, world, rank = x.shape[0], self.ctx.world_size, self.ctx.rank
        self._seq += 1
        seq, buf = self._seq, self._seq & 1
        view = self._view_or_private()
        row_bytes = self.spec.row_bytes
        slots = [view[self.layout.slot_offset(r, buf):
                      self.layout.slot_offset(r, buf) + tokens * row_bytes]
                 .view(self._dtype).view(tokens, self.spec.hidden) for r in range(world)]
        if tokens and slots[rank].data_ptr() != x.data_ptr():
            slots[rank].copy_(x)
        self._meet(self._signature(call), seq)  # the copy lands first: x86-64 stores are ordered
        if tokens == 0:
            return apply(x.float(), call)
        acc = rank_order_sum(torch.stack(slots))
        return apply(acc, call)

    def announce(self, call: CallArgs) -> None:
        """Meet the group with this call's signature without running it here: for a call over
        capacity, which runs on the unfused backend. Ranks whose calls differ (one over the
        capacity, one under it, say) then raise ``MismatchedCall`` on every rank, here and in
        the shm call of the others, instead of waiting in two different backends until a
        timeout (R11). Every rank announces the same calls (it is collective)."""
        if self._comm is not None:
            self._comm.announce(call.tokens, call.pattern.code, call.op)
            return
        with self._call_lock:
            if self._broken:
                raise WorkspaceBroken.after("arfuse shm", self._broken)
            self._seq += 1
            self._meet(self._signature(call), self._seq)

    def _meet(self, mine: tuple[int, int], seq: int) -> None:
        """Publish this rank's signature of call ``seq`` beside its arrival flag, wait until
        every rank arrived, and compare every signature (the kernel's protocol)."""
        lines = self._view_or_private()[ARRIVE_OFFSET:ARRIVE_OFFSET + MAX_WORLD * CACHE_LINE]
        lines = lines.view(torch.int64).view(MAX_WORLD, -1)
        column = (SIGNATURE_OFFSET + (seq & 1) * SIGNATURE_BYTES) // 8
        rank = self.ctx.rank
        lines[rank, column], lines[rank, column + 1] = mine
        lines[rank, 0] = seq  # after the signature: x86-64 stores are ordered
        self._wait(lines[:, 0], seq)
        found = [(int(lines[r, column]), int(lines[r, column + 1]))
                 for r in range(self.ctx.world_size)]
        if any(words != mine for words in found):
            # every rank stops here, at the same call, before reading data: still in step
            raise MismatchedCall(signature.mismatch_message("shm", seq, found))

    def _signature(self, call: CallArgs) -> tuple[int, int]:
        # the pure-torch path runs every call one-shot
        return signature.words(call.tokens, DTYPES[self.spec.dtype].code, self.spec.hidden,
                               call.pattern.code, twoshot=False, op=call.op)

    def _wait(self, flags: torch.Tensor, seq: int) -> None:
        deadline = time.monotonic() + self.ctx.timeout_s
        spins = 0
        while True:
            silent = [r for r in range(self.ctx.world_size) if int(flags[r]) < seq]
            if not silent:
                return
            spins += 1
            if spins > 100:
                time.sleep(0)
            if spins % 256 == 0:
                self._look_elsewhere(silent, seq)
                if time.monotonic() > deadline:
                    error = CallTimeout("call", self.backend, silent, self.ctx.timeout_s)
                    self._broken = str(error)
                    raise error

    def _arrivals(self) -> torch.Tensor:
        """Every rank's arrival flag (its last call number) on this rank's view."""
        lines = self._view_or_private()[ARRIVE_OFFSET:ARRIVE_OFFSET + MAX_WORLD * CACHE_LINE]
        return lines.view(torch.int64).view(MAX_WORLD, -1)[:, 0]

    def _look_elsewhere(self, silent: list[int], seq: int) -> None:
        """The pure-torch path's form of the kernel's ``look_elsewhere``: a silent peer in a
        call of another workspace of this group that this rank has not made yet called the
        ops in another order; both workspaces are out of step then."""
        for other in list(_GROUP_WORKSPACES.get(self.ctx.key, ())):
            if other is self or other.destroyed or other._broken or other._comm is not None:
                continue
            flags = other._arrivals()
            mine = int(flags[self.ctx.rank])
            ahead = [r for r in silent if int(flags[r]) > mine]
            if not ahead:
                continue
            peer, theirs = ahead[0], int(flags[ahead[0]])
            why = (f"arfuse shm: the ranks of the group called their ops in different orders: "
                   f"rank {peer} is in call {theirs} of another workspace of this group "
                   f"(hidden={other.spec.hidden} dtype={other.spec.dtype}) while this rank "
                   f"waits for it in call {seq} of this one (hidden={self.spec.hidden} "
                   f"dtype={self.spec.dtype}); every rank must call the ops of a group in the "
                   "same order. Both workspaces are out of step now and refuse later calls: "
                   + WorkspaceBroken.ADVICE)
            other._broken = self._broken = why
            raise MismatchedCall(why)

    def _free(self) -> None:
        """Let go of the segment. The caller may still hold views of it (``input_buffer``):
        they stay valid memory and read zeros (``mapping.retire``), so no view can crash the
        process, and the last of them frees the range."""
        if self._comm is not None:  # a FusedAllReduce may still hold its entry point
            self._comm.invalidate("the workspace was destroyed")  # after a call in progress
        with self._call_lock:  # ... and the pure-torch path's
            self._broken = self._broken or "the workspace was destroyed"
            self._comm = None
            self._private = None
            segment, self._view = self._view, None
            self._slot_views.clear()
            if segment is not None and not retire(segment):
                log.logger.debug("arfuse shm: %s stays mapped until the last view of it goes",
                                 self.name)


# Machines whose stores become visible to other cores in program order (x86's TSO), as the
# pure-torch path's flags need: it writes a slot, then the flag, with plain tensor stores.
STORE_ORDERED_MACHINES = ("x86_64", "AMD64", "i386", "i686")


class ShmBackend(Backend):
    name = "shm"

    def local_check(self, ctx: Any, spec: Spec) -> str:
        directory = segment_dir()
        if not directory.is_dir() or not os.access(directory, os.W_OK):
            return f"{directory} is not a writable directory"
        need = layout_of(ctx.world_size, spec).total_bytes
        st = os.statvfs(directory)
        free = st.f_bavail * st.f_frsize
        if free < need:
            return (f"{directory} has {free / 1024:.0f} KiB free, the segment needs "
                    f"{need / 1024:.0f} KiB (docker: --shm-size)")
        if shm_build.load() is None and platform.machine() not in STORE_ORDERED_MACHINES:
            # the pure-torch path publishes its flags with plain stores after the data
            return (f"no compiled kernel ({shm_build.why_not()}) and the pure-torch path "
                    f"relies on x86's store order; this CPU is {platform.machine()}")
        return ""

    def create(self, ctx: Any, spec: Spec) -> Workspace | None:
        """Collective: rank 0 makes the segment, every rank opens it (through rank 0's
        descriptor, so it never has a name; or by a name rank 0 removes once every rank has it
        open), then every rank maps it. A rank that fails still takes part in every exchange
        (its reason in it), so the others are not left waiting; whatever it made is freed
        before it raises."""
        layout = layout_of(ctx.world_size, spec)
        segment = _SegmentFile(segment_dir())
        fd, error, mode, label = -1, "", None, segment_label()
        directory: list[int] = []
        if ctx.rank == 0:
            try:
                mode = ctx.fault(self.name, "create")
                clean_stale_segments(segment.directory)
                st = os.stat(segment.directory)
                directory = [st.st_dev, st.st_ino]
                fd, segment.name = _create_segment(segment.directory, layout, label)
                segment.file = _file_id(fd)
            except (Exception, MemoryError) as exc:
                error = _why(exc)
        try:
            try:
                shared = ctx.all_gather("shm-name", {
                    "label": label, "name": segment.name, "fd": fd, "error": error,
                    "directory": directory, "pidns": pid_namespace(),
                    "creator": list(process_identity())}, self.name)[0]
            except BaseException:  # a silent peer: nobody opens it
                segment.remove_name()
                raise
            if shared["error"]:
                raise CreationFailed(f"rank 0 could not create the segment: {shared['error']}")
            return self._join(ctx, spec, layout, segment, shared, fd, mode)
        finally:
            if fd >= 0:  # rank 0's, whatever happened; the others close their own
                os.close(fd)

    def _join(self, ctx: Any, spec: Spec, layout: ShmLayout, segment: _SegmentFile,
              shared: dict[str, Any], fd: int, mode: str | None) -> ShmWorkspace | None:
        """Every rank but 0 opens the segment, then all map it (``fd``: rank 0's)."""
        segment.name = shared["name"]
        failure: BaseException | None = None
        need_name = False
        mine = fd
        try:
            if ctx.rank != 0:
                try:
                    mode = ctx.fault(self.name, "create")
                    if mode != "none":
                        mine = _open_shared(segment, shared, layout)
                        need_name = mine < 0
                except (Exception, MemoryError) as exc:
                    failure = exc
            opened = self._exchange(ctx, "shm-opened", {"why": _why_or_none(failure),
                                                        "need_name": need_name}, segment,
                                    opened=True)
            if any(o["need_name"] for o in opened):
                mine, failure = self._open_by_name(ctx, layout, segment, shared, fd, mine,
                                                   need_name, failure)
            workspace = None
            if failure is None and mode != "none":
                try:
                    workspace = self._map(ctx, spec, layout, shared["label"], mine)
                    workspace.publish_identity()
                except (Exception, MemoryError) as exc:
                    _discard(workspace)  # mapped, then failed: it goes now
                    workspace, failure = None, exc
            mapped = self._exchange(ctx, "shm-mapped", {"why": _why_or_none(failure), "kernel": (
                workspace is not None and workspace.kernel is not None)}, segment, workspace)
            if failure is not None:
                try:
                    raise failure
                finally:  # its traceback holds this frame: no reference cycle through it
                    failure = None
        finally:
            if ctx.rank != 0 and mine >= 0:
                os.close(mine)
        if workspace is not None and not all(m["kernel"] for m in mapped if not m["why"]):
            workspace.use_pure_path()  # one protocol for the whole group
        if workspace is not None and mode == "null":
            workspace.poison()
        return workspace

    def _open_by_name(self, ctx: Any, layout: ShmLayout, segment: _SegmentFile,
                      shared: dict[str, Any], fd: int, mine: int, need_name: bool,
                      failure: BaseException | None) -> tuple[int, BaseException | None]:
        """Some rank cannot reach rank 0's descriptor: rank 0 names the segment, those ranks
        open it by name. Returns this rank's descriptor and its failure, if any."""
        if ctx.rank == 0:
            try:
                segment.name = _name_segment(segment.directory, fd, shared["label"])
            except (Exception, MemoryError) as exc:
                failure = exc
        named = self._exchange(ctx, "shm-named", {"name": segment.name,
                                                  "why": _why_or_none(failure)}, segment)[0]
        if need_name and failure is None:
            try:
                if not named["name"]:
                    raise CreationFailed(f"rank 0 could not name the segment for ranks that "
                                         f"cannot reach its descriptor: {named['why']}")
                segment.name = named["name"]
                mine = _open_shared(segment, shared, layout)
            except (Exception, MemoryError) as exc:
                failure = exc
        self._exchange(ctx, "shm-named-opened", _why_or_none(failure), segment, opened=True)
        try:
            return mine, failure
        finally:  # its traceback holds this frame: no reference cycle through it
            failure = None

    def _exchange(self, ctx: Any, phase: str, value: Any, segment: _SegmentFile,
                  workspace: ShmWorkspace | None = None, opened: bool = False) -> list[Any]:
        """One exchange of the creation. If it fails (a peer failed or is gone: rank 0 may
        be), nothing of this attempt stays: the workspace is freed and, on any rank that has
        the segment open, its name removed. ``opened``: the exchange after which every rank
        that could open the segment by its name has done so, so rank 0 removes it."""
        try:
            got: list[Any] = ctx.all_gather(phase, value, self.name)
        except BaseException:
            _discard(workspace)
            segment.remove_name()
            raise
        finally:
            if opened and ctx.rank == 0:
                segment.remove_name()
        return got

    @staticmethod
    def _map(ctx: Any, spec: Spec, layout: ShmLayout, name: str, fd: int) -> ShmWorkspace:
        """This rank's part reserved (rank 0 reserved its own at creation), the segment
        mapped; the caller closes ``fd`` (the mapping needs none)."""
        if ctx.rank != 0:
            _reserve(fd, layout, ctx.rank)
        st = os.fstat(fd)
        segment = map_segment(fd, layout.total_bytes)
        try:
            return ShmWorkspace(ctx, spec, layout, name, segment,
                                st.st_mode & 0o777 if st.st_uid == os.geteuid() else -1)
        except BaseException:
            retire(segment)  # whatever still holds a view of it reads zeros
            raise
