"""The checks a GPU machine is lent for, in one run (``scripts/gpu_check.sh`` starts it).

Every rank (``torchrun --nproc-per-node N``, or this script's own launcher):

1. detection: this rank's GPU facts (multicast, NVLink peers, fabric, SM) and the group's plan;
2. with one GPU: FlashInfer's JIT build of its all-reduce modules and the single-rank path;
3. with two or more: every backend (auto, mnnvl, trtllm, torch) and pattern (plain, RMSNorm,
   residual + RMSNorm, fp8, fp8_dynamic, nvfp4 where the SM has it) against a float64 reference
   of the same inputs, and bit-identical bytes on every rank;
4. CUDA-graph capture of the fused op (given destinations) and replay with new inputs;
5. the SGLang drop-in as SGLang's layers call it (SGLang's state stood in for, its module is not
   installed here): per flag (auto, mnnvl, trtllm) and dtype (bf16, fp32), the resolver, the
   group's workspace, the fused residual + RMSNorm and the plain all-reduce against the float64
   reference, the same bytes on every rank, and a CUDA-graph capture of the fused op;
6. a latency table: the fused op and arfuse's torch backend, in place, against the user's two
   lines (NCCL ``all_reduce`` + ``residual.add_`` + ``F.rms_norm``), medians.

Results go to ``benchmarks/results/gpu-check-<gpu>-<world>.json`` and ``.txt``. ``--device cpu``
runs the same steps on CPU ranks (gloo, shm) so the script itself can be checked anywhere.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from arfuse.digest import digest
from arfuse.launch import init_from_env, launch
from arfuse.pattern import Pattern
from arfuse.reference import expected

EPS = 1e-6
# one of each epilogue, and each quantisation after residual + RMSNorm (NVFP4 where the SM has it)
PATTERNS = (Pattern(), Pattern("rmsnorm"), Pattern("residual_rmsnorm"),
            Pattern("residual_rmsnorm", "fp8"), Pattern("residual_rmsnorm", "fp8_dynamic"),
            Pattern("residual_rmsnorm", "nvfp4", "swizzled_128x4"))
SCALES = {"fp8": 0.05, "nvfp4": 448.0 * 6.0 / 8.0}
TOLERANCE = {"bf16": 8 * 2.0**-8, "fp32": 1e-4}


def _inputs(rank: int, world: int, tokens: int, hidden: int, dtype: torch.dtype,
            device: torch.device) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(tokens * 7919 + hidden)
    xs = [torch.randn(tokens, hidden, generator=gen).to(dtype) for _ in range(world)]
    residual = torch.randn(tokens, hidden, generator=gen).to(dtype)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    return {"xs": xs, "x": xs[rank].to(device), "residual": residual.to(device),
            "weight": weight.to(device), "residual_cpu": residual, "weight_cpu": weight}


def _reference(data: dict[str, Any], pattern: Pattern) -> torch.Tensor:
    """``out`` of ``pattern`` in float64 (quantised patterns: their ``out`` before quantising)."""
    return expected(data["xs"], pattern, data["residual_cpu"], data["weight_cpu"], EPS).out


def _call(comm: Any, pattern: Pattern, data: dict[str, Any]) -> Any:
    kwargs: dict[str, Any] = {}
    if pattern.norm:
        kwargs.update(weight=data["weight"], eps=EPS)
    if pattern.epilogue == "residual_rmsnorm":
        kwargs["residual"] = data["residual"]
    if pattern.quant is not None:
        kwargs.update(quant=pattern.quant, scale=SCALES.get(pattern.quant),
                      layout=pattern.layout or "swizzled_128x4")
    return comm(data["x"], **kwargs)


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double().cpu() - want).abs().max() / max(want.abs().max().item(), 1e-30))


def _check_backend(rank: int, world: int, backend: str, opts: argparse.Namespace,
                   device: torch.device, sm: int) -> list[dict[str, Any]]:
    import torch.distributed as dist

    import arfuse

    rows: list[dict[str, Any]] = []
    dtype = torch.bfloat16
    try:
        comm = arfuse.FusedAllReduce(max_token_num=max(opts.tokens), hidden_dim=opts.hidden,
                                     dtype=dtype, backend=backend, device=opts.device)
    except Exception as exc:
        return [{"backend": backend, "error": f"{type(exc).__name__}: {exc}"}]
    for pattern in PATTERNS:
        if pattern.quant == "nvfp4" and opts.device == "cuda" and sm < 100:
            continue
        for tokens in opts.tokens:
            data = _inputs(rank, world, tokens, opts.hidden, dtype, device)
            row: dict[str, Any] = {"backend": backend, "negotiated": comm.backend,
                                   "pattern": pattern.name, "tokens": tokens}
            try:
                res = _call(comm, pattern, data)
                row["err"] = _error(res.out, _reference(data, pattern))
                digests: list[Any] = [None] * world
                dist.all_gather_object(digests, digest(res.out, res.residual_out,
                                                        res.quant_out, res.scale_out))
                row["identical"] = len(set(digests)) == 1
                row["ok"] = row["identical"] and row["err"] <= TOLERANCE["bf16"]
            except Exception as exc:
                row.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
            rows.append(row)
    comm.close()
    return rows


def _graph_capture(rank: int, world: int, opts: argparse.Namespace,
                   device: torch.device) -> list[dict[str, Any]]:
    """Capture the fused op with given destinations, replay with new inputs, compare."""
    import arfuse

    rows = []
    tokens = min(opts.tokens[-1], 64)
    for backend in ("mnnvl", "trtllm"):
        row: dict[str, Any] = {"backend": backend, "tokens": tokens}
        try:
            comm = arfuse.FusedAllReduce(max_token_num=tokens, hidden_dim=opts.hidden,
                                         dtype=torch.bfloat16, backend=backend, strict=True,
                                         device="cuda")
        except Exception as exc:
            rows.append({**row, "ok": False, "error": f"{type(exc).__name__}: {exc}"})
            continue
        data = _inputs(rank, world, tokens, opts.hidden, torch.bfloat16, device)
        x, residual = data["x"].clone(), data["residual"].clone()
        out, residual_out = torch.empty_like(x), torch.empty_like(x)
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):  # warm-up outside the graph
                    comm(x, residual=residual, weight=data["weight"], out=out,
                         residual_out=residual_out)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                comm(x, residual=residual, weight=data["weight"], out=out,
                     residual_out=residual_out)
            x.mul_(2.0)
            graph.replay()
            torch.cuda.synchronize()
            eager = comm(x, residual=residual, weight=data["weight"])
            row["ok"] = bool(torch.equal(out, eager.out)
                             and torch.equal(residual_out, eager.residual_out))
        except Exception as exc:
            row.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
        comm.close()
        rows.append(row)
    return rows


SGLANG_SETTINGS = ("auto", "mnnvl", "trtllm")


def _sglang_call(rank: int, world: int, tokens: int, opts: argparse.Namespace,
                 dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    """One layer's calls as SGLang makes them: the fused op (``(None, None)``: declined), then
    ``can_use_flashinfer_allreduce`` and ``flashinfer_allreduce``."""
    import torch.distributed as dist

    from arfuse.integrations import sglang as dropin

    data = _inputs(rank, world, tokens, opts.hidden, dtype, device)
    norm_out, residual_out = dropin.flashinfer_allreduce_residual_rmsnorm(
        data["x"], data["residual"].clone(), data["weight"], eps=EPS,
        max_token_num=max(opts.tokens))
    row: dict[str, Any] = {"tokens": tokens, "fused": norm_out is not None}
    want = expected(data["xs"], Pattern("residual_rmsnorm"), data["residual_cpu"],
                    data["weight_cpu"], EPS)
    errors = []
    if norm_out is not None:
        errors += [_error(norm_out, want.out), _error(residual_out, want.residual_out)]
    manager = dropin._get_workspace_manager(True)
    row["plain"] = dropin.can_use_flashinfer_allreduce(
        data["x"], use_attn_tp_group=True, expected_world_size=world,
        expected_group_key=manager.group)
    summed = dropin.flashinfer_allreduce(data["x"], use_attn_tp_group=True) \
        if row["plain"] else None
    if summed is not None:
        errors.append(_error(summed, want.sum))
    digests: list[Any] = [None] * world
    dist.all_gather_object(digests, digest(norm_out, residual_out, summed))
    row["err"] = max(errors, default=0.0)
    tolerance = TOLERANCE["fp32" if dtype == torch.float32 else "bf16"]
    row["ok"] = len(set(digests)) == 1 and row["err"] <= tolerance
    return row


def _sglang_graph(rank: int, world: int, opts: argparse.Namespace,
                  device: torch.device) -> bool:
    """SGLang captures the fused op in its CUDA graphs: replay with new inputs equals eager."""
    from arfuse.integrations import sglang as dropin

    tokens = min(max(opts.tokens), 64)
    data = _inputs(rank, world, tokens, opts.hidden, torch.bfloat16, device)
    x, residual, weight = data["x"].clone(), data["residual"], data["weight"]

    def call() -> Any:
        return dropin.flashinfer_allreduce_residual_rmsnorm(
            x, residual, weight, eps=EPS, max_token_num=max(opts.tokens))

    call()  # the workspace exists before capture, as SGLang pre-initialises it
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    x.mul_(2.0)
    graph.replay()
    torch.cuda.synchronize()
    eager = call()
    return bool(captured[0] is not None and torch.equal(captured[0], eager[0])
                and torch.equal(captured[1], eager[1]))


def _sglang(rank: int, world: int, opts: argparse.Namespace,
            device: torch.device) -> list[dict[str, Any]]:
    """The SGLang drop-in per flag and dtype, on the group of every rank (gloo ``cpu_group``,
    the default group as ``device_group``, as SGLang's coordinator has them)."""
    import pytest
    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from sglang_standin import SGLang

    from arfuse.integrations import sglang as dropin
    from arfuse.integrations.sglang import workspaces

    cpu_group, rows = dist.new_group(backend="gloo"), []
    for setting in SGLANG_SETTINGS:
        for dtype in (torch.bfloat16, torch.float32):
            row: dict[str, Any] = {"setting": setting, "dtype": str(dtype).split(".")[-1]}
            mp = pytest.MonkeyPatch()
            try:
                SGLang(setting, cpu_group, dist.group.WORLD).install(mp)
                mp.setattr(workspaces, "_unavailable", False)
                try:
                    row["resolved"] = dropin.resolve_flashinfer_allreduce_fusion_backend()
                except ValueError as exc:  # SGLang's own refusal, on every rank
                    row["resolved"] = f"ValueError: {exc}"
                row["ready"] = dropin.ensure_workspace_initialized(
                    max_token_num=max(opts.tokens), hidden_dim=opts.hidden, dtype=dtype)
                row["backend"] = dropin._get_workspace_manager(True).backend
                row["calls"] = [_sglang_call(rank, world, t, opts, dtype, device)
                                for t in opts.tokens]
                if row["ready"] and device.type == "cuda" and dtype == torch.bfloat16:
                    row["cuda_graph"] = _sglang_graph(rank, world, opts, device)
                row["ok"] = all(c["ok"] for c in row["calls"]) and row.get("cuda_graph", True)
            except Exception as exc:
                row.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
            finally:
                dropin.cleanup_flashinfer_workspace()
                mp.undo()
            rows.append(row)
    return rows


def _latency(rank: int, world: int, opts: argparse.Namespace,
             device: torch.device) -> list[dict[str, Any]]:
    """Per size: the fused op (``auto``) and arfuse's torch backend, each in place, against
    the user's two lines (``dist.all_reduce`` + ``residual.add_`` + ``F.rms_norm``), taking
    turns; every row's inputs restored before each call (timed alike in every row)."""
    import torch.distributed as dist

    import arfuse

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    ops = {name: arfuse.FusedAllReduce(max_token_num=max(opts.tokens), hidden_dim=opts.hidden,
                                       dtype=torch.bfloat16, device=opts.device,
                                       backend=backend)
           for name, backend in (("fused", "auto"), ("torch", "torch"))}
    rows = []
    for tokens in opts.tokens:
        data = _inputs(rank, world, tokens, opts.hidden, torch.bfloat16, device)
        source, source_residual, weight = data["x"], data["residual"], data["weight"]
        x, residual = source.clone(), source_residual.clone()

        def user(x: torch.Tensor = x, residual: torch.Tensor = residual,
                 weight: torch.Tensor = weight) -> None:
            dist.all_reduce(x)
            residual.add_(x)
            torch.nn.functional.rms_norm(residual, (x.shape[-1],), weight, EPS)

        calls = {"user": user}
        for name, op in ops.items():
            calls[name] = (lambda op=op, x=x, residual=residual, weight=weight: op(
                x, residual=residual, weight=weight, eps=EPS, out=x, residual_out=residual))
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(5):
            for name, fn in calls.items():
                for _ in range(3):
                    x.copy_(source)
                    residual.copy_(source_residual)
                    fn()
                sync()
                for _ in range(opts.steps):
                    x.copy_(source)
                    residual.copy_(source_residual)
                    start = time.perf_counter_ns()
                    fn()
                    sync()
                    times[name].append((time.perf_counter_ns() - start) / 1e3)
        medians = {name: statistics.median(t) for name, t in times.items()}
        rows.append({"tokens": tokens, "backend": ops["fused"].backend,
                     "fused_us": medians["fused"], "torch_us": medians["torch"],
                     "unfused_us": medians["user"], "speedup": medians["user"] / medians["fused"],
                     "torch_over_user": medians["torch"] / medians["user"]})
    for op in ops.values():
        op.close()
    return rows


def body(rank: int, world: int, opts: argparse.Namespace) -> int:
    import torch.distributed as dist

    from arfuse import topology
    from arfuse.launch import pin_to_core

    init_from_env(opts.device)
    if opts.device == "cpu":
        pin_to_core(rank, world)
    device = (torch.device("cuda", torch.cuda.current_device()) if opts.device == "cuda"
              else torch.device("cpu"))
    report: dict[str, Any] = {"world": world, "device": opts.device}
    facts = topology.local_facts(opts.device)
    every: list[Any] = [None] * world
    dist.all_gather_object(every, {k: v for k, v in vars(facts).items() if k != "extra"})
    report["facts"] = every
    sm = facts.sm or 0
    steps: list[tuple[str, Any]] = []
    if world == 1 and opts.device == "cuda":
        steps.append(("jit_build", lambda: _jit_build()))
    backends = ("auto", "mnnvl", "trtllm", "torch") if opts.device == "cuda" else ("auto",
                                                                                   "torch")
    for backend in backends:
        steps.append((f"backend:{backend}",
                      lambda b=backend: _check_backend(rank, world, b, opts, device, sm)))
    if opts.device == "cuda" and world > 1:
        steps.append(("cuda_graph", lambda: _graph_capture(rank, world, opts, device)))
    steps.append(("sglang", lambda: _sglang(rank, world, opts, device)))
    steps.append(("latency", lambda: _latency(rank, world, opts, device)))
    for name, step in steps:
        started = time.monotonic()
        try:
            report[name] = step()
        except Exception:
            report[name] = {"error": traceback.format_exc()[-1500:]}
        if rank == 0:
            print(f"gpu_check: {name} done in {time.monotonic() - started:.1f} s", flush=True)
    if rank == 0:
        _write(report, Path(opts.out), facts.gpu or opts.device)
    dist.barrier()
    return 0


def _jit_build() -> dict[str, Any]:
    """FlashInfer's all-reduce modules, compiled (or loaded) now, with their build times."""
    import importlib

    built: dict[str, Any] = {}
    for module, getter in (("flashinfer.comm.trtllm_ar", "get_trtllm_comm_module"),
                           ("flashinfer.comm.trtllm_mnnvl_ar", "get_trtllm_mnnvl_comm_module")):
        started = time.monotonic()
        try:
            getattr(importlib.import_module(module), getter)()
            built[module] = {"ok": True, "seconds": time.monotonic() - started}
        except Exception as exc:
            built[module] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    return built


def _write(report: dict[str, Any], out: Path, gpu: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    stem = f"gpu-check-{gpu.replace(' ', '_')}-{report['world']}"
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2, default=str))
    lines = [f"gpu_check: {report['world']} rank(s) on {report['device']} ({gpu})"]
    for key, value in report.items():
        if key.startswith("backend:") and isinstance(value, list):
            bad = [r for r in value if not r.get("ok")]
            lines.append(f"{key}: {len(value) - len(bad)}/{len(value)} ok"
                         + (f"; first failure: {bad[0]}" if bad else ""))
    for row in report.get("cuda_graph", []) if isinstance(report.get("cuda_graph"), list) else []:
        lines.append(f"cuda graph {row['backend']}: {'ok' if row.get('ok') else row}")
    for row in report["sglang"] if isinstance(report.get("sglang"), list) else []:
        calls = row.get("calls", [])
        lines.append(f"sglang {row['setting']} {row['dtype']}: resolver {row.get('resolved')}, "
                     f"workspace {row.get('backend')}, "
                     f"{sum(c['fused'] for c in calls)}/{len(calls)} fused, "
                     f"graph {row.get('cuda_graph', '-')}: "
                     + ("ok" if row.get("ok") else f"FAILED {row.get('error', calls)}"))
    if isinstance(report.get("latency"), list):
        lines.append(f"{'tokens':>7} {'backend':>8} {'fused us':>10} {'torch us':>10} "
                     f"{'user us':>9} {'speedup':>8} {'torch/user':>10}")
        for r in report["latency"]:
            lines.append(f"{r['tokens']:>7} {r['backend']:>8} {r['fused_us']:>10.1f} "
                         f"{r['torch_us']:>10.1f} {r['unfused_us']:>9.1f} "
                         f"{r['speedup']:>7.2f}x {r['torch_over_user']:>10.2f}")
    text = "\n".join(lines)
    (out / f"{stem}.txt").write_text(text + "\n")
    print(text, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=None,
                        help="ranks when not under torchrun (default: every GPU, or 2 on CPU)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tokens", default="1,8,64,512")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/results")
    opts = parser.parse_args()
    opts.tokens = [int(t) for t in opts.tokens.split(",")]
    if opts.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (use --device cpu to check the script itself)",
              file=sys.stderr)
        return 2
    world = opts.world_size or (torch.cuda.device_count() if opts.device == "cuda" else 2)
    return launch(body, world, opts, timeout_s=420)


if __name__ == "__main__":
    sys.exit(main())
