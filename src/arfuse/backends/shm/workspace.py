"""The shm workspace: one rank's mapping of the group's segment, run by the fused C++ kernel or
by the pure-torch path (``segment`` has the segment's life on disk, ``backend`` its creation).

The kernel is also a torch operator, ``torch.ops.arfuse.shm_fused_allreduce``, which names a
rank's kernel by an integer handle (``ShmWorkspace.handle`` says how to call it).
"""

from __future__ import annotations

import secrets
import threading
import time
import weakref
from typing import Any

import torch

from ... import log, moe, signature
from ...call_checks import CallArgs
from ...dtypes import DTYPES
from ...epilogue import apply, rank_order_sum
from ...errors import (
    CallTimeout,
    CreationFailed,
    MismatchedCall,
    WorkspaceBroken,
)
from ...pattern import output_code
from ...result import FusedOutput
from ...settings import ResidualPromise
from ...sizing import ceil_div
from ...spec import Spec
from ...torch_types import TORCH_DTYPES
from ..base import Workspace
from . import build as shm_build
from .layout import (
    ARRIVE_OFFSET,
    CACHE_LINE,
    HEADER_BYTES,
    IDENTITY_OFFSET,
    MAX_WORLD,
    SIGNATURE_BYTES,
    SIGNATURE_OFFSET,
    ShmLayout,
)
from .mapping import retire
from .segment import LIVENESS_LOOK_S, alive, process_identity

# One-shot (every rank reduces and finishes every row, block by block while it is in cache) up
# to this many bytes per rank; two-shot (each rank sums a block of rows and finishes it in the
# same pass, every rank finishes the other blocks from their owners' sums) above (at two ranks
# up to RING_ONESHOT_ABOVE_BYTES). One-shot makes every rank read every peer's whole input
# across cores and run the epilogue on every row; two-shot halves both (two ranks) for one more
# meeting, which pays from the second row of the usual hidden sizes on
# (benchmarks/shm_threshold.py; figures in docs/design.md 6), hence one-shot for single rows.
# With more ranks the crossover can only move down; the two-rank value is used for them too.
ONESHOT_MAX_BYTES = 8 * 1024
# At two ranks, one-shot again above this many bytes per rank: its copied input goes round a
# ring of the slot that stays in cache (the kernel's run_oneshot), while two-shot's copies and
# sums pass through memory once a call outgrows the caches, and from there that costs more than
# two-shot's halved work saves (benchmarks/peers.py's one- and two-shot rows; docs/design.md 6).
# Not measured with more ranks, where one-shot reads every peer's whole input: two-shot there.
RING_ONESHOT_ABOVE_BYTES = 3 * 1024 * 1024
NEVER = 2**62


