"""A bench report as text (the table, the ratios to DeepSpeed and to the memory floor) and as
files: ``bench.json``, ``bench.txt``, ``bench.png``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..pattern import DEFAULT_GROUP_SIZE, quant_output
from .options import BASELINE
from .targets import moe_verdicts


def _size(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def _dtype_table(report: dict[str, Any], dname: str) -> list[str]:
    """One dtype's medians and p90s per backend and size, with the ratio to the baseline."""
    options = report["options"]
    rows = [r for r in report["results"] if r["dtype"] == dname]
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    lines = [f"\n{dname}, hidden {options['hidden']}, world size {options['world_size']} "
             f"(us: median / p90; x = {BASELINE} median / this median){_moe_words(options)}",
             f"{'tokens':>7}" + "".join(f" {b:>26}" for b in backends)]
    for tokens in options["tokens"]:
        by = {r["backend"]: r for r in rows if r["tokens"] == tokens}
        base = by.get(BASELINE, {}).get("median_us")
        cells = []
        for b in backends:
            r = by.get(b)
            if r is None:
                cells.append(f" {'-':>26}")
                continue
            ratio = f"{base / r['median_us']:.1f}x" if base else ""
            cells.append(f" {r['median_us']:>9.1f} / {r['p90_us']:>8.1f} {ratio:>6}")
        lines.append(f"{tokens:>7}" + "".join(cells))
    if options.get("pattern", "residual_rmsnorm") != "residual_rmsnorm":
        lines.extend(_versus_fused_moe(report, dname))
    else:
        lines.extend(_versus_deepspeed(rows, options["tokens"]))
    lines.extend(_versus_floor(rows, options["tokens"]))
    return lines


def _moe_words(options: dict[str, Any]) -> str:
    pattern = options.get("pattern", "residual_rmsnorm")
    if pattern == "residual_rmsnorm":
        quant = options.get("quant")
        if quant is None:
            return ""
        grouped = quant_output(quant).grouped
        group = f" group_size {options.get('group_size') or DEFAULT_GROUP_SIZE}" if grouped else ""
        layout = f" {options['scale_format']}" if options.get("scale_format") else ""
        return (f"; every row quantises: {quant}{layout}{group} (the unfused rows after "
                "their RMSNorm)")
    fan_in = (f"top_k {options['top_k']} of {options['experts']} experts, a shared expert"
              if pattern == "moe_finalize" else f"{options['top_k']} experts' rows")
    return (f"; {pattern} ({fan_in}): shm = the fused call, the other rows run torch's expert "
            "step (gather + bmm) first")


def _versus_fused_moe(report: dict[str, Any], dname: str) -> list[str]:
    """Each unfused row's median over the fused MoE call's, against its target; where it is
    not met, and a fused call at its one-rate floor would not meet it either, that best case."""
    found = moe_verdicts([report], tuple(report["options"]["tokens"]), (dname,))
    names = list(dict.fromkeys(v.target for v in found))
    lines = [f"{'':>7}" + "".join(f" {n[5:]:>48}" for n in names)]
    for tokens in report["options"]["tokens"]:
        cells = []
        for v in (v for v in found if v.tokens == tokens):
            reach = f"; {v.reach_words()}" if v.out_of_reach else ""
            cell = "-" if v.median is None else (
                f"{v.median:.2f}x (>= {v.limit:g}x: {'met' if v.met else 'not met'}{reach})")
            cells.append(f" {cell:>48}")
        lines.append(f"{tokens:>7}" + "".join(cells))
    return lines


def _notes(report: dict[str, Any]) -> list[str]:
    """Python overhead, copy modes, negotiation, DeepSpeed and the machine, a line each."""
    lines = []
    for dname, o in report.get("python_overhead", {}).items():
        if o:
            lines.append(f"\npython overhead ({dname}, 1 token): {o['overhead_us']:.2f} us per "
                         f"call over a direct call of the compiled kernel (median of paired "
                         f"differences; op {o['op_median_us']:.2f} us, kernel called directly "
                         f"{o['kernel_median_us']:.2f} us); outside the kernel's own work: "
                         f"{o['outside_kernel_us']:.2f} us with new outputs, "
                         f"{o['outside_kernel_inplace_us']:.2f} us in place")
    for dname, modes in report.get("copy_modes", {}).items():
        lines.append(f"copy into the shared slot ({dname}, chosen by the kernel per size): "
                     + ", ".join(f"{_size(int(b))}+ {m}" for b, m in modes.items()))
    for dname, n in report.get("negotiation", {}).items():
        lines.append(f"negotiation ({dname}): {n['seconds'] * 1e3:.1f} ms ({n['path']} path)")
    if report.get("deepspeed"):
        lines.append(f"deepspeed: {report['deepspeed']}")
    m = report["machine"]
    lines.append(f"machine: {m['cpu']}, {m['cores']} cores, {m['isa']}, torch {m['torch']}, "
                 f"ranks pinned: {m['ranks_pinned']}; shm kernel built for "
                 f"{m.get('kernel_isa', 'an unrecorded ISA')}")
    return lines


