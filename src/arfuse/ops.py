"""``FusedAllReduce``: the user-facing op (DESIGN 3.6): checks, capacity gate, dispatch.

Construction is collective (every rank of the group, same arguments, same order). A call is
collective too: every rank calls with the same tokens, dtype, hidden size and pattern (a call
where they differ raises ``MismatchedCall`` on every rank). Bad input is an error that names the
argument; a call over the workspace's capacity is not an error: it runs unfused (R1) and is
counted in ``stats()``.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch

from . import catalog, collective, faults, log, moe
from . import settings as settings_mod
from .arg_checks import OpShape
from .backends.base import Workspace
from .call_checks import CallArgs, check_call
from .digest import digest_bytes
from .dtypes import parse_dtype
from .errors import ArfuseError, CallTimeout, MismatchedCall, WorkspaceBroken
from .pattern import Pattern
from .policy import Plan
from .quant import quantize
from .registry import REGISTRY, Lease
from .result import FusedOutput
from .settings import ResidualPromise
from .signature import MAX_OP
from .spec import Spec, parse_quant
from .torch_types import TORCH_DTYPES, device_of


class FusedAllReduce:
    """all-reduce(x) [+ residual -> RMSNorm [-> FP8 | NVFP4]] on the negotiated backend.

    ``replicated_residual=True`` (``ARFUSE_REPLICATED_RESIDUAL=1``) promises that every rank
    passes the same residual, as in tensor parallelism; the shm kernel then finishes rows
    other ranks reduced from their ``residual_out`` instead of reading its own residual (same
    bytes while the promise holds; unchecked, see the README). ``"check"``: the same, and every
    call first compares the ranks' residuals over the group (a collective per call: for
    tests), raising ``ValueError`` on every rank when they differ (``MismatchedCall`` when only
    some ranks pass a residual)."""

    def __init__(self, group: Any = None, max_token_num: int = 2048, hidden_dim: int = 4096,
                 dtype: Any = torch.bfloat16, backend: str | None = None,
                 quant: str | None = None, *, strict: bool | None = None,
                 timeout_s: float | None = None, device: str | None = None,
                 replicated_residual: bool | str | ResidualPromise | None = None) -> None:
        def request() -> tuple[settings_mod.Settings, Spec]:
            conf = settings_mod.load(backend=backend, strict=strict, timeout_s=timeout_s,
                                     replicated_residual=replicated_residual)
            log.configure(conf.log_level)
            return conf, Spec(max_tokens=max_token_num, hidden=hidden_dim,
                              dtype=parse_dtype(dtype), quant=parse_quant(quant))

        # collective even when this rank's arguments or settings are bad: every rank then
        # raises together (the others PeerAborted), and no rank waits for another
        lease = REGISTRY.acquire(group, request, device, timeout_s)
        lease.revoke_with(self._revoked)  # destroy_all() closes this op too
        self._closed_by = ""
        conf, spec = lease.ctx.settings, lease.spec
        self.spec = spec
        self._replicated_residual = conf.replicated_residual.promised
        self._check_residual = conf.replicated_residual is ResidualPromise.CHECKED
        self._lease: Lease | None = lease
        self._op = lease.opened & MAX_OP  # what this op's calls say they are, on every rank
        outcome = lease.entry.outcome
        ws = outcome.workspace
        self._ws: Workspace | None = ws
        self._backend = ws.backend
        self._plan = outcome.plan
        self._attempts = outcome.attempts
        self._shape = OpShape(spec.hidden, TORCH_DTYPES[spec.dtype], spec.dtype,
                              device_of(lease.ctx.device))
        self._topology = outcome.topology
        self._fuses: dict[tuple[str, Pattern], bool] = {}  # (backend, pattern) -> taken whole
        self._unfused: Workspace | None = None
        self._calls = self._fused_calls = self._over_capacity = self._fast_calls = 0
        self._native_calls: Callable[[], int] | None = None  # count_calls_from
        self._broken = ""  # a residual check that timed out: the group is out of step
        # the kernel's own checked entry (it declines what it does not fuse), unless faults
        # must fire on calls or residuals must be compared first
        plain_path = bool(ws.call_fault) or self._check_residual  # every call through Python
        self._fast = None if plain_path else ws.fast_call
        self._fast_moe = None if plain_path else ws.fast_moe_call
        self._fast_fuses = ws.descriptor.fused  # what stats() counts the fast calls as

    # --- what was decided --------------------------------------------------------------------

    @property
    def backend(self) -> str:
        """The backend every rank of the group negotiated (may differ from ``plan.backend``
        when the first candidate failed to create on some rank); ``"closed"`` after close."""
        return self._backend if self._ws is not None else "closed"

    @property
    def plan(self) -> Plan:
        """The plan the group agreed on when its workspace was negotiated."""
        return self._plan

    @property
    def replicated_residual(self) -> bool:
        """Whether this op was made with the promise that every rank passes the same
        residual (``replicated_residual=``, ``ARFUSE_REPLICATED_RESIDUAL``; also ``check``)."""
        return self._replicated_residual

    @property
    def attempts(self) -> tuple[Any, ...]:
        return self._attempts

    @property
    def workspace(self) -> Workspace:
        if self._ws is None:
            raise self._closed_error()
        return self._ws

    @property
    def capacity(self) -> int:
        """Tokens per call that run fused; larger calls run unfused."""
        return self.workspace.capacity

    def kernel_entry(self) -> tuple[Any, int, int] | None:
        """``(kernel module, handle, op code)`` through which native code may run this op's
        plain calls on the kernel's checked fast path, as ``__call__`` does (the compiled
        graphs' operator); ``None`` where every call must pass through Python (no compiled
        kernel, call faults, a checked residual)."""
        if self._fast is None:
            return None
        entry = self.workspace.kernel_entry
        return None if entry is None else (*entry, self._op)

    def input_buffer(self, tokens: int) -> torch.Tensor:
        """A ``[tokens, hidden]`` tensor to compute the next call's ``x`` into (for example
        ``torch.matmul(a, w.t(), out=comm.input_buffer(n))``). On shm it is this rank's
        shared-memory slot, which saves a copy per call; elsewhere a plain tensor. Valid for
        the next call only. On shm the same tensor object comes back for the same slot and
        size (it is cached), so do not change its shape in place."""
        ws = self.workspace
        if isinstance(tokens, bool) or not isinstance(tokens, int):
            raise TypeError(f"tokens must be an int, got {type(tokens).__name__}")
        if tokens < 0:
            raise ValueError(f"tokens={tokens} is not valid; it must be >= 0")
        if tokens > ws.capacity:
            return self._unfused_workspace().input_buffer(tokens)
        return ws.input_buffer(tokens)

    def count_calls_from(self, calls: Callable[[], int]) -> None:
        """``calls()``: the calls native code ran through ``kernel_entry()`` (the compiled
        graphs' operators), counted where they run; ``stats()`` adds them, as fused calls."""
        self._native_calls = calls

    def stats(self) -> dict[str, int]:
        """Calls so far: fused, and unfused (over capacity, or an unfused backend); those run
        through ``kernel_entry()`` included (``count_calls_from``)."""
        fast = self._fast_calls + (self._native_calls() if self._native_calls else 0)
        fused = self._fused_calls + (fast if self._fast_fuses else 0)
        return {"calls": self._calls + fast, "fused": fused,
                "unfused_over_capacity": self._over_capacity,
                "unfused": self._calls + fast - fused}

    # --- the hot path -------------------------------------------------------------------------

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                 weight: torch.Tensor | None = None, eps: float = 1e-6,
                 weight_bias: float = 0.0, quant: str | None = None,
                 scale: float | torch.Tensor | None = None,
                 layout: str | None = None, *, out: torch.Tensor | None = None,
                 residual_out: torch.Tensor | None = None,
                 group_size: int | None = None) -> FusedOutput:
        """See DESIGN 3.6. ``layout`` is the scale layout of a quant that has several (NVFP4:
        ``swizzled_128x4``, its default, or ``linear``; fp8_group: ``fp32``, its default,
        ``fp32_column_major`` or ``ue8m0_packed``). ``group_size``: fp8_group's (32, 64 or
        128 dividing ``hidden_dim``; None: 128); any other quant takes None.

        ``out`` / ``residual_out``: where to write those results instead of new tensors. Each
        may be its own input, ``out=x`` and ``residual_out=residual``: the op then works in
        place, as vLLM's ``fused_add_rms_norm`` does, which saves memory traffic on CPUs.
        Otherwise each must be memory of its own (no overlap with another argument, nor
        with ``input_buffer()``)."""
        fast = self._fast
        if fast is not None:
            result: FusedOutput | None = fast(x, residual, weight, eps, weight_bias, quant,
                                              scale, layout, out, residual_out, self._op,
                                              group_size)
            if result is not None:
                self._fast_calls += 1
                return result
        with self._refused_on_error(None):
            call = self._check(x, residual, weight, eps, weight_bias, quant, scale, layout, out,
                               residual_out, group_size=group_size)
        return self._run(call)

    def moe_finalize(self, expanded: torch.Tensor, expanded_idx_to_permuted_idx: torch.Tensor,
                     expert_scales: torch.Tensor, *, residual: torch.Tensor | None = None,
                     weight: torch.Tensor | None = None, eps: float = 1e-6,
                     weight_bias: float = 0.0,
                     shared_expert_output: torch.Tensor | None = None,
                     routed_scaling_factor: float = 1.0, quant: str | None = None,
                     scale: float | torch.Tensor | None = None,
                     layout: str | None = None, out: torch.Tensor | None = None,
                     residual_out: torch.Tensor | None = None,
                     group_size: int | None = None) -> FusedOutput:
        """The MoE finalize, then the all-reduce pattern of the other keywords (as
        ``__call__``'s), in one call (docs/design.md 3.12): each rank's rows are
        ``(sum_k expert_scales[t,k] * expanded[index[t,k]]) * routed_scaling_factor
        + shared_expert_output[t]`` (an index of -1: none), computed in fp32. ``expanded``:
        ``[P, hidden]`` (the permuted expert outputs); the index: int32 ``[tokens, top_k]``;
        ``expert_scales``: ``[tokens, top_k]``, fp32 or the activation dtype."""
        fast = self._fast_moe
        if fast is not None:
            result: FusedOutput | None = fast(
                expanded, expanded_idx_to_permuted_idx, expert_scales, shared_expert_output,
                routed_scaling_factor, residual, weight, eps, weight_bias, quant, scale, layout,
                out, residual_out, self._op, group_size)
            if result is not None:
                self._fast_calls += 1
                return result
        with self._refused_on_error("moe_finalize"):
            step = moe.check_finalize(self._shape, expanded, expanded_idx_to_permuted_idx,
                                      expert_scales, shared_expert_output,
                                      routed_scaling_factor)
            call = self._check(self.input_buffer(step.tokens), residual, weight, eps,
                               weight_bias, quant, scale, layout, out, residual_out, step,
                               group_size)
        return self._run(call)

    def moe_reduce(self, active_experts_token_input: torch.Tensor, scale_input: torch.Tensor,
                   token_input: torch.Tensor, *, residual: torch.Tensor | None = None,
                   weight: torch.Tensor | None = None, eps: float = 1e-6,
                   weight_bias: float = 0.0, quant: str | None = None,
                   scale: float | torch.Tensor | None = None, layout: str | None = None,
                   out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
                   group_size: int | None = None) -> FusedOutput:
        """The MoE expert reduction, then the all-reduce pattern (docs/design.md 3.12): each
        rank's rows are ``sum_e scale_input[e,t] * active_experts_token_input[e,t]
        + token_input[t]`` in fp32; the inputs are expert-major: ``[experts, tokens, hidden]``
        and ``[experts, tokens]``."""
        fast = self._fast_moe
        if fast is not None:
            result: FusedOutput | None = fast(
                active_experts_token_input, None, scale_input, token_input, 1.0, residual,
                weight, eps, weight_bias, quant, scale, layout, out, residual_out, self._op,
                group_size)
            if result is not None:
                self._fast_calls += 1
                return result
        with self._refused_on_error("moe_reduce"):
            step = moe.check_reduce(self._shape, active_experts_token_input, scale_input,
                                    token_input)
            call = self._check(self.input_buffer(step.tokens), residual, weight, eps,
                               weight_bias, quant, scale, layout, out, residual_out, step,
                               group_size)
        return self._run(call)

    def _open(self) -> Workspace:
        ws = self._ws
        if ws is None or ws.destroyed:
            raise self._closed_error()
        return ws

    def _closed_error(self) -> ArfuseError:
        by = self._closed_by or "close() or arfuse.destroy_all()"
        return ArfuseError(f"this FusedAllReduce is closed (by {by}); make a new one, on "
                           "every rank of the group")

    def _check(self, x: Any, residual: Any, weight: Any, eps: Any, weight_bias: Any,
               quant: Any, scale: Any, layout: Any, out: Any, residual_out: Any,
               experts: moe.ExpertStep | None = None, group_size: Any = None) -> CallArgs:
        """The checked Python path's checks: every error names its argument."""
        ws = self._open()
        shared = ws.shared_span()
        slot = ws.input_slot_start() if shared is not None else None
        call = check_call(self._shape, x, residual, weight, eps, weight_bias, quant, scale,
                          layout, out, residual_out, shared, slot, self._op, group_size)
        if experts is not None:
            moe.check_not_shared(experts, shared)
            call = replace(call, moe=experts)
        return call

    @contextlib.contextmanager
    def _refused_on_error(self, reduction: str | None) -> Iterator[None]:
        """A call whose arguments this rank's checks refuse: the peers may be in the call
        already (their own arguments passed), so meet them with a refusal's signature (a MoE
        step of fan-in 0, which no valid call has; ``moe_finalize``'s for a plain call) before
        raising; each of them raises ``MismatchedCall`` at once and the group stays in step
        (every rank met once). The kernel's fast path declines such a call, so it always comes
        here. A backend whose calls cannot tell (FlashInfer) announces nothing."""
        try:
            yield
        except (ValueError, TypeError):
            ws = self._ws
            if ws is not None and not ws.destroyed and not self._broken:
                empty = torch.empty((0, self._shape.hidden), dtype=self._shape.dtype,
                                    device=self._shape.device)
                with contextlib.suppress(MismatchedCall):
                    ws.announce(CallArgs(x=empty, op=self._op,
                                         moe=moe.refusal(reduction or "moe_finalize", empty)))
            raise

    def _run(self, call: CallArgs) -> FusedOutput:
        """A checked call: the residual check and faults first; over capacity runs unfused."""
        ws = self._open()
        if self._broken:
            raise WorkspaceBroken.after("arfuse", self._broken, group_out_of_step=True)
        if self._check_residual:
            try:
                check_replicated(call, ws.ctx, ws.backend, self._calls + 1)
            except CallTimeout as error:
                self._broken = str(error)
                raise
        if ws.call_fault:
            faults.trigger(ws.call_fault, ws.backend, "call", ws.ctx.rank)
        self._calls += 1
        if call.tokens > ws.capacity:
            self._over_capacity += 1
            ws.announce(call)  # peers under capacity must learn that this call runs elsewhere
            ws = self._unfused_workspace()
        elif ws.descriptor.fused:
            self._fused_calls += 1
        try:
            return run_on(ws, call, lambda pattern: self._takes(ws, pattern))
        except moe.RefusedStep:
            # the peers are in this call already: meet them with a signature no valid call
            # has, so each raises MismatchedCall now instead of waiting for this rank
            if call.moe is not None:
                with contextlib.suppress(MismatchedCall):
                    ws.announce(replace(call, moe=replace(call.moe, refused=True)))
            raise

    def _takes(self, ws: Workspace, pattern: Pattern) -> bool:
        """Whether ``ws`` runs ``pattern`` whole on this group: decided per pattern a call
        asks for (not per spec), so ranks that reach the kernel by different paths agree."""
        key = (ws.backend, pattern)
        fused = self._fuses.get(key)
        if fused is None:
            fused = self._fuses[key] = ws.takes(self._topology, pattern)
        return fused

    def _unfused_workspace(self) -> Workspace:
        """The unfused backend's workspace on the same group, for calls over capacity."""
        if self._unfused is None:
            ws = self.workspace
            self._unfused = catalog.load(catalog.UNFUSED)().create(ws.ctx, ws.spec)
        assert self._unfused is not None
        return self._unfused

    # --- lifetime ----------------------------------------------------------------------------

    def close(self) -> None:
        """Release this op's hold on its workspace (freed with its last user). Idempotent.
        After it, the op holds no reference to the process group."""
        lease, self._lease = self._lease, None
        if lease is not None:
            REGISTRY.release(lease)
            self._closed_by = self._closed_by or "close()"
        self._drop()

    def _revoked(self) -> None:
        """``destroy_all()`` freed the workspace under this op: let go of everything that
        leads to the process group, so that destroying the group frees it."""
        self._lease = None
        self._closed_by = "arfuse.destroy_all()"
        self._drop()

    def _drop(self) -> None:
        if self._unfused is not None:
            self._unfused.destroy()
        self._ws = self._unfused = None
        self._fast = self._fast_moe = None

    def __enter__(self) -> FusedAllReduce:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._ws is None else self.workspace.describe()
        return f"FusedAllReduce({state})"


