"""What crosses between hosts in a hier call (``workspace.py``'s step 2), and how a failure
there reaches every rank: the verdicts (each host's flag and the call's signature), every
host's chunk of the partial sums (whole, in pieces, or in halves), the sum of those chunks
into the gather's slot, and the store records by which a host's first rank, crossing alone,
stops its host's other ranks. ``BetweenHosts`` is ``HierWorkspace``'s part for it: the
methods read the workspace's layout, subgroup, buffers and call count, and mark it broken
when the link fails."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, TypeVar

import torch

from ... import collective, signature
from ...call_checks import CallArgs
from ...epilogue import rank_order_sum
from ...errors import CallTimeout, MismatchedCall, WorkspaceBroken
from ...spec import Spec
from ...torch_types import round_to
from ..shm.workspace import ShmWorkspace
from . import PARTIAL_BYTES, HostLayout

# what a rank tells its peers on the other hosts beside its signature (word 0 of four)
OK, HOST_MISMATCH, HOST_FAILED = 0, 1, 2
# the verdict: five int64 words at the head of the message between hosts (flag, the failed
# host's silent ranks as a mask, the signature's two words, the proposed way of the chunks'
# exchange: ``collective.PieceChoice``)
VERDICTS = collective.Heads(5)
VERDICT_BYTES = VERDICTS.nbytes

HALVES_MIN_BYTES = collective.RIDE_MAX_BYTES
"""Chunks of more fp32 bytes than this cross in halves where they can
(``BetweenHosts.in_halves``): never one that could ride with the verdict."""

_Met = TypeVar("_Met")


class BetweenHosts:
    """``HierWorkspace``'s exchanges between hosts and its failures' agreement."""

    backend: ClassVar[str]
    ctx: Any
    spec: Spec
    layout: HostLayout
    cross_ctx: Any
    host: int
    local: int
    inner: ShmWorkspace | None
    finisher: ShmWorkspace | None
    pieces: collective.PieceChoice
    _calls: int
    _broken: str
    _buffers: collective.Buffers

    @staticmethod
    def _slot(finisher: ShmWorkspace, tokens: int, start: int, end: int) -> torch.Tensor:
        """``finisher``'s input slot for ``tokens`` rows, flat, -0.0 outside [start, end)."""
        slot = finisher.input_buffer(tokens).view(-1)
        slot[:start].fill_(-0.0)
        slot[end:].fill_(-0.0)
        return slot

    def _sum_into(self, out: torch.Tensor, parts: list[torch.Tensor]) -> None:
        """The host-order sum of ``parts`` into ``out`` (a slot's span): in place for fp32;
        else in a kept fp32 buffer, rounded to ``out``'s dtype as the epilogue's ``T(acc)``."""
        if out.dtype == torch.float32:
            rank_order_sum(parts, out=out)
            return
        kept = self._buffers.get("sum", out.numel() * PARTIAL_BYTES)
        out.copy_(round_to(rank_order_sum(parts, out=kept.view(torch.float32)), out.dtype))

    def in_halves(self, call: CallArgs, start: int, end: int) -> bool:
        """Whether this rank's chunk [start, end) crosses in halves (``_cross_halves``): two
        hosts, a 16-bit activation the kernel finishes, and a chunk too large to ride, so
        that the extra exchange costs less than the quarter of the bytes it saves (it never
        replaces a call's only exchange: such a chunk never rides). Alike on every rank
        whose call matches."""
        return (self.layout.host_count == 2 and self.finisher is not self.inner
                and (end - start) % 2 == 0 and (end - start) * PARTIAL_BYTES > HALVES_MIN_BYTES
                and self.kernel_finishes(call))

    def kernel_finishes(self, call: CallArgs) -> bool:
        """Whether step 3's shm call runs ``call``'s epilogue (the kernel fuses its outputs
        for these rows); else that call sums in fp32 and the torch epilogue finishes."""
        return self.finisher is not None and not call.pattern.output.problem(
            self.spec.dtype, self.spec.hidden)

    def _cross_halves(self, call: CallArgs, start: int, mine: torch.Tensor,
                      way: int) -> torch.Tensor:
        """Two hosts, a chunk of fp32 partial ``mine`` (elements from ``start``): host h owns
        half h of it. Its partial of the other half goes over (fp32), the other host's of
        this half comes back; this half's sum in host order, rounded to the activation dtype,
        goes into the finisher's slot and over, and the other half's comes back into the slot:
        a ring's bytes (``3/4`` of the whole chunk's crossing: 16-bit halves come back), the
        same sum. Returns the slot, -0.0 outside the chunk."""
        assert self.finisher is not None
        half = mine.numel() // 2
        own, other = self.host * half, (1 - self.host) * half
        slot = self._slot(self.finisher, call.tokens, start, start + mine.numel())
        theirs = self._buffers.get("halves", half * PARTIAL_BYTES).view(torch.float32)
        piece_bytes = collective.PieceChoice.piece_bytes(way)
        with self._between_hosts("call"):
            collective.exchange_pair(mine[other:other + half].contiguous(), theirs,
                                     self.cross_ctx, "call", self.backend, self._calls,
                                     piece_bytes)
        mine_half = mine[own:own + half]
        self._sum_into(slot[start + own:start + own + half],
                       [mine_half, theirs] if self.host == 0 else [theirs, mine_half])
        with self._between_hosts("call-finished"):
            collective.exchange_pair(
                slot[start + own:start + own + half].view(torch.uint8),
                slot[start + other:start + other + half].view(torch.uint8),
                self.cross_ctx, "call-finished", self.backend, self._calls, piece_bytes)
        return slot

    def _cross(self, payload: torch.Tensor, phase: str,
               way: int = collective.PieceChoice.WHOLE) -> list[torch.Tensor]:
        """``payload`` of the ranks of this local index, host by host (this rank's is
        ``payload`` itself; the others' in a buffer kept for the next call of this phase),
        whole or in pieces (``way``, alike on every rank)."""
        hosts = self.layout.host_count
        rows = self._buffers.get(phase, hosts * payload.numel() * payload.element_size()
                                 ).view(payload.dtype).view(hosts, *payload.shape)
        with self._between_hosts(phase):
            return collective.gather_rows(payload, self.cross_ctx, phase, self.backend,
                                          self._calls, rows,
                                          collective.PieceChoice.piece_bytes(way))

    @contextlib.contextmanager
    def _between_hosts(self, phase: str) -> Iterator[None]:
        """An exchange on the link's group: its timeout, in the group's rank numbers and
        naming hosts, leaves the workspace broken."""
        try:
            yield
        except CallTimeout as error:
            silent = (None if error.silent is None else
                      [self.layout.ranks[h][self.local] for h in error.silent])
            peers = silent if silent is not None else [
                members[self.local] for h, members in enumerate(self.layout.ranks)
                if h != self.host]
            text = (" with " if silent is not None else " with one of ") + ", ".join(
                f"rank {r} on host {self.layout.host_of(r)}" for r in peers)
            if collective.PEER_GONE.search(str(error)):  # a reset, not a deadline
                timeout = CallTimeout(phase, self.backend, silent, self.ctx.timeout_s,
                                      message=collective.peer_gone(
                                          phase, self.backend, silent, self._calls,
                                          f"between hosts{text}: {error}"))
            else:
                timeout = CallTimeout(phase, self.backend, silent, self.ctx.timeout_s,
                                      detail=f" (call {self._calls}, between hosts{text})")
            self._broken = str(timeout)
            raise timeout from None

    def _exchange_verdicts(self, words: tuple[int, int], flag: int, detail: int,
                           chunk: torch.Tensor | None = None, way: int = 0,
                           ) -> tuple[list[tuple[int, ...]], list[torch.Tensor] | None]:
        """Every host's verdict (flag, detail, signature, proposed way of the chunks' exchange:
        ``way`` is this rank's); and, where ``chunk`` has the riding size, every host's chunk
        from the same message (else ``None``). The message's
        size is the same on every rank of the subgroup whatever each one's call and op: the
        verdict and the last matched call's chunk on the subgroup (``collective.agreed_size``,
        bytes), so that calls which differ fail in it."""
        riding = collective.agreed_size(self.cross_ctx.group)
        message = self._buffers.get("verdicts", VERDICT_BYTES + riding)
        VERDICTS.write(message, [0], (flag, detail, *words, way))
        rides = chunk is not None and chunk.numel() * chunk.element_size() == riding
        if rides:
            assert chunk is not None
            message[VERDICT_BYTES:].copy_(chunk.contiguous().view(torch.uint8))
        # no proposal can precede this message: it goes the way host 0 proposed for chunks of
        # its size in the last agreed call, timed for the choice
        riding_way = collective.agreed_way(self.cross_ctx.group)
        with self.pieces.timed(riding, riding_way):
            every = self._cross(message, "call-signature", riding_way)
        verdicts = [VERDICTS.read(e, [0])[0] for e in every]
        return (verdicts,
                [e[VERDICT_BYTES:].view(torch.float32) for e in every] if rides else None)

    def _own_verdicts(self, words: tuple[int, int], flag: int,
                      detail: int) -> list[tuple[int, ...]]:
        """What a rank that does not cross knows of the verdicts: its own host's."""
        return [(flag if h == self.host else OK, detail if h == self.host else 0, *words, 0)
                for h in range(self.layout.host_count)]

    def _follow(self, meet: Callable[[int], _Met], op: int) -> _Met:
        """A call that crosses on the host's first rank alone, on another of its ranks: the
        host's meeting after the crossing (``meet(op)``: the gather, or an announcement's
        second meeting), which the first rank joins with another op word when the call failed
        between hosts (``_release``); this rank then raises what the first rank raised."""
        leader = self.layout.ranks[self.host][0]
        crosses = (f"rank {leader}, the first of {self.layout.hosts[self.host]}, crosses this "
                   f"call for its host")
        try:
            return meet(op)
        except MismatchedCall:
            stop = self._stop_of_the_first()
        except CallTimeout as error:
            # its own exchange, with a deadline as long, may have held it
            failed = CallTimeout(error.phase, self.backend, error.silent, self.ctx.timeout_s,
                                 message=f"{error} ({crosses}: its exchange between hosts may "
                                         "be what held it, its error says)")
            self._broken = str(failed)
            raise failed from None
        if stop is not None and stop.get("type") == "MismatchedCall":
            raise MismatchedCall(f"{stop['text']} ({crosses} and raised this)")
        failed = CallTimeout(
            "call" if stop is None else str(stop["phase"]), self.backend,
            None if stop is None else stop["silent"], self.ctx.timeout_s,
            message=f"{stop['text']} ({crosses} and raised this)" if stop is not None else
            f"arfuse hier: call {self._calls} failed between hosts ({crosses} and stopped it; "
            "its error says why)")
        self._broken = str(failed)
        raise failed

    def _stop_key(self) -> str:
        return f"hier-stop/{self.host}/{self._calls}"

    def _release(self, error: CallTimeout | MismatchedCall, meet: Callable[[int], Any],
                 op: int) -> None:
        """A call that crosses on this rank alone failed between hosts, and the host's other
        ranks wait for it (``meet``): what failed goes to the store for them, then meeting them
        with another op word stops each of them at once (the kernel's mismatch, before any
        rank reads a peer's data). The store may sit on a host this one cannot reach."""
        silent = getattr(error, "silent", None)
        record = json.dumps({"type": type(error).__name__, "phase": getattr(error, "phase", ""),
                             "silent": None if silent is None else list(silent),
                             "text": str(error)})
        collective.ask_store(lambda: self.ctx.channel.post(self._stop_key(), record))
        with contextlib.suppress(MismatchedCall, CallTimeout, WorkspaceBroken):
            meet(op ^ 1)

    def _stop_of_the_first(self) -> dict[str, Any] | None:
        """What the host's first rank recorded when it stopped this call (``None``: the store
        did not say)."""
        channel = self.ctx.channel
        key = f"{channel.prefix}/{self._stop_key()}"
        found = collective.ask_store(lambda: json.loads(channel.store.get(key))
                         if channel.store.check([key]) else None)
        return found if isinstance(found, dict) else None

    def _judge(self, verdicts: list[tuple[int, ...]], why: str) -> None:
        """Every rank reaches the same verdict: each host's ranks agreed among themselves
        (else its flag says not) and with every other host's."""
        failed = [h for h, v in enumerate(verdicts) if v[0] == HOST_FAILED]
        if failed:
            silent = sorted(r for h in failed for i, r in enumerate(self.layout.ranks[h])
                            if verdicts[h][1] >> i & 1)
            hosts = ", ".join(self.layout.hosts[h] for h in failed)
            error = CallTimeout("call", self.backend, silent or None, self.ctx.timeout_s,
                                detail=f" (call {self._calls}; the host step failed on "
                                       f"{hosts}" + (f": {why}" if why else "") + ")")
            self._broken = str(error)
            raise error
        found = self._by_rank(verdicts)
        mismatched = [self.layout.hosts[h] for h, v in enumerate(verdicts)
                      if v[0] == HOST_MISMATCH]
        if mismatched:
            raise MismatchedCall(
                f"arfuse hier: the ranks of the group called with different arguments (call "
                f"{self._calls}; every rank raises this before any rank reads a peer's data, "
                f"so the workspace stays usable for calls that match): the ranks of host(s) "
                f"{', '.join(mismatched)} differ among themselves"
                + (f" ({why})" if why else "; the shm step of that host says how"))
        if any(pair != found[0] for pair in found):
            raise MismatchedCall(signature.mismatch_message("hier", self._calls, found))

    def _by_rank(self, verdicts: list[tuple[int, ...]]) -> list[tuple[int, int]]:
        found: list[tuple[int, int]] = [(0, 0)] * self.ctx.world_size
        for h, members in enumerate(self.layout.ranks):
            for r in members:
                found[r] = (verdicts[h][2], verdicts[h][3])
        return found
