"""One rank of a scenario job: the steps it runs (create, call, close, kill ...) and the one
JSON line per step it reports, so a rank that dies still leaves what it did."""

from __future__ import annotations

import datetime
import gc
import hashlib
import json
import os
import signal
import socket
import sys
import time
from typing import Any

from ..digest import digest
from ..launch import die_with_parent, rank_store
from .calls import MOE_CALLS, check_result, make_inputs, make_moe_inputs, run_pattern
from .language import as_list, step_expect
from .leaks import LeakBaseline, segment_modes

# --- one rank ------------------------------------------------------------------------------------


def _per_rank(step: dict[str, Any], key: str, rank: int, default: Any) -> Any:
    by_rank = step.get(f"{key}_by_rank")
    if isinstance(by_rank, dict) and str(rank) in by_rank:
        return by_rank[str(rank)]
    return step.get(key, default)




class RankProgram:
    """Runs the scenario's steps on one rank; one JSON line per step (and a last one)."""

    def __init__(self, scn: dict[str, Any], rank: int, world: int, report: Any):
        self.scn, self.rank, self.world, self.report = scn, rank, world, report
        self.ops: dict[str, Any] = {}
        self.op_ranks: dict[str, list[int]] = {}
        self.op_ws: dict[str, int] = {}
        self.op_spec: dict[str, dict[str, Any]] = {}
        self.group: Any = None
        self.group_ranks: list[int] = list(range(world))

    def emit(self, record: dict[str, Any]) -> None:
        self.report.write(json.dumps(record, default=str) + "\n")
        self.report.flush()

    def setup(self) -> None:
        import torch.distributed as dist

        for ranks in self.scn.get("groups", []):
            made = dist.new_group([int(r) for r in ranks])
            if self.rank in ranks:
                self.group, self.group_ranks = made, [int(r) for r in ranks]
        dist.barrier()  # every connection exists before the baseline is taken

    def run(self) -> None:
        import torch.distributed as dist

        from .. import registry

        self.setup()
        groups = [dist.group.WORLD] + ([self.group] if self.group is not None else [])
        gc.collect()
        refs = [sys.getrefcount(g) for g in groups]
        baseline = LeakBaseline()
        for index, step in enumerate(self.scn.get("steps", [])):
            if self.rank not in step.get("ranks", range(self.world)):
                continue
            record: dict[str, Any] = {"step": index, "do": step["do"], "rank": self.rank}
            started = time.monotonic()
            try:
                getattr(self, f"do_{step['do']}")(step, record)
                record["ok"] = True
            except Exception as exc:
                record.update(ok=False, error_type=type(exc).__name__, error=str(exc)[:3000],
                              error_mro=[c.__name__ for c in type(exc).__mro__])
            record["seconds"] = round(time.monotonic() - started, 4)
            record["live"] = len(registry.REGISTRY.workspaces())
            self.emit(record)
            if record["ok"] == bool(step_expect(step, self.rank).get("error")):
                self.emit({"aborted_after": index, "rank": self.rank})
                break
        self.ops.clear()
        registry.destroy_all()
        held = [sys.getrefcount(g) for g in groups]  # before any collection, as leaks() looks
        leaks = baseline.leaks()
        after = [sys.getrefcount(g) for g in groups]
        if after != refs:
            leaks.append(f"references to the process group(s): {after} > {refs} before")
        elif held != refs:
            leaks.append(f"references to the process group(s): {held} > {refs} before (until "
                         "a cyclic garbage collection)")
        self.emit({"final": True, "rank": self.rank, "leaks": leaks})

    # --- steps ----------------------------------------------------------------------------------

    def _spec(self, step: dict[str, Any]) -> dict[str, Any]:
        spec = {"max_tokens": 64, "hidden": 64, "dtype": "fp32", "quant": None}
        spec.update(self.scn.get("spec", {}))
        spec.update(step.get("spec", {}))
        return spec

    def do_create(self, step: dict[str, Any], record: dict[str, Any]) -> None:
        import arfuse
        from arfuse.dtypes import parse_dtype
        from arfuse.torch_types import TORCH_DTYPES

        spec = self._spec(step)
        sub = step.get("group", "world") == "mine" and self.group is not None
        fill = step.get("fill_before_create")
        if fill and self.rank in fill.get("ranks", [0]):
            _fill_before_create(int(fill.get("leave_bytes", 0)))
        comm = arfuse.FusedAllReduce(
            self.group if sub else None, max_token_num=int(spec["max_tokens"]),
            hidden_dim=int(spec["hidden"]), dtype=TORCH_DTYPES[parse_dtype(spec["dtype"])],
            backend=step.get("backend"), quant=spec.get("quant"), strict=step.get("strict"),
            timeout_s=step.get("timeout_s"))
        name = str(step.get("op", "a"))
        self.ops[name] = comm
        self.op_ranks[name] = self.group_ranks if sub else list(range(self.world))
        self.op_spec[name] = spec
        ws = comm.workspace
        if step.get("mode") and hasattr(ws, "set_mode"):
            ws.set_mode(step["mode"])
        earlier = dict(self.op_ws)
        self.op_ws[name] = id(ws)
        plan = comm.plan
        record.update(
            op=name, backend=comm.backend, plan_backend=plan.backend,
            node_count=plan.node_count, plan_world=plan.world_size, capacity=comm.capacity,
            attempts=[a.describe() for a in comm.attempts], viable=list(plan.viable),
            candidates={c.backend: c.reason for c in plan.candidates},
            same_as=sorted(n for n, i in earlier.items() if i == id(ws)),
            segment_modes=segment_modes() if comm.backend == "shm" else [],
            path=getattr(ws, "path", ""))

    def do_call(self, step: dict[str, Any], record: dict[str, Any]) -> None:
        name = str(step.get("op", "a"))
        comm = self.ops[name]
        spec = self.op_spec[name]
        ranks = self.op_ranks[name]
        tokens = as_list(_per_rank(step, "tokens", self.rank, 1))
        patterns = as_list(_per_rank(step, "pattern", self.rank, "norm_residual"))
        repeat = int(step.get("repeat", max(len(tokens), len(patterns))))
        seed = int(step.get("seed", 1))
        before = comm.stats()
        ws = comm.workspace
        worst, modes, h = 0.0, set(), hashlib.sha256()
        for k in range(repeat):
            n, pattern = int(tokens[k % len(tokens)]), str(patterns[k % len(patterns)])
            record["at_call"] = k
            xs, residual, weight = make_inputs(seed * 100_003 + k, n, int(spec["hidden"]),
                                               str(spec["dtype"]), ranks)
            mine = xs[ranks.index(self.rank)]
            if pattern in MOE_CALLS:
                inputs, xs = make_moe_inputs(
                    seed * 100_003 + k, pattern, n, int(spec["hidden"]), str(spec["dtype"]),
                    ranks, {r: int(_per_rank(step, "top_k", r, 4)) for r in ranks},
                    {r for r in ranks if _per_rank(step, "bad_index", r, False)})
                mine = inputs[ranks.index(self.rank)]
            mode = getattr(ws, "mode", None)
            if mode is not None and n <= comm.capacity:
                modes.add(mode(n))
            result = run_pattern(comm, pattern, mine, residual, weight)
            worst = max(worst, check_result(pattern, str(spec["dtype"]), xs, residual, weight,
                                            result))
            h.update(digest(*result).encode())
        after = comm.stats()
        record.update(op=name, calls=repeat, max_ratio=worst, digest=h.hexdigest()[:16],
                      group=ranks, modes=sorted(modes),
                      fused=after["fused"] - before["fused"] == repeat,
                      unfused_over_capacity=after["unfused_over_capacity"]
                      - before["unfused_over_capacity"])

    def do_close(self, step: dict[str, Any], record: dict[str, Any]) -> None:
        self.ops[str(step.get("op", "a"))].close()

    def do_destroy_all(self, step: dict[str, Any], record: dict[str, Any]) -> None:
        import arfuse

        arfuse.destroy_all()

    def do_sleep(self, step: dict[str, Any], record: dict[str, Any]) -> None:
        time.sleep(float(step.get("seconds", 1.0)))

    def do_kill(self, step: dict[str, Any], record: dict[str, Any]) -> None:
        self.emit({**record, "ok": True, "seconds": 0.0, "live": -1})
        os.kill(os.getpid(), signal.SIGKILL)

    def do_exit(self, step: dict[str, Any], record: dict[str, Any]) -> None:
        self.emit({**record, "ok": True, "seconds": 0.0, "live": -1})
        os._exit(int(step.get("code", 3)))