def table(report: dict[str, Any]) -> str:
    """Median and p90 per backend and size, with the ratio to the baseline."""
    lines = []
    for dname in report["options"]["dtypes"]:
        lines.extend(_dtype_table(report, dname))
    lines.extend(_notes(report))
    return "\n".join(lines)


def _versus_deepspeed(rows: list[dict[str, Any]], tokens: list[int]) -> list[str]:
    """Each arfuse row's median as a multiple of DeepSpeed's all-reduce alone (< 1: faster)."""
    ds = {r["tokens"]: r["median_us"] for r in rows if r["backend"] == "deepspeed"}
    ours = [b for b in dict.fromkeys(r["backend"] for r in rows) if b.startswith("shm")]
    if not ds or not ours:
        return []
    lines = [f"{'':>7}" + "".join(f" {b + ' / deepspeed':>26}" for b in ours)]
    for n in tokens:
        by = {r["backend"]: r["median_us"] for r in rows if r["tokens"] == n}
        cells = [f" {by[b] / ds[n]:>25.2f}x" if b in by and n in ds else f" {'-':>26}"
                 for b in ours]
        lines.append(f"{n:>7}" + "".join(cells))
    return lines


def _versus_floor(rows: list[dict[str, Any]], tokens: list[int]) -> list[str]:
    """Each row's median as a multiple of its memory floor: the bytes it must move at the
    local copy rate measured in the same run for that working set (``floor``), and each kind
    of byte at its own measured rate (``measured``: lines from a peer's core, new outputs)."""
    floored = [b for b in dict.fromkeys(r["backend"] for r in rows)
               if any(r["backend"] == b and "x_floor" in r for r in rows)]
    if not floored:
        return []
    lines = [f"{'':>7} {'GiB/s: copy':>11} {'shared':>6} {'peer':>5} {'fresh':>5}"
             + "".join(f" {b + ' / floor, measured':>30}" for b in floored)]
    for n in tokens:
        by = {r["backend"]: r for r in rows if r["tokens"] == n and "x_floor" in r}
        if not by:
            continue
        any_row = next(iter(by.values()))
        cells = [f" {by[b]['x_floor']:>21.2f}x, {_ratio(by[b].get('x_measured_floor'))}"
                 if b in by else f" {'-':>30}" for b in floored]
        lines.append(f"{n:>7} {any_row['copy_gib_s']:>11.1f} "
                     f"{_rate(any_row.get('shared_write_gib_s')):>6} "
                     f"{_rate(any_row.get('peer_read_gib_s')):>5}"
                     f" {any_row['fresh_write_gib_s']:>5.1f}" + "".join(cells))
    lines.append("(floor: every byte the row must move at the copy rate; measured: its own "
                 "lines at the copy rate, its input into shared memory at the shared rate "
                 "(lines the peer read last), lines from the peer's core at the peer rate, new "
                 "output tensors at the fresh rate; each rate measured in this run)")
    return lines


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _ratio(value: float | None) -> str:
    return f"{'-':>6}" if value is None else f"{value:>5.2f}x"


def write_table(report: dict[str, Any], out: Path) -> str:
    """``bench.json`` and ``bench.txt`` in ``out``; the table written."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(report, indent=2))
    text = table(report)
    (out / "bench.txt").write_text(text + "\n")
    return text


def write_plot(report: dict[str, Any], out: Path) -> str:
    """``bench.png`` in ``out`` (when matplotlib is there); which files the report is in."""
    try:
        plot(report, out / "bench.png")
        return f"wrote {out / 'bench.json'}, {out / 'bench.txt'}, {out / 'bench.png'}"
    except ImportError:
        return (f"wrote {out / 'bench.json'}, {out / 'bench.txt'} (no plot: pip install "
                "'arfuse[bench]' for matplotlib)")


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = report["options"]["dtypes"]
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 4.5), squeeze=False)
    for ax, dname in zip(axes[0], dtypes, strict=True):
        rows = [r for r in report["results"] if r["dtype"] == dname]
        for backend in dict.fromkeys(r["backend"] for r in rows):
            pts = sorted((r["tokens"], r["median_us"]) for r in rows if r["backend"] == backend)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=backend)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens per call")
        ax.set_ylabel("median latency (us)")
        ax.set_title(f"{dname}, hidden {report['options']['hidden']}, "
                     f"{report['options']['world_size']} ranks")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    m = report["machine"]
    fig.suptitle(f"arfuse bench on {m['cpu']} ({m['cores']} cores), {m['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
