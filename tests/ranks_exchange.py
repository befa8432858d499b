"""Rank bodies for the torch backend's exchange: collectives and bytes per call, calls whose
size changes, calls that differ after a run of matching ones. Module level, so they can be
pickled."""

from __future__ import annotations

from typing import Any

import torch

HIDDEN = 256


def _inputs(rank: int, tokens: int, hidden: int = HIDDEN) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s rows and the residual (the same on every rank), from fixed seeds: any
    rank can make any other's."""
    gen = torch.Generator().manual_seed(1000 * tokens + rank)
    rows = torch.randn(tokens, hidden, generator=gen)
    residual = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens))
    return rows, residual


def _expected(world: int, tokens: int, hidden: int = HIDDEN) -> torch.Tensor:
    """The torch epilogue's ``out`` on the rank-order fp32 sum (the documented bytes)."""
    from arfuse.call_checks import CallArgs
    from arfuse.epilogue import apply

    parts = [_inputs(r, tokens, hidden) for r in range(world)]
    acc = parts[0][0].clone()
    for rows, _ in parts[1:]:
        acc.add_(rows)
    call = CallArgs(x=parts[0][0], residual=parts[0][1], weight=torch.ones(hidden))
    return apply(acc, call).out


def traffic_per_call(rank: int, world: int, sizes: list[int],
                     hidden: int = HIDDEN) -> list[dict[str, Any]]:
    """One call per entry of ``sizes`` (tokens): the collectives and bytes this rank sent in
    it, and whether its ``out`` is the documented sum's bytes."""
    import arfuse
    from arfuse import collective

    comm = arfuse.FusedAllReduce(max_token_num=max(sizes), hidden_dim=hidden,
                                 dtype=torch.float32, backend="torch", strict=True,
                                 timeout_s=30)
    report = []
    for tokens in sizes:
        rows, residual = _inputs(rank, tokens, hidden)
        before = (collective.TRAFFIC.collectives, collective.TRAFFIC.bytes_sent)
        out = comm(rows, residual=residual, weight=torch.ones(hidden)).out
        report.append({"collectives": collective.TRAFFIC.collectives - before[0],
                       "bytes": collective.TRAFFIC.bytes_sent - before[1],
                       "exact": torch.equal(out.view(torch.int32),
                                            _expected(world, tokens, hidden).view(torch.int32))})
    comm.close()
    return report


def differ_after_matching(rank: int, world: int, tokens: list[list[int]]) -> list[str]:
    """Calls ``tokens[i][rank]`` in turn (hidden 32, fp32, plain): how each ends here."""
    import arfuse

    comm = arfuse.FusedAllReduce(max_token_num=1 << 14, hidden_dim=32, dtype=torch.float32,
                                 backend="torch", strict=True, timeout_s=20)
    ended = []
    for call in tokens:
        x = torch.full((call[rank], 32), float(rank + 1))
        try:
            out = comm(x).out
            ended.append("ok" if bool((out == world * (world + 1) / 2).all()) else "wrong sum")
        except Exception as exc:
            ended.append(type(exc).__name__)
    comm.close()
    return ended


def ops_in_different_orders(rank: int, world: int, backend: str | None) -> dict[str, Any]:
    """Two ops of one group (hidden 64 and 128, fp32), each with matching calls first (so each
    has its own last size), then called in different orders by the two halves of the group:
    how each call ends here, then whether matching calls still give the sum."""
    import arfuse

    ops = [arfuse.FusedAllReduce(max_token_num=8, hidden_dim=hidden, dtype=torch.float32,
                                 backend=backend, timeout_s=20) for hidden in (64, 128)]

    def call(op: Any, tokens: int) -> str:
        hidden = op.spec.hidden
        try:
            out = op(torch.full((tokens, hidden), float(rank + 1))).out
        except Exception as exc:
            return type(exc).__name__
        return "ok" if bool((out == world * (world + 1) / 2).all()) else "wrong sum"

    first = [call(ops[0], 4), call(ops[1], 2), call(ops[0], 4)]
    order = ops if rank < world // 2 else ops[::-1]
    crossed = [call(op, 4) for op in order]
    after = [call(ops[0], 4), call(ops[1], 2)]
    backends = sorted({op.backend for op in ops})
    for op in ops:
        op.close()
    return {"first": first, "crossed": crossed, "after": after, "backends": backends}


def ways_per_call(rank: int, world: int, backend: str | None, calls: int, tokens: int,
                  flip: bool) -> dict[str, Any]:
    """``calls`` calls of ``tokens`` rows (fp32, hidden 4096, over a piece): per call the way
    this rank exchanged the rows (whole, or in pieces: ``collective.PieceChoice``) and whether
    its ``out`` is the documented sum's bytes; the ways its choice kept. With ``flip``, rank 1
    proposes the opposite of what its own choice says: it must still follow rank 0's."""
    import arfuse
    from arfuse import collective

    hidden = 4096
    proposed = collective.PieceChoice.propose
    if flip and rank == 1:
        def opposite(self: Any, nbytes: int) -> int:
            way = proposed(self, nbytes)
            return 1 - way if nbytes > collective.PIECE_BYTES else way
        collective.PieceChoice.propose = opposite  # type: ignore[method-assign]
    real, ways = collective.exchange_pair, []

    def seen(*args: Any) -> None:
        ways.append("pieces" if args[-1] else "whole")
        real(*args)

    collective.exchange_pair = seen
    comm = arfuse.FusedAllReduce(max_token_num=tokens, hidden_dim=hidden, dtype=torch.float32,
                                 backend=backend, strict=backend is not None, timeout_s=30)
    per_call, exact = [], []
    try:
        for _ in range(calls):
            rows, residual = _inputs(rank, tokens, hidden)
            before = len(ways)
            out = comm(rows, residual=residual, weight=torch.ones(hidden)).out
            per_call.append(ways[before:])
            exact.append(torch.equal(out.view(torch.int32),
                                     _expected(world, tokens, hidden).view(torch.int32)))
        chosen = comm.workspace.pieces.chosen()  # type: ignore[attr-defined]
        used = comm.backend
    finally:
        collective.exchange_pair = real
        collective.PieceChoice.propose = proposed  # type: ignore[method-assign]
    comm.close()
    return {"ways": per_call, "exact": exact, "chosen": chosen, "backend": used}
