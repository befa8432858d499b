"""The CPU kernel's targets (docs/design.md) and their verdicts from ``arfuse bench`` reports
(one per run) and a ``benchmarks/oversubscribed.py`` report: the median over runs decides,
each run is counted, a missing row is "not measured". ``benchmarks/targets.py`` runs them."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

TOKENS = (1, 8, 64, 512, 2048)
DTYPES = ("bf16", "fp32")
IN_PLACE_MAX = 1.0  # x DeepSpeed's all-reduce alone
NEW_OUTPUTS_MAX = 1.1
FLOOR_MAX = 2.0  # x the one-rate memory floor
FLOOR_FROM_TOKENS = 64
ONE_CORE_CALL_MAX_US = 40.0
ONE_CORE_DECODE_MIN = 1.5  # gloo's decode-like step / arfuse's
OVERHEAD_MAX_US = 3.0
# (target, arfuse bench row, limit) of the ratios to DeepSpeed's all-reduce alone
RATIO_ROWS = (("in place x DeepSpeed", "shm-inplace", IN_PLACE_MAX),
              ("new outputs x DeepSpeed", "shm", NEW_OUTPUTS_MAX),
              ("in place, replicated x DeepSpeed", "shm-inplace-replicated", IN_PLACE_MAX),
              ("new outputs, replicated x DeepSpeed", "shm-replicated", NEW_OUTPUTS_MAX))

# (target, unfused row of a MoE bench, least speedup of the fused call over it)
MOE_SPEEDUP_ROWS = (("MoE: torch step + fused AR / fused", "torch-step+shm", 3.0),
                    ("MoE: torch step + DS + norm / fused", "torch-step+deepspeed+norm", 4.0))


@dataclass
class Verdict:
    """One target at one size: each run's figure, their median, and whether it meets the limit
    (``None``: not measured)."""

    target: str
    dtype: str
    tokens: int | None
    limit: float
    at_most: bool  # True: the figure must be <= limit; False: >= limit
    per_run: list[float] = field(default_factory=list)
    # a speedup's best value on this machine: the unfused row over the fused call's one-rate
    # memory floor (every byte the call must move at the copy rate), per run
    at_floor: list[float] = field(default_factory=list)

    @property
    def median(self) -> float | None:
        return statistics.median(self.per_run) if self.per_run else None

    def meets(self, value: float) -> bool:
        return value <= self.limit if self.at_most else value >= self.limit

    @property
    def met(self) -> bool | None:
        median = self.median
        return None if median is None else self.meets(median)

    @property
    def runs_met(self) -> int:
        return sum(self.meets(v) for v in self.per_run)

    @property
    def out_of_reach(self) -> bool:
        """Not met, and a call at its memory floor would not meet it either (median over runs):
        the limit is beyond this machine, not beyond the kernel."""
        return self.met is False and bool(self.at_floor) and not self.meets(
            statistics.median(self.at_floor))

    def reach_words(self) -> str:
        """The best case at the floor when the limit is out of reach, else ""."""
        return (f"{statistics.median(self.at_floor):.2f}x at the floor" if self.out_of_reach
                else "")

    def met_words(self) -> str:
        if self.met is None:
            return "not measured"
        words = f"{'yes' if self.met else 'no'} ({self.runs_met}/{len(self.per_run)})"
        return f"{words}; {self.reach_words()}" if self.out_of_reach else words


def _row(report: dict[str, Any], dtype: str, tokens: int, backend: str) -> dict[str, Any] | None:
    entry: dict[str, Any]
    for entry in report.get("results", []):
        if (entry.get("dtype"), entry.get("tokens"), entry.get("backend")) == (dtype, tokens,
                                                                                backend):
            return entry
    return None


def verdicts(reports: list[dict[str, Any]], one_core: dict[str, Any] | None,
             tokens: tuple[int, ...] = TOKENS, dtypes: tuple[str, ...] = DTYPES) -> list[Verdict]:
    """Every target's verdict from ``arfuse bench`` reports (one per run) and an
    ``oversubscribed.py`` report (or None). Pure: no I/O."""
    out: list[Verdict] = []
    for dtype in dtypes:
        for t in tokens:
            ratios = [Verdict(name, dtype, t, limit, True) for name, _, limit in RATIO_ROWS]
            floor = Verdict("in place x floor", dtype, t, FLOOR_MAX, True)
            for report in reports:
                ds = _row(report, dtype, t, "deepspeed")
                for verdict, (_, row_name, _) in zip(ratios, RATIO_ROWS, strict=True):
                    row = _row(report, dtype, t, row_name)
                    if ds is not None and row is not None:
                        verdict.per_run.append(row["median_us"] / ds["median_us"])
                ip = _row(report, dtype, t, "shm-inplace")
                if ip is not None and ip.get("x_floor") is not None:
                    floor.per_run.append(float(ip["x_floor"]))
            out += ratios
            if t >= FLOOR_FROM_TOKENS:
                out.append(floor)
        overhead = Verdict("python overhead us", dtype, None, OVERHEAD_MAX_US, True)
        for report in reports:
            value = report.get("python_overhead", {}).get(dtype, {}).get("overhead_us")
            if value is not None:
                overhead.per_run.append(float(value))
        out.append(overhead)
    call = Verdict("one core: 1-token call us", "bf16", 1, ONE_CORE_CALL_MAX_US, True)
    decode = Verdict("one core: decode step gloo / arfuse", "bf16", 1, ONE_CORE_DECODE_MIN, False)
    for row in (one_core or {}).get("rows", []):
        if row.get("placement") == "shared":
            call.per_run.append(float(row["call_us"]))
            decode.per_run.append(float(row["gloo_over_arfuse"]))
    return [*out, call, decode]


def moe_verdicts(reports: list[dict[str, Any]], tokens: tuple[int, ...],
                 dtypes: tuple[str, ...] = DTYPES) -> list[Verdict]:
    """The MoE targets' verdicts from ``arfuse bench --pattern moe_*`` reports: each unfused
    row's median over the fused call's (``shm``), and over the fused call's one-rate floor
    (``at_floor``). Pure: no I/O."""
    out: list[Verdict] = []
    for dtype in dtypes:
        for t in tokens:
            for name, row_name, limit in MOE_SPEEDUP_ROWS:
                verdict = Verdict(name, dtype, t, limit, False)
                for report in reports:
                    fused, row = _row(report, dtype, t, "shm"), _row(report, dtype, t, row_name)
                    if fused is not None and row is not None:
                        verdict.per_run.append(row["median_us"] / fused["median_us"])
                        if fused.get("floor_us"):
                            verdict.at_floor.append(row["median_us"] / fused["floor_us"])
                out.append(verdict)
    return out


def table(found: list[Verdict], machine: dict[str, Any]) -> str:
    lines = [f"{machine.get('cpu', '?')}, kernel {machine.get('kernel_isa', '?')}, "
             f"{machine.get('world_size', 2)} ranks",
             f"{'target':<36} {'dtype':>5} {'tokens':>6} {'limit':>7} {'median':>8}  "
             f"{'met':<12} per run"]
    for v in found:
        median = v.median
        sign = "<=" if v.at_most else ">="
        lines.append(f"{v.target:<36} {v.dtype:>5} {'' if v.tokens is None else v.tokens:>6} "
                     f"{sign}{v.limit:<5g} {'-' if median is None else f'{median:.3f}':>8}  "
                     f"{v.met_words():<12} {' '.join(f'{x:.2f}' for x in v.per_run)}")
    return "\n".join(lines)
