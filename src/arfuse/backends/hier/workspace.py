"""The hierarchical workspace: the shm kernel on each host's ranks, gloo between hosts, the
epilogue in the kernel on the reduced rows (DESIGN 4, "hier").

One call, on every rank (H hosts of L ranks; rank l of host h):

1. host step: ``x`` in fp32 into this rank's shm input slot, a sum-only shm call on the host's
   ranks: every rank of host h holds ``P_h``, the fp32 sum of its host's rows in local rank
   order (the call's whole signature rides in the shm signature's op field, so ranks of a
   host that disagree fail there, R11);
2. between hosts, over the subgroup of local index l (one per index, so the L links run in
   parallel): the verdicts (the signature, and whether the host's step failed, so every rank
   of every host raises at the same call) and chunk l of ``P_h`` (1/L of its elements) to
   every host (``collective.gather_rows``: one exchange; at two hosts, chunks over a piece
   whole or in pieces all in flight, as ``collective.PieceChoice`` learnt for the link);
   chunk l of the sum is ``P_0 + P_1 + ...`` in host order, in fp32. The chunk rides in the
   verdicts' message when it has the size of the last call's (which every rank of the
   subgroup knows alike), so a steady decode crosses once per call; otherwise it crosses
   after the verdicts. Few tokens (the host's whole partial within the riding limit, in the
   last call that went through, which every rank knows alike): the first rank of each host
   crosses the whole ``P_h`` alone, and the others wait in step 3 with empty chunks. Two hosts,
   a 16-bit activation, a chunk too large to ride: the chunk crosses in halves
   (``_cross_halves``), a ring all-reduce's bytes instead of 4/3 of them; when the
   call fails between hosts, the first rank records what it raises in the store and meets
   them there with another op word, which stops them (the kernel's mismatch) to raise it too;
3. host step again, fused: each rank writes its chunk of the sum, rounded to the activation
   dtype as the epilogue's first step rounds it, into a slot of -0.0 (the additive identity of
   IEEE addition, so the slots' sum is that chunk exactly, signed zeros and NaN included), and
   one shm call in the activation dtype gathers the chunks and runs the epilogue (residual,
   RMSNorm, quantisation) in the kernel: the bytes of the torch backend's epilogue
   (``arfuse.epilogue.apply``) on the fp32 sum, which runs instead for a pattern the
   kernel does not fuse (after an fp32 gather).

With one rank per host there is no host step: a rank's rows are its host's sum exactly, and
the call is the torch backend's on the link's group (``HostRows``): the rows cross as they
are, in the activation dtype, with the signature ahead of them (riding with them while the
size stays), added in host order and finished in the kernel where the process has it. Its own
sequence (the verdicts, then the rows into a buffer of every host's) cost measurably more a
call than the torch backend's on the same group.
"""

from __future__ import annotations

import functools
import hashlib
import threading
from dataclasses import replace
from typing import Any

import torch

from ... import collective, moe, signature
from ...call_checks import CallArgs
from ...epilogue import apply
from ...errors import (
    CallTimeout,
    CreationFailed,
    MismatchedCall,
    NegotiationTimeout,
    WorkspaceBroken,
)
from ...pattern import Pattern
from ...result import FusedOutput
from ...spec import Spec
from ..base import Workspace
from ..shm.workspace import ShmWorkspace
from ..torch.workspace import TorchWorkspace
from . import PARTIAL_BYTES, HostLayout
from .link import HOST_FAILED, HOST_MISMATCH, OK, BetweenHosts

ALONE_MAX_BYTES = collective.RIDE_MAX_BYTES
"""The largest host partial (bytes) that crosses on each host's first rank alone
(``HierWorkspace.crosses_alone``): all of it rides with the verdict."""