def oneshot_bytes(world: int, mode: str | None) -> tuple[int, int]:
    """The kernel's one-shot limits (``set_oneshot_bytes``): one-shot up to the first number
    of bytes per rank and above the second, two-shot between."""
    if mode not in (None, "oneshot", "twoshot"):
        raise ValueError(f"mode={mode!r} is not valid; use oneshot, twoshot or None")
    if mode == "oneshot":
        return NEVER, NEVER
    if mode == "twoshot":
        return -1, NEVER
    return ONESHOT_MAX_BYTES, RING_ONESHOT_ABOVE_BYTES if world == 2 else NEVER


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
        # every rank's (pid, start) and whether this rank can watch them (set by validate)
        self._peers: tuple[list[int], list[int], bool] = ([], [], False)
        # the pure-torch path runs one call at a time, as the kernel does (comm.h: call_mutex_)
        self._call_lock = threading.Lock()
        _GROUP_WORKSPACES.setdefault(ctx.key, weakref.WeakSet()).add(self)
        if self.kernel is not None:
            self._comm = self.kernel.ShmComm(
                self._base, ctx.world_size, ctx.rank, spec.max_tokens, spec.hidden,
                DTYPES[spec.dtype].code, HEADER_BYTES, layout.slot_bytes,
                layout.input_bytes, ctx.timeout_s, ONESHOT_MAX_BYTES)
            self._comm.set_result_type(FusedOutput)
            self._comm.set_oneshot_bytes(*oneshot_bytes(ctx.world_size, None))
            self._comm.set_group(_group_number(ctx.key))
            promise = ctx.settings.replicated_residual
            self._comm.set_replicated_residual(promise.promised)
            self._comm.set_residual_checked(promise is ResidualPromise.CHECKED)
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
        visible = all(alive(p, s) for p, s in zip(pids, starts, strict=False))
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
        self._peers = pids, starts, visible = self.peers()
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
        limits = oneshot_bytes(self.ctx.world_size, mode)
        if self._comm is not None:
            self._comm.set_oneshot_bytes(*limits)

    @property
    def ring_blocks(self) -> int:
        """The blocks of the slot a copied one-shot input goes round (0: none)."""
        return 0 if self._comm is None else int(self._comm.ring_blocks)

    def set_ring_blocks(self, blocks: int) -> None:
        """The blocks of the slot a copied one-shot input goes round (tests and benchmarks;
        0: none, each block at its rows' offsets). Results do not depend on it; the pure-torch
        path has no ring and ignores this."""
        if self._comm is not None:
            self._comm.ring_blocks = blocks

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
    def fast_moe_call(self) -> Any:
        """The kernel's checked MoE entry (``None`` on the pure-torch path); ``None`` from it:
        take the Python path, as for ``fast_call``."""
        return None if self._comm is None else self._comm.call_moe

    @property
    def kernel_entry(self) -> tuple[Any, int] | None:
        handle = self.handle
        return None if handle is None or self.kernel is None else (self.kernel, handle)

    @property
    def handle(self) -> int | None:
        """The integer that names this rank's kernel to the torch operator (``None`` on the
        pure-torch path). Every rank of the group calls, alike (it is collective)::

            outs = torch.ops.arfuse.shm_fused_allreduce(
                handle, x, residual, weight, eps, weight_bias, quant, scale, out, residual_out,
                group_size=0)

        ``residual``, ``weight``, ``out``, ``residual_out``: tensors or ``None``, with the
        rules of ``FusedAllReduce.__call__``; ``quant``: the code of the quantised output,
        ``arfuse.pattern.output_code(quant, layout)`` (0 none, 1 fp8, 2 nvfp4 swizzled_128x4,
        3 nvfp4 linear, 4 fp8_dynamic, 5-7 fp8_group fp32, fp32_column_major, ue8m0_packed;
        ``scale`` as there, any number where the output takes none); ``group_size``:
        fp8_group's (32, 64, 128), 0 for the others. Returns ``[out]``, then ``residual_out``
        when ``weight`` is given, then ``quant_out`` and ``scale_out`` where the output makes
        them (fp8: ``quant_out``; the others: both, fp8_dynamic's scales float32
        ``[tokens, 1]``, fp8_group's as ``FusedAllReduce`` returns them). The
        workspace's settings apply (``replicated_residual``; an op made with
        ``replicated_residual="check"`` refuses the operator with ``ValueError``, since the
        check across ranks is the op's: call the op). Bad
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
        if call.moe is not None:
            self._expert_step(call.moe, call.x)
        return FusedOutput(*self._comm.run(call.x, call.residual, call.weight, call.eps,
                                           call.weight_bias,
                                           output_code(call.quant, call.layout),
                                           call.scale or 0.0,
                                           call.out, call.residual_out, call.op, call.moe_word,
                                           call.group_size))

    def _expert_step(self, step: moe.ExpertStep, x: torch.Tensor) -> None:
        """The MoE expert step by the kernel, straight into ``x`` (this rank's input slot, so
        the call that follows copies nothing)."""
        assert self.kernel is not None
        if step.index is None:
            assert step.add is not None
            self.kernel.moe_reduce(x, step.rows, step.scales, step.add)
            return
        problem = self.kernel.moe_finalize(x, step.rows, step.index, step.scales, step.add,
                                           step.routed)
        if problem:
            raise moe.RefusedStep(problem)

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
        if call.moe is not None:
            moe.local_rows(call.moe, x)
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
            self._comm.announce(call.tokens, call.pattern.without_moe().code, call.op,
                                call.moe_word, call.group_size)
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
        return call.signature_words(self.spec.dtype, twoshot=False)

    def _wait(self, flags: torch.Tensor, seq: int) -> None:
        """The kernel's wait (``Waiter``) in Python: until every rank's flag reaches ``seq``;
        between looks, the other workspaces of the group, the silent peers' lives (at most
        every ``liveness.h`` ``kLookS``, by its rule) and the deadline."""
        now = time.monotonic()
        deadline, next_look = now + self.ctx.timeout_s, now + LIVENESS_LOOK_S
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
                now = time.monotonic()
                if now >= next_look:
                    self._check_alive(silent, seq)
                    next_look = now + LIVENESS_LOOK_S
                if now > deadline:
                    error = CallTimeout("call", self.backend, silent, self.ctx.timeout_s)
                    self._broken = str(error)
                    raise error

    def _check_alive(self, silent: list[int], seq: int) -> None:
        """The kernel's ``check_alive``: a silent peer that died breaks the workspace, named
        in the kernel's words."""
        pids, starts, visible = self._peers
        if not visible:
            return
        for r in silent:
            if alive(pids[r], starts[r]):
                continue
            error = CallTimeout(
                "call", self.backend, silent, self.ctx.timeout_s,
                message=(f"arfuse shm: rank {r} (pid {pids[r]}) died during a call (phase "
                         f"'call', backend shm, call {seq}); silent rank(s): "
                         + ", ".join(map(str, silent))))
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

