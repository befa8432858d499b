"""The unfused backend: ``torch.distributed`` on the given group, then the epilogue.

Runs on gloo and NCCL, any world size (1 included), across nodes. The collectives only move
bytes; the sum is taken here, in fp32 and in rank order, so the result is bit-identical on
every rank and to the fused backends' whatever the collective's internal order. It is also the
path every other backend takes for a call over its capacity.

One call, world W (``docs/design.md`` 4, "torch": bytes and collectives per call), every
exchange an ``all_to_all`` (gloo's pairwise exchange is its fastest collective):

* W = 2: each rank sends its peer its rows, adds both in rank order and finishes them: the
  bytes a ring all-reduce sends, in one round instead of two;
* W > 2: each rank owns 1/W of the elements: the first exchange brings it every rank's share,
  which it adds in rank order and rounds to the activation dtype (the epilogue's first step);
  the second sends every rank the rounded shares, and each finishes the whole sum with its own
  residual: a ring's bytes in two rounds.

The call's signature (tokens, hidden, dtype, pattern, op) goes ahead of the rows, so a call
whose ranks disagree fails on every rank (R11) before any rank reads a peer's rows. An
exchange must have one size on every rank whatever each rank's call, so the signature's
message has the size of the last call on the group whose ranks agreed, whichever op made it
(``collective.agreed_size``: ops called in different orders fail with ``MismatchedCall``); a
call of that size up to ``collective.RIDE_MAX_BYTES`` per destination rides in it (a run of
decode steps exchanges once per call), other calls send their signature, then their rows
(larger rows go straight from the caller's tensor, uncopied; at W = 2, whole or in pieces as
``collective.PieceChoice`` learnt for the group, rank 0's proposal riding in the signature's
message; the message itself, riding rows over a piece, goes the way rank 0 proposed for rows
of its size in the last agreed call). Every wait has the group's
deadline (R8); a rank that times out posts that in the group's store, so the ranks that did
call can name the ones that did not, and the workspace refuses every later call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ... import collective, moe, signature
from ...call_checks import CallArgs
from ...catalog import UNLIMITED
from ...dtypes import DTYPES
from ...errors import (
    CallTimeout,
    CreationFailed,
    MismatchedCall,
    NegotiationTimeout,
    WorkspaceBroken,
)
from ...pattern import OUTPUT_OF_CODE
from ...result import FusedOutput
from ...spec import Spec
from ...torch_types import device_of
from ..base import Backend, Workspace
from ..shm import build as shm_build
from .finish import finish

HEADS = collective.Heads(3)
"""The head of a message: the call's two signature words and the sender's proposed way for
the rows' exchange (``collective.PieceChoice``), int64."""
SIGNATURE_BYTES = HEADS.nbytes