@functools.lru_cache(maxsize=256)
def _op_word(words: tuple[int, int]) -> int:
    """The call's whole signature folded into the shm signature's op field (a run of calls
    repeats a few signatures: kept)."""
    digest = hashlib.blake2b(repr(words).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & signature.MAX_OP


class HostRows(TorchWorkspace):
    """hier with one rank per host: the torch backend's call on the link's group (the
    group's ranks in host order, which is group rank order here), its errors naming hier."""

    backend = "hier"

    def __init__(self, ctx: Any, spec: Spec):
        super().__init__(ctx, spec, link="the link between hosts")


class HierWorkspace(BetweenHosts, Workspace):
    backend = "hier"

    def __init__(self, ctx: Any, spec: Spec, layout: HostLayout, inner: ShmWorkspace | None,
                 finisher: ShmWorkspace | None, cross_ctx: Any, nbytes: int):
        super().__init__(ctx, spec, nbytes=nbytes, capacity=spec.max_tokens)
        self.layout, self.inner, self.cross_ctx = layout, inner, cross_ctx
        # step 3's workspace, in the activation dtype (``inner`` itself for fp32)
        self.finisher = finisher
        self.host, self.local = layout.where(ctx.rank)
        self._calls = 0
        # whether calls cross on each host's first rank alone: as the last call that went
        # through did (``crosses_alone``), which every rank knows alike, so that calls which
        # differ in size still meet in the same steps and fail there
        self._alone = True
        self._broken = ""
        self._poisoned = False
        self._lock = threading.Lock()
        self._buffers = collective.Buffers()
        # one rank per host: the whole call on the link's group
        self.rows_only = HostRows(cross_ctx, spec) if inner is None else None
        # two hosts: whether chunks over a piece cross whole or in pieces, learnt per link
        self.pieces = (self.rows_only.pieces if self.rows_only is not None else
                       collective.PieceChoice(
                           f"the link between hosts (local index {self.local})",
                           enabled=layout.host_count == 2 and collective.is_gloo(cross_ctx.group)))

    def describe(self) -> str:
        return f"{super().describe()}, {self.layout.describe()}"

    def takes(self, topology: Any, pattern: Pattern) -> bool:
        """Always: the kernel's epilogue (or, for a pattern it does not fuse, the same bytes
        in torch) quantises, and the call's signature carries the quantisation so that ranks
        which differ in it fail together (R11)."""
        return True

    def poison(self) -> None:
        self._poisoned = True
        if self.rows_only is not None:
            self.rows_only.poison()

    # --- the steps ----------------------------------------------------------------------------

    def _host_sum(self, rows: torch.Tensor, op: int) -> torch.Tensor:
        """A sum-only shm call on this host's ranks of ``rows`` (any float dtype), which go
        into this rank's slot as fp32: the fp32 sum in local rank order, on every rank."""
        assert self.inner is not None
        slot = self.inner.input_buffer(rows.shape[0])
        slot.copy_(rows)
        return self.inner.run(CallArgs(x=slot, op=op)).out

    def _filled_slot(self, finisher: ShmWorkspace, tokens: int, start: int,
                     parts: list[torch.Tensor]) -> torch.Tensor:
        """``finisher``'s slot for step 3: -0.0 but for this rank's chunk, the host-order sum
        of ``parts`` (every host's chunk) rounded to the slot's dtype as the epilogue's
        ``T(acc)`` rounds it; ``-0.0 + v == v`` for every ``v``, so the host's slots add up to
        the whole sum."""
        end = start + parts[0].numel()
        slot = self._slot(finisher, tokens, start, end)
        self._sum_into(slot[start:end], parts)
        return slot

    def crosses_alone(self, n: int) -> bool:
        """Whether a call after one of ``n`` elements crosses on each host's first rank alone:
        while the host's whole partial fits the riding message (one exchange between hosts
        then, and the host's other ranks need no link of their own: with more ranks than
        cores, theirs took the CPU that the first ranks' exchange waited for)."""
        return self.layout.local_size > 1 and n * PARTIAL_BYTES <= ALONE_MAX_BYTES

    def _chunk(self, n: int, alone: bool = False) -> tuple[int, int]:
        """[start, end) of this rank's share of ``n`` elements (local index l of L; ``alone``:
        the first rank's all of them)."""
        if alone:
            return (0, n) if self.local == 0 else (n, n)
        parts = self.layout.local_size
        return n * self.local // parts, n * (self.local + 1) // parts

    def _host_words(self, host: int) -> str:
        """How the host step's errors (the shm kernel's, on the host's ranks alone) name its
        ranks: by local index."""
        return (f"the host step of {self.layout.hosts[host]} numbers its ranks by local index: "
                + ", ".join(f"{i} is rank {r}" for i, r in enumerate(self.layout.ranks[host])))

    def _host_failed(self, error: CallTimeout | WorkspaceBroken, step: str) -> CallTimeout:
        """A host step's failure on this host (a peer here died or timed out), in the group's
        rank numbers; it leaves the workspace broken."""
        local = getattr(error, "silent", None)
        members = self.layout.ranks[self.host]
        silent = None if local is None else [members[i] for i in local if 0 <= i < len(members)]
        failed = CallTimeout(step, self.backend, silent, self.ctx.timeout_s,
                             detail=f" (call {self._calls}; the {step} on "
                                    f"{self.layout.hosts[self.host]} failed: {error}; "
                                    f"{self._host_words(self.host)})")
        self._broken = str(failed)
        return failed

    @property
    def fast_call(self) -> Any:
        """One rank per host: the torch backend's fast call on the link (``HostRows``), under
        this workspace's lock as ``run``; else none (the checked Python path)."""
        rows_call = None if self.rows_only is None else self.rows_only.fast_call
        if rows_call is None:
            return None
        lock = self._lock

        def call(*args: Any) -> FusedOutput | None:
            with lock:
                result: FusedOutput | None = rows_call(*args)
                return result
        return call

    def run(self, call: CallArgs) -> FusedOutput:
        with self._lock:
            return self._run(call)

    def _run(self, call: CallArgs) -> FusedOutput:
        if self.rows_only is not None:
            return self.rows_only.run(call)
        assert self.inner is not None
        if self._broken:
            raise WorkspaceBroken.after("arfuse hier", self._broken, group_out_of_step=True)
        if call.moe is not None:
            moe.local_rows(call.moe, call.x)  # the expert step: the reference (moe.py)
        self._calls += 1
        x = torch.zeros_like(call.x) if self._poisoned else call.x
        words = call.signature_words(self.spec.dtype)
        op = _op_word(words)
        alone = self._alone
        partial, flag, detail, why = self._host_step(x, op)
        n = call.tokens * call.x.shape[1]
        start, end = self._chunk(n, alone)
        mine = None if partial is None else partial.reshape(-1)[start:end]
        if alone and self.local != 0:
            if mine is None:
                self._judge(self._own_verdicts(words, flag, detail), why)
            assert mine is not None
            done = self._follow(lambda way: self._gather(call, way, start, [mine]), op)
            self._alone = self.crosses_alone(n)
            return done
        chunk_bytes = (end - start) * PARTIAL_BYTES
        halves = self.in_halves(call, start, end)
        # the exchange to learn a way for: in halves, the partial's half that crosses
        crossing = chunk_bytes // 2 if halves else chunk_bytes
        slot = None
        try:
            verdicts, parts = self._exchange_verdicts(words, flag, detail,
                                                      None if halves else mine,
                                                      self.pieces.propose(crossing))
            self._judge(verdicts, why)
            assert mine is not None
            if halves:
                way = verdicts[0][4]
                with self.pieces.timed(crossing, way):
                    slot = self._cross_halves(call, start, mine, way)
            elif parts is None:
                way = verdicts[0][4]  # host 0's proposal: every rank follows the same
                with self.pieces.timed(chunk_bytes, way):
                    parts = self._cross(mine.contiguous(), "call", way)
        except (CallTimeout, MismatchedCall) as error:
            if alone and mine is not None:  # the host's other ranks wait in the gather
                self._release(error, lambda way: self._gather(call, way, n, [mine[:0]]), op)
            raise
        # the calls matched: the same size on every rank
        rides = chunk_bytes <= collective.RIDE_MAX_BYTES and not halves
        collective.agree_size(self.cross_ctx.group, chunk_bytes if rides else 0,
                              verdicts[0][4])
        done = self._gather(call, op, start, parts or [], slot)
        self._alone = self.crosses_alone(n)
        return done

    def _gather(self, call: CallArgs, op: int, start: int, parts: list[torch.Tensor],
                slot: torch.Tensor | None = None) -> FusedOutput:
        """Step 3: this rank's chunk of the sum (elements from ``start``; ``parts``: every
        host's, to add in host order; or ``slot``, the finisher's slot already holding it,
        after ``_cross_halves``) gathered with the host's others' through one shm call, which
        runs the call's epilogue where the kernel finishes it (else sum only, in fp32, and the
        torch epilogue)."""
        assert self.inner is not None
        try:
            if self.kernel_finishes(call):
                assert self.finisher is not None
                if slot is None:
                    slot = self._filled_slot(self.finisher, call.tokens, start, parts)
                return self.finisher.run(replace(call, x=slot.view(call.tokens, -1), op=op,
                                                 moe=None))
            total = self.inner.run(CallArgs(x=self._filled_slot(
                self.inner, call.tokens, start, parts).view(call.tokens, -1), op=op)).out
        except (CallTimeout, WorkspaceBroken) as error:
            raise self._host_failed(error, "host gather") from None
        return apply(total.view(call.tokens, call.x.shape[1]), call)

    def _host_step(self, x: torch.Tensor,
                   op: int) -> tuple[torch.Tensor | None, int, int, str]:
        """Step 1; a failure is kept (flag, silent ranks as a mask, text) for the peers on the
        other hosts, who must stop at this call too."""
        try:
            return self._host_sum(x, op), OK, 0, ""
        except MismatchedCall as error:
            return None, HOST_MISMATCH, 0, str(error)
        except (CallTimeout, WorkspaceBroken) as error:
            silent = getattr(error, "silent", None) or ()
            mask = sum(1 << s for s in silent if 0 <= s < self.layout.local_size)
            why = f"{error}; {self._host_words(self.host)}"
            self._broken = why
            return None, HOST_FAILED, mask, why

    def announce(self, call: CallArgs) -> None:
        """A call over capacity: the same meeting without data (host step with no rows, the
        signature exchange), so peers whose call differs fail alike (R11)."""
        with self._lock:
            if self.rows_only is not None:
                self.rows_only.announce(call)
                return
            assert self.inner is not None
            if self._broken:
                raise WorkspaceBroken.after("arfuse hier", self._broken, group_out_of_step=True)
            self._calls += 1
            words = call.signature_words(self.spec.dtype)
            op = _op_word(words)
            flag, detail, why = OK, 0, ""
            empty = torch.empty((0, self.spec.hidden), dtype=torch.float32)
            try:
                self.inner.announce(CallArgs(x=empty, op=op))
            except MismatchedCall as error:
                flag, why = HOST_MISMATCH, str(error)
            except (CallTimeout, WorkspaceBroken) as error:
                flag, why = HOST_FAILED, str(error)
                self._broken = why

            def meet(way: int) -> None:  # the host's second meeting, after the crossing
                assert self.inner is not None
                try:
                    self.inner.announce(CallArgs(x=empty, op=way))
                except (CallTimeout, WorkspaceBroken) as error:
                    raise self._host_failed(error, "host step") from None

            if self._alone and self.local != 0:
                if flag != OK:
                    self._judge(self._own_verdicts(words, flag, detail), why)
                self._follow(meet, op)
                return
            try:
                self._judge(self._exchange_verdicts(words, flag, detail)[0], why)
            except (CallTimeout, MismatchedCall) as error:
                if self._alone and flag == OK:
                    self._release(error, meet, op)
                raise
            if self._alone:
                meet(op)

    # --- creation's check, and the end -------------------------------------------------------

    def validate(self) -> None:
        """The whole path once: every rank gives rank+1, every rank must read the group's sum
        (R2); the shm step's own check first."""
        if self.inner is not None:
            self.inner.validate()
        if self.finisher is not None and self.finisher is not self.inner:
            self.finisher.ctx.channel.next_epoch()  # its check's phases are the inner one's
            self.finisher.validate()
        world = self.ctx.world_size
        x = torch.full((1, self.spec.hidden), float(self.ctx.rank + 1),
                       dtype=_torch_dtype(self.spec.dtype))
        try:
            got = self._run(CallArgs(x=x)).out
        except (CallTimeout, MismatchedCall) as exc:
            self._broken = ""
            raise NegotiationTimeout("validate", self.backend, getattr(exc, "silent", None),
                                     self.ctx.timeout_s) from None
        expected = world * (world + 1) / 2
        if not torch.all(got.float() == expected):
            raise CreationFailed(f"functional check failed: the call gave "
                                 f"{got.flatten()[0].item():g}, expected {expected:g}")

    def _free(self) -> None:
        """The host's shm workspace goes; the subgroups stay with the process
        (``backend._SUBGROUPS``), and one that timed out is never freed
        (``collective.keep_for_the_process``)."""
        self._buffers.clear()
        if self.rows_only is not None:
            self.rows_only.destroy()
        if self.finisher is not None and self.finisher is not self.inner:
            self.finisher.destroy()
        self.finisher = None
        if self.inner is not None:
            self.inner.destroy()
            self.inner = None


def _torch_dtype(name: str) -> torch.dtype:
    from ...torch_types import TORCH_DTYPES

    return TORCH_DTYPES[name]