def run_on(ws: Workspace, call: CallArgs, takes: Callable[[Pattern], bool]) -> FusedOutput:
    """``call`` on ``ws``: whole when ``ws`` takes its pattern whole (``takes``), else in steps
    of their own (the same bytes): a MoE call's expert step in torch when ``ws`` does not take
    the MoE pattern, the quantisation after the op when it does not take that."""
    if call.moe is not None and not takes(call.pattern.without_quant()):
        moe.local_rows(call.moe, call.x)
        call = call.without_moe()
    if call.quant is None or takes(call.pattern):
        return ws.run(call)
    result = ws.run(call.without_quant())
    q_out, s_out = quantize(result.out, call.output, call.scale, call.group_size)
    return FusedOutput(result.out, result.residual_out, q_out, s_out)


def residual_digest(residual: torch.Tensor) -> torch.Tensor:
    """BLAKE2b-128 of the residual's bytes (row-major, as stored), as two int64: residuals that
    differ in any byte give different digests except with a chance of about 2**-128 (a
    cryptographic hash: no change of the values, however arranged, cancels out)."""
    first, second = struct.unpack("<qq", digest_bytes(residual))
    return torch.tensor([first, second], dtype=torch.int64, device=residual.device)


def check_replicated(call: CallArgs, ctx: Any, backend: str, call_number: int) -> None:
    """Collective, on every call of a ``replicated_residual="check"`` op: every rank sends
    whether it passes a residual and its digest, within the group's deadline. Raise on every
    rank ``MismatchedCall`` when some ranks pass a residual and others do not (R11), or
    ``ValueError`` when the residuals' bytes differ."""
    if ctx.world_size <= 1:
        return
    residual = call.residual
    if residual is None:
        mine = torch.zeros(1, 3, dtype=torch.int64, device=call.x.device)
    else:
        mine = torch.cat([torch.ones(1, dtype=torch.int64, device=residual.device),
                          residual_digest(residual)]).view(1, 3)
    every = collective.gather(mine, ctx, "residual-check", backend, call_number)
    rows = every.view(ctx.world_size, 3).cpu().tolist()
    passing = [r for r, row in enumerate(rows) if row[0] == 1]
    if 0 < len(passing) < ctx.world_size:
        others = [r for r in range(ctx.world_size) if r not in passing]
        raise MismatchedCall(
            f"arfuse: ranks {passing} passed a residual and ranks {others} did not (call "
            f"{call_number}); every rank must call with the same pattern")
    differ = [r for r in range(1, ctx.world_size) if rows[r] != rows[0]]
    if differ:
        raise ValueError(
            f"residual differs across ranks (ranks {differ} differ from rank 0), but "
            "replicated_residual='check' promised it the same on every rank; with the promise "
            "(replicated_residual=True) such a call would finish each rank's rows with the "
            "residual of the rank that reduced them")