def _fill_before_create(leave_bytes: int) -> None:
    """Another tenant fills ``ARFUSE_SHM_DIR`` between arfuse's check of free space and its
    reservation: the shm backend's ``create`` is wrapped to fill the directory first."""
    from arfuse.backends.shm import backend as shm_backend
    from arfuse.backends.shm.segment import segment_dir

    original = shm_backend.ShmBackend.create

    def create(self: Any, ctx: Any, spec: Any) -> Any:
        directory = segment_dir()
        st = os.statvfs(directory)
        free = st.f_bavail * st.f_frsize
        if free > leave_bytes:
            fd = os.open(directory / "filler", os.O_CREAT | os.O_RDWR, 0o600)
            try:
                os.posix_fallocate(fd, 0, free - leave_bytes)
            finally:
                os.close(fd)
        shm_backend.ShmBackend.create = original  # type: ignore[method-assign]
        return original(self, ctx, spec)

    shm_backend.ShmBackend.create = create  # type: ignore[method-assign]


def rank_main(scn: dict[str, Any], rank: int, world: int, listener: socket.socket,
               env: dict[str, str], report_path: str, init_timeout_s: float) -> None:
    """Entry of a forked rank: its own environment first, then the process group, then the
    steps."""
    os.environ.update(env)
    die_with_parent()
    code = 0
    with open(report_path, "a") as report:
        program = RankProgram(scn, rank, world, report)
        try:
            import torch
            import torch.distributed as dist

            torch.set_num_threads(1)
            port = int(listener.getsockname()[1])
            store = rank_store(rank, world, port, listener, init_timeout_s)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=init_timeout_s))
            program.run()
        except BaseException as exc:
            program.emit({"fatal": f"{type(exc).__name__}: {exc}", "rank": rank})
            code = 1
    os._exit(code)  # no atexit, no process-group teardown that could wait on a dead peer