@dataclass
class _Message:
    """The signature message of one riding size on this rank: each destination's part (its
    size and start) and the buffers it goes from and into, with the heads' memory and two
    ranks' rows views, kept while calls repeat the size: making them per call cost more than
    a few tokens' bytes take to cross."""

    riding: int
    splits: list[int]
    starts: list[int]
    send: torch.Tensor
    receive: torch.Tensor
    send_memory: Any
    receive_memory: Any
    rows: dict[tuple[torch.dtype, torch.Size], tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict)

    def pair_rows(self, me: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Two ranks: where ``x``'s bytes ride to the peer, and where the peer's arrive, each
        typed and shaped as ``x``."""
        key = (x.dtype, x.shape)
        views = self.rows.get(key)
        if views is None:
            data = self.starts[1 - me] + SIGNATURE_BYTES
            end = data + x.numel() * x.element_size()
            views = (self.send[data:end].view(x.dtype).view(x.shape),
                     self.receive[data:end].view(x.dtype).view(x.shape))
            self.rows[key] = views
        return views


class TorchWorkspace(Workspace):
    backend = "torch"

    def __init__(self, ctx: Any, spec: Spec, link: str = "the torch backend's group"):
        super().__init__(ctx, spec, nbytes=0, capacity=UNLIMITED)
        self._poisoned = False
        self._calls = 0
        self._broken = ""
        self._buffers = collective.Buffers()
        self._kept_message: _Message | None = None
        # ``link``: how the log names what the rows cross
        self.pieces = collective.PieceChoice(link, enabled=collective.is_gloo(ctx.group))

    def poison(self) -> None:
        self._poisoned = True

    def takes(self, topology: Any, pattern: Any) -> bool:
        """Always: the epilogue quantises, and the call's signature carries the quantisation
        and its layout so ranks that differ in them fail together (R11)."""
        return True

    # --- the exchange ---------------------------------------------------------------------

    def _exchange(self, send: torch.Tensor, receive: torch.Tensor, send_splits: list[int],
                  receive_splits: list[int], phase: str) -> torch.Tensor:
        """One ``all_to_all``; a timeout leaves the group out of step, so this workspace
        refuses every later call."""
        try:
            return collective.all_to_all(send, receive, send_splits, receive_splits, self.ctx,
                                         phase, self.backend, self._calls)
        except CallTimeout as error:
            self._broken = str(error)
            raise

    def _pair(self, mine: torch.Tensor, theirs: torch.Tensor, phase: str, way: int) -> None:
        """Two ranks: ``mine`` to the peer, its bytes into ``theirs``, whole or in pieces."""
        try:
            collective.exchange_pair(mine, theirs, self.ctx, phase, self.backend, self._calls,
                                     collective.PieceChoice.piece_bytes(way))
        except CallTimeout as error:
            self._broken = str(error)
            raise

    def _message(self, device: torch.device) -> _Message:
        """The signature message of the group's agreed size (``SIGNATURE_BYTES + riding``
        bytes to each peer, the signature alone to this rank), kept while calls repeat it."""
        riding = collective.agreed_size(self.ctx.group)
        kept = self._kept_message
        if kept is not None and kept.riding == riding and kept.send.device == device:
            return kept
        self._kept_message = None  # its buffers may be remade below
        world, me = self.ctx.world_size, self.ctx.rank
        splits = [SIGNATURE_BYTES + (riding if j != me else 0) for j in range(world)]
        send = self._buffers.get("send", sum(splits), device)
        receive = self._buffers.get("receive", sum(splits), device)
        message = _Message(riding, splits, [sum(splits[:j]) for j in range(world)], send,
                           receive, HEADS.memory(send), HEADS.memory(receive))
        self._kept_message = message
        return message

    def _meet(self, words: tuple[int, int], shares: Callable[[int], torch.Tensor] | None,
              device: torch.device, way: int = collective.PieceChoice.WHOLE,
              ) -> tuple[_Message, int]:
        """The signature's exchange; with ``shares`` (the call rides) each peer's part
        carries the share meant for it after the signature (``_Message.pair_rows`` for two
        ranks: there ``shares`` is ``None`` and the caller has put its rows in place). Returns
        the message (what each rank sent this one follows its signature in ``receive``) and
        the way rank 0 proposed for the rows' exchange (``way``: this rank's); raises
        ``MismatchedCall`` on every rank where the signatures differ."""
        world, me = self.ctx.world_size, self.ctx.rank
        message = self._message(device)
        splits, starts, send, receive = (message.splits, message.starts, message.send,
                                         message.receive)
        HEADS.write(send, starts, (*words, way), message.send_memory)
        if shares is not None:
            for j in range(world):
                if j != me:
                    piece = shares(j)
                    data = starts[j] + SIGNATURE_BYTES
                    send[data:data + piece.numel()].copy_(piece)
        riding = message.riding
        if world == 2 and self.pieces.enabled and riding > collective.PIECE_BYTES:
            # rows over a piece ride: the way rank 0 proposed for their size in the last
            # agreed call (no proposal can precede this message), timed for the choice
            peer = slice(starts[1 - me], starts[1 - me] + splits[1 - me])
            own = slice(starts[me], starts[me] + splits[me])
            receive[own].copy_(send[own])
            riding_way = collective.agreed_way(self.ctx.group)
            with self.pieces.timed(riding, riding_way):
                self._pair(send[peer], receive[peer], "call-signature", riding_way)
        else:
            self._exchange(send, receive, splits, splits, "call-signature")
        values = HEADS.read(receive, starts, message.receive_memory)
        first = values[0][:2]
        if any(value[:2] != first for value in values):
            found = [(int(value[0]), int(value[1])) for value in values]
            raise MismatchedCall(signature.mismatch_message(self.backend, self._calls, found))
        return message, int(values[0][2])

    def _parts(self, call: CallArgs, rows: bool = True) -> list[torch.Tensor]:
        """Every rank's rows (W = 2), or the whole rank-order sum rounded to the activation
        dtype (W > 2), each ``[T, H]``; without ``rows``, the signature alone (a call this
        rank refused), and nothing."""
        x = (torch.zeros_like(call.x) if self._poisoned else call.x).contiguous()
        world, me, device = self.ctx.world_size, self.ctx.rank, x.device
        whole = world == 2  # two ranks: each sends its peer all its rows
        elem = x.element_size()
        share = x.numel() if whole else -(-x.numel() // world)  # elements per owner
        size = share * elem
        rides = rows and size == collective.agreed_size(self.ctx.group)
        words = call.signature_words(self.spec.dtype)
        if whole:
            if rides:  # x's bytes go in the message itself
                outgoing, incoming = self._message(device).pair_rows(me, x)
                outgoing.copy_(x)
            message, way = self._meet(words, None, device, self.pieces.propose(size))
        else:
            flat = x.view(-1).view(torch.uint8)
            bounds = [min(j * share, x.numel()) * elem for j in range(world + 1)]

            def piece(j: int) -> torch.Tensor:  # what rank j gets: share j
                return flat[bounds[j]:bounds[j + 1]]

            message, way = self._meet(words, piece if rides else None, device)
        if not rows:
            return []
        # agreed: alike on every rank
        collective.agree_size(self.ctx.group, size if size <= collective.RIDE_MAX_BYTES else 0,
                              way)
        if whole:
            if rides:
                theirs = incoming
            else:
                received = self._buffers.get("rows", size, device)
                with self.pieces.timed(size, way):
                    self._pair(x.view(-1).view(torch.uint8), received, "call", way)
                theirs = received.view(x.dtype).view(x.shape)
            return [x, theirs] if me == 0 else [theirs, x]
        mine = bounds[me + 1] - bounds[me]
        if rides:
            data = [start + SIGNATURE_BYTES for start in message.starts]
            received_shares = [piece(me) if j == me else
                               message.receive[data[j]:data[j] + mine] for j in range(world)]
        else:
            block = self._buffers.get("rows", world * mine, device)
            self._exchange(flat, block, [bounds[j + 1] - bounds[j] for j in range(world)],
                           [mine] * world, "call")
            received_shares = list(block.view(world, mine))
        return [self._gathered_sum(received_shares, x, bounds)]

    def _gathered_sum(self, received: list[torch.Tensor], x: torch.Tensor,
                      bounds: list[int]) -> torch.Tensor:
        """W > 2: this rank's share of every rank's rows (bytes, rank by rank), added in rank
        order and rounded to the activation dtype, sent to every rank; every owner's share
        back: the whole sum, ``[T, H]``."""
        world = self.ctx.world_size
        mine = received[0].numel()
        shares = [received[j].view(x.dtype).view(1, -1) for j in range(world)]
        total = self._buffers.get("sum", bounds[-1], x.device)
        if mine:
            summed = finish(shares, CallArgs(x=shares[0])).out.view(-1).view(torch.uint8)
            send = summed.repeat(world)
        else:
            send = total[:0]
        self._exchange(send, total, [mine] * world,
                       [bounds[j + 1] - bounds[j] for j in range(world)], "call")
        return total.view(x.dtype).view(x.shape)

    # --- the workspace's entries ------------------------------------------------------------

    def validate(self) -> None:
        # Every rank contributes rank+1 in a known pattern; everyone checks the same sum.
        self.ctx.barrier("validate", self.backend)
        world, rank = self.ctx.world_size, self.ctx.rank
        x = torch.full((1, 8), float(rank + 1), dtype=torch.float32,
                       device=device_of(self.ctx.device))
        if world == 1:
            got = x.clone()
        else:
            contribution = torch.zeros_like(x) if self._poisoned else x
            try:
                parts = collective.gather(contribution, self.ctx, "validate", self.backend,
                                          self._calls)
            except CallTimeout as exc:  # the ranks are out of step: negotiation ends
                raise NegotiationTimeout("validate", self.backend, exc.silent,
                                         self.ctx.timeout_s) from None
            got = parts.sum(0)
        expected = world * (world + 1) / 2
        if not torch.all(got == expected):
            raise CreationFailed(
                f"functional check failed: all-reduce gave {got.flatten()[0].item():g}, "
                f"expected {expected:g}")

    def announce(self, call: CallArgs) -> None:
        """Exchange this call's signature alone (a MoE call this rank refused): the peers,
        which exchange theirs at the start of the same call, raise ``MismatchedCall`` too."""
        if self._broken:
            raise WorkspaceBroken.after(f"arfuse {self.backend}", self._broken,
                                        group_out_of_step=True)
        self._calls += 1
        if self.ctx.world_size > 1:
            self._parts(call, rows=False)

    @property
    def fast_call(self) -> Any:
        """On a CPU whose process has the kernel: ``kernel_checked`` (``check_call``'s rules
        in C++, a fraction of their Python cost), then ``run``; ``None`` from it (anything
        unusual, every bad argument) sends the call to the checked Python path, which
        raises."""
        module = shm_build.loaded()
        if module is None or self.ctx.device != "cpu":
            return None
        hidden, dtype = self.spec.hidden, DTYPES[self.spec.dtype].code

        def call(x: Any, residual: Any, weight: Any, eps: Any, weight_bias: Any, quant: Any,
                 scale: Any, layout: Any, out: Any, residual_out: Any, op: int,
                 group_size: Any) -> FusedOutput | None:
            checked = kernel_checked(module, hidden, dtype, x, residual, weight, eps,
                                     weight_bias, quant, scale, layout, out, residual_out, op,
                                     group_size)
            if checked is None or self.destroyed:  # the Python path says why
                return None
            return self.run(checked)
        return call

    def run(self, call: CallArgs) -> FusedOutput:
        if self._broken:
            raise WorkspaceBroken.after(f"arfuse {self.backend}", self._broken,
                                        group_out_of_step=True)
        if call.moe is not None:
            moe.local_rows(call.moe, call.x)  # the expert step: the reference (moe.py)
        self._calls += 1
        if self.ctx.world_size == 1:
            x = torch.zeros_like(call.x) if self._poisoned else call.x
            return finish([x.contiguous()], call)
        return finish(self._parts(call), call)

    def _free(self) -> None:
        """The kept message buffers."""
        self._kept_message = None
        self._buffers.clear()


def kernel_checked(module: Any, hidden: int, dtype: int, x: Any, residual: Any, weight: Any,
                   eps: Any, weight_bias: Any, quant: Any, scale: Any, layout: Any, out: Any,
                   residual_out: Any, op: int, group_size: Any) -> CallArgs | None:
    """What ``check_call`` makes of a call on a CPU workspace of ``hidden`` and kernel dtype
    code ``dtype`` with no shared memory, from the kernel's checks (``module``: the loaded
    kernel); ``None`` where it would raise, or for anything the kernel leaves to Python
    (numbers that are tensors or NumPy scalars, a call of no tokens)."""
    numbers = module.checked_numbers(hidden, dtype, x, residual, weight, eps, weight_bias,
                                     quant, scale, layout, out, residual_out, group_size)
    if numbers is None:
        return None
    eps_f, bias_f, code, scale_f, group = numbers
    output = OUTPUT_OF_CODE[code]
    return CallArgs(x, residual, weight, eps_f, bias_f, output.quant,
                    None if output.scale_in == "none" else scale_f, output.layout, out,
                    residual_out, op, group)


class TorchBackend(Backend):
    name = "torch"

    def local_check(self, ctx: Any, spec: Spec) -> str:
        """Never refuses. On a CPU it loads the shm kernel (built once per user), whose sum and
        epilogue the calls then use: loaded here, before any group meets, so that no call waits
        for a compiler while its peers wait for it."""
        if ctx.device == "cpu":
            shm_build.load()
        return ""

    def create(self, ctx: Any, spec: Spec) -> Workspace | None:
        # every rank, at one point of the group's collective order (before a fault may stop it)
        collective.agree_size(ctx.group, 0)
        mode = ctx.fault(self.name, "create")
        if mode == "none":
            return None
        workspace = TorchWorkspace(ctx, spec)
        if mode == "null":  # succeeds broken: validate must catch it
            workspace.poison()
        return workspace
