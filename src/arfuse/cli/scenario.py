"""``arfuse scenario run FILE|DIR``: the field's failures (DESIGN 1) replayed as scenarios.

Why: each row of docs/design.md section 1 went wrong in the field in a way one process cannot
show (a rank that hangs, dies, fails alone or sees other memory). A scenario states ranks,
topology, settings, faults, the spec, the calls and the expected outcome in one TOML file; the
runner replays it with real ranks (or, for GPU-only rows, at the decision level) under a hard
limit per scenario, so a hang fails and never blocks.

Three layers: the runner (this process) starts one *job* per scenario in a session of its own
and kills the whole session when the limit is over; the job (a fresh interpreter, in a private
mount namespace when the scenario mounts a tiny tmpfs) forks the ranks, then checks the outcome
and what is left behind; each rank runs the scenario's steps and reports one JSON line per step,
so a rank that dies still leaves what it did. The schema is in ``scenarios/README.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import hashlib
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..backends.shm import build as shm_build
from ..digest import digest
from ..files import read_regular_file
from ..launch import die_with_parent, rank_store, store_listener
from ..pattern import Pattern
from ..reference import expected

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

LEVELS = ("decision", "ranks")
PATTERNS = ("plain", "norm", "norm_residual", "fp8", "nvfp4", "in_place", "slot")
FP8_SCALE = 0.0625                 # dequantisation scale: |out| up to ~28 fits e4m3
NVFP4_SCALE = 448.0 * 6.0 / 8.0    # global encode scale for |out| up to ~8
EPS = 1e-5
ULP = {"bf16": 2.0**-7, "fp16": 2.0**-10, "fp32": 2.0**-21}  # fp32: rsqrt may be off by ulps
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_STEP_KINDS = ("create", "call", "close", "destroy_all", "sleep", "kill", "exit")
_TOP_KEYS = {"name", "summary", "cases", "rows", "requirements", "level", "limit_s", "note",
             "decide", "reuse", "ranks", "groups", "settings", "faults", "env_by_rank",
             "topology", "topology_file", "shm_tmpfs", "spec", "steps", "expect"}
NAMED_SEGMENT = re.compile(r"arfuse-\d+-\d+-[0-9a-f]+")
UNNAMED_FILE = re.compile(r"#\d+")  # an O_TMPFILE file, as /proc shows it
_JOB_ENTRY = "from arfuse.cli.scenario import job_main; job_main()"
MAX_SCENARIO_BYTES = 1 << 20      # a scenario is a few dozen lines; bounds what is read


# --- loading ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    """One TOML file, checked for shape (what it means is checked when it runs)."""

    path: Path
    data: dict[str, Any]

    @property
    def name(self) -> str:
        return str(self.data.get("name") or self.path.stem)

    @property
    def level(self) -> str:
        return str(self.data.get("level", "ranks"))

    @property
    def limit_s(self) -> float:
        return float(self.data.get("limit_s", 60.0))

    @property
    def rows(self) -> list[int]:
        return [int(r) for r in self.data.get("rows", [])]

    @property
    def cases(self) -> list[str]:
        return [str(c) for c in self.data.get("cases", [])]

    @property
    def requirements(self) -> list[str]:
        return [str(r) for r in self.data.get("requirements", [])]

    @property
    def needs_tmpfs(self) -> bool:
        return bool(self.data.get("shm_tmpfs"))

    def scaled(self, scale: float) -> Scenario:
        """The same scenario with ``limit_s`` times ``scale`` (``--limit-scale``): the runner and
        the job both apply it, so every limit derived from ``limit_s`` moves together."""
        if scale == 1.0:
            return self
        return Scenario(self.path, {**self.data, "limit_s": self.limit_s * scale})


def load_scenario(path: str | os.PathLike[str]) -> Scenario:
    """Parse and check one scenario file; a bad file is a ``ValueError`` naming it."""
    path = Path(path)
    raw = read_regular_file(path, MAX_SCENARIO_BYTES, f"scenario {str(path)!r}")
    if len(raw) > MAX_SCENARIO_BYTES:
        raise ValueError(f"scenario {str(path)!r} is larger than {MAX_SCENARIO_BYTES >> 10} KiB; "
                         "a scenario is a few steps")
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"scenario {str(path)!r} is not UTF-8 text (byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"scenario {str(path)!r} is not valid TOML: {exc}") from None
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise ValueError(f"scenario {str(path)!r}: unknown key(s) {unknown}")
    level = data.get("level", "ranks")
    if level not in LEVELS:
        raise ValueError(f"scenario {str(path)!r}: level={level!r}; use one of {LEVELS}")
    limit = data.get("limit_s", 60.0)
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not 0 < limit <= 600:
        raise ValueError(f"scenario {str(path)!r}: limit_s must be a number in (0, 600]")
    if level == "decision" and not (data.get("decide") or data.get("reuse")):
        raise ValueError(f"scenario {str(path)!r}: a decision scenario needs [[decide]] or "
                         "[[reuse]] entries")
    if level == "ranks":
        ranks = data.get("ranks")
        if isinstance(ranks, bool) or not isinstance(ranks, int) or not 1 <= ranks <= 16:
            raise ValueError(f"scenario {str(path)!r}: ranks must be an int in 1..16")
        for i, step in enumerate(data.get("steps", [])):
            if step.get("do") not in _STEP_KINDS:
                raise ValueError(f"scenario {str(path)!r}: step {i}: do={step.get('do')!r}; "
                                 f"use one of {_STEP_KINDS}")
    return Scenario(path, data)


def scenario_files(paths: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """Files as given, directories as their ``*.toml`` files in name order."""
    found: list[Path] = []
    for item in paths:
        p = Path(item)
        if p.is_dir():
            found.extend(sorted(p.glob("*.toml")))
        elif p.is_file():
            found.append(p)
        else:
            raise ValueError(f"scenario path {str(p)!r} is neither a file nor a directory")
    return found


# --- inputs, the float64 reference and the tolerance -------------------------------------------


def make_inputs(seed: int, tokens: int, hidden: int, dtype: str,
                ranks: list[int]) -> tuple[list[Any], Any, Any]:
    """Every rank's ``x`` (keyed by global rank) plus a residual and weight shared by all, the
    same in every process: each rank can compute the reference of the whole group itself."""
    import torch

    from ..torch_types import TORCH_DTYPES

    tdt = TORCH_DTYPES[dtype]
    xs = []
    for r in ranks:
        gen = torch.Generator().manual_seed((seed * 1_000_003 + r * 7919 + tokens) % 2**62)
        xs.append((torch.randn(tokens, hidden, generator=gen) * (0.5 + 0.25 * r)).to(tdt))
    gen = torch.Generator().manual_seed((seed * 1_000_003 + 999_983) % 2**62)
    residual = torch.randn(tokens, hidden, generator=gen).to(tdt)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(tdt)
    return xs, residual, weight


def run_pattern(comm: Any, pattern: str, x: Any, residual: Any, weight: Any) -> Any:
    """One call of ``pattern``; inputs that the pattern overwrites are copies."""
    if pattern == "plain":
        return comm(x)
    if pattern == "norm":
        return comm(x, weight=weight, eps=EPS)
    if pattern == "norm_residual":
        return comm(x, residual=residual, weight=weight, eps=EPS)
    if pattern == "fp8":
        return comm(x, residual=residual, weight=weight, eps=EPS, quant="fp8", scale=FP8_SCALE)
    if pattern == "nvfp4":
        return comm(x, residual=residual, weight=weight, eps=EPS, quant="nvfp4",
                    scale=NVFP4_SCALE, layout="linear")
    if pattern == "in_place":
        xi, ri = x.clone(), residual.clone()
        return comm(xi, residual=ri, weight=weight, eps=EPS, out=xi, residual_out=ri)
    if pattern == "slot":
        buf = comm.input_buffer(int(x.shape[0]))
        buf.copy_(x)
        return comm(buf, residual=residual, weight=weight, eps=EPS)
    raise ValueError(f"pattern={pattern!r} is not valid; use one of {', '.join(PATTERNS)}")


# what each call form computes (``run_pattern``)
FUSED_PATTERN = {"plain": Pattern(), "norm": Pattern("rmsnorm"),
                 "norm_residual": Pattern("residual_rmsnorm"),
                 "fp8": Pattern("residual_rmsnorm", "fp8"),
                 "nvfp4": Pattern("residual_rmsnorm", "nvfp4", "linear"),
                 "in_place": Pattern("residual_rmsnorm"), "slot": Pattern("residual_rmsnorm")}


def check_result(pattern: str, dtype: str, xs: list[Any], residual: Any, weight: Any,
                 result: Any) -> float:
    """Worst error over its bound against the float64 reference (<= 1 passes). Bounds: the
    dtype's roundings (sum, add, norm) and, for quantised outputs, the format's own step."""

    eps = ULP[dtype] * max(1, len(xs) - 1)
    want = expected(xs, FUSED_PATTERN[pattern], residual, weight, EPS)
    total, abs_sum, out = want.sum, want.abs_sum, result.out.double()
    if pattern == "plain":
        return float(((out - total).abs() / (eps * abs_sum + 1e-30)).max().item())
    ref, pre = want.out, want.residual_out
    assert pre is not None
    scale = ref.abs().max().item() + 1e-30
    ratios = [((out - ref).abs() / (3 * eps * scale + 3 * eps * ref.abs())).max().item()]
    res = result.residual_out.double()
    ratios.append(((res - pre).abs() / (eps * (abs_sum + pre.abs()) + 1e-30)).max().item())
    if pattern == "fp8":
        ratios.append(_fp8_ratio(result, ref, eps, scale))
    elif pattern == "nvfp4":
        ratios.append(_nvfp4_ratio(result, ref, eps))
    return float(max(ratios))


def _fp8_ratio(result: Any, ref: Any, eps: float, scale: float) -> float:
    import torch

    deq = result.quant_out.view(torch.float8_e4m3fn).double() * FP8_SCALE
    bound = (2.0**-4 + 4 * eps) * ref.abs() + FP8_SCALE * 2.0**-9 + 3 * eps * scale
    return float(((deq - ref).abs() / bound).max().item())


def _nvfp4_ratio(result: Any, ref: Any, eps: float) -> float:
    import torch

    packed = result.quant_out
    tokens, hidden = ref.shape
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(tokens, hidden).long()
    table = torch.tensor(E2M1, dtype=torch.float64)
    values = table[codes & 7] * torch.where((codes & 8) > 0, -1.0, 1.0)
    sf = result.scale_out.view(torch.float8_e4m3fn).double()  # linear [T, H/16]
    deq = (values.view(tokens, hidden // 16, 16) * sf[..., None] / NVFP4_SCALE)
    blocks = ref.view(tokens, hidden // 16, 16)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    bound = amax * (1 / 6 + 2.0**-4 + 4 * eps) + 1e-30
    return float(((deq - blocks).abs() / bound).max().item())


def fd_targets() -> dict[int, str]:
    """Open descriptors of this process and what they point to."""
    found: dict[int, str] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                found[int(name)] = os.readlink(f"/proc/self/fd/{name}")
    return found


def segment_modes() -> list[int]:
    """Permission bits of the segment of every live shm workspace of this process (0o600
    expected; -1: another user's), as each saw its file before it closed the descriptor."""
    from .. import registry
    from ..backends.shm.workspace import ShmWorkspace

    return [ws.segment_mode for ws in registry.REGISTRY.workspaces()
            if isinstance(ws, ShmWorkspace)]


def is_segment(path: str) -> bool:
    """Whether a file /proc shows (a descriptor's target, a mapping's path) is a shm segment:
    named ``arfuse-<pid>-<start>-<hex>``, or unnamed (``#<inode>``) in the segment
    directory."""
    directory, _, name = path.removesuffix(" (deleted)").rpartition("/")
    if NAMED_SEGMENT.fullmatch(name):
        return True
    if not UNNAMED_FILE.fullmatch(name):
        return False
    from ..backends.shm.workspace import segment_dir

    return directory == os.path.realpath(segment_dir())


def mapped_segments() -> list[str]:
    with contextlib.suppress(OSError):
        paths = [fields[5] for line in Path("/proc/self/maps").read_text().splitlines()
                 if len(fields := line.split(maxsplit=5)) == 6]
        return [p.removesuffix(" (deleted)") for p in paths if is_segment(p)]
    return []


def task_count() -> int:
    return len(os.listdir("/proc/self/task"))


def child_pids() -> list[int]:
    pids: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):
                text = Path(f"/proc/self/task/{task}/children").read_text()
                pids.extend(int(p) for p in text.split())
    return pids


@dataclass
class LeakBaseline:
    """What a process holds before arfuse does anything; compared after ``destroy_all``."""

    fds: dict[int, str] = field(default_factory=fd_targets)
    threads: int = field(default_factory=threading.active_count)
    tasks: int = field(default_factory=task_count)
    children: frozenset[int] = field(default_factory=lambda: frozenset(child_pids()))

    def leaks(self) -> list[str]:
        """What is held now and was not before (segments, descriptors, threads, children),
        looked at before any garbage collection: what only a cyclic collection frees stays
        until the collector happens to run, so it is a leak too (and said so)."""
        held = self._held()
        gc.collect()
        after = set(self._held())
        return [what if what in after else f"{what} (until a cyclic garbage collection)"
                for what in held]

    def _held(self) -> list[str]:
        found = []
        maps = mapped_segments()
        if maps:
            found.append(f"segments still mapped: {maps}")
        now = fd_targets()
        kept = set(shm_build.held_descriptors())  # the kernel's binary, open for good
        extra = {fd: t for fd, t in now.items() if fd not in self.fds and fd not in kept}
        if extra:
            found.append(f"descriptors opened and not closed: {extra}")
        if threading.active_count() > self.threads:
            found.append(f"threads: {threading.active_count()} > {self.threads} before")
        if task_count() > self.tasks:
            found.append(f"OS threads: {task_count()} > {self.tasks} before")
        children = [pid for pid in child_pids() if pid not in self.children]
        if children:
            found.append(f"child processes: {children}")
        return found


# --- the decision level --------------------------------------------------------------------------


def _resolve_path(scn: Scenario, text: str) -> Path:
    p = Path(text)
    if p.is_absolute():
        return p
    for base in (scn.path.parent, Path.cwd()):
        if (base / p).exists():
            return base / p
    return scn.path.parent / p


def _mentions(text: str, fragment: str | list[str]) -> bool:
    """A message fragment, or a list of alternatives (any one will do)."""
    return any(f in text for f in _as_list(fragment))


def _check_error(exc: BaseException | None, expect: dict[str, Any], where: str) -> list[str]:
    wanted = expect.get("error")
    if exc is None:
        return [f"{where}: expected {wanted}, nothing was raised"] if wanted else []
    if not wanted:
        return [f"{where}: raised {type(exc).__name__}: {exc}"]
    problems = []
    names = [c.__name__ for c in type(exc).__mro__]
    if wanted not in names:
        problems.append(f"{where}: raised {type(exc).__name__}, expected {wanted}: {exc}")
    for fragment in expect.get("message", []):
        if not _mentions(str(exc), fragment):
            problems.append(f"{where}: message lacks {fragment!r}: {exc}")
    return problems


def _decide(scn: Scenario, case: dict[str, Any], index: int) -> tuple[list[str], str]:
    """One ``[[decide]]`` entry: settings + topology + spec -> Plan, checked field by field."""
    from .. import faults, policy, settings, topology
    from ..spec import Spec

    where = f"decide[{index}]" + (f" ({case['label']})" if "label" in case else "")
    expect = dict(case.get("expect", {}))
    try:
        conf = settings.from_env({k: str(v) for k, v in case.get("settings", {}).items()})
        if "topology" in case:
            topo = topology.Topology.from_dict(case["topology"])
        else:
            topo = topology.load(_resolve_path(scn, str(case["topology_file"])),
                                 f"topology_file of {scn.name} {where}")
        spec = Spec(**case.get("spec", {}))
        parsed = faults.parse(case.get("faults"))
        plan = policy.resolve(conf, topo, spec, case.get("blocked"))
    except (ValueError, TypeError, KeyError) as exc:
        return _check_error(exc, expect, where), f"{type(exc).__name__}"
    problems = _check_error(None, expect, where)
    simple = ("backend", "node_count", "max_fused_tokens", "workspace_bytes", "quant_fusion",
              "allow_fallback", "fused", "world_size")
    for key in simple:
        if key in expect and getattr(plan, key) != expect[key]:
            problems.append(f"{where}: {key}={getattr(plan, key)!r}, expected {expect[key]!r}")
    if plan.workspace_bytes < int(expect.get("workspace_bytes_at_least", 0)):
        problems.append(f"{where}: workspace_bytes={plan.workspace_bytes}, expected at least "
                        f"{expect['workspace_bytes_at_least']}")
    if "viable" in expect and list(plan.viable) != list(expect["viable"]):
        problems.append(f"{where}: viable={list(plan.viable)}, expected {expect['viable']}")
    for name, fragment in expect.get("reasons", {}).items():
        reason = plan.candidate(name).reason
        if fragment not in reason:
            problems.append(f"{where}: reason for {name} is {reason!r}, lacks {fragment!r}")
    for fragment in expect.get("warnings", []):
        if not any(fragment in w for w in plan.warnings):
            problems.append(f"{where}: no warning mentions {fragment!r}: {plan.warnings}")
    if "fails_over_to" in expect:
        # negotiation: a rank whose creation fails votes no; every rank drops the candidate
        # and tries the plan's next one, together (R7)
        failing = [r for r in range(topo.world_size)
                   if faults.mode_for(parsed, plan.backend, "create", r) in
                   ("raise", "none", "null", "oom")]
        nxt = plan.viable[1] if len(plan.viable) > 1 else None
        if not failing:
            problems.append(f"{where}: the faults make no rank fail creating {plan.backend}")
        if nxt != expect["fails_over_to"]:
            problems.append(f"{where}: after {plan.backend} fails the group tries {nxt}, "
                            f"expected {expect['fails_over_to']}")
    if "trtllm_mode_chosen_by_arfuse" in expect:
        from ..backends.flashinfer.workspace import trtllm_use_oneshot

        chosen = trtllm_use_oneshot(topo.world_size, spec.max_tokens, spec.hidden,
                                    spec.elem_size)
        if (chosen is not None) != expect["trtllm_mode_chosen_by_arfuse"]:
            problems.append(f"{where}: trtllm mode at world {topo.world_size}: {chosen!r}")
    return problems, f"{plan.backend} (nodes {plan.node_count}, cap {plan.max_fused_tokens})"


def _reuse(case: dict[str, Any], index: int) -> tuple[list[str], str]:
    """One ``[[reuse]]`` entry: does a workspace built for ``have`` serve ``want`` (R4, R5)?"""
    from ..spec import Spec

    have, want = Spec(**case["have"]), Spec(**case["want"])
    covers = have.covers(want)
    where = f"reuse[{index}]" + (f" ({case['label']})" if "label" in case else "")
    if covers != bool(case["reuse"]):
        return [f"{where}: covers={covers}, expected {case['reuse']}"], ""
    return [], f"{'reuse' if covers else 'new workspace'}"


def run_decision(scn: Scenario) -> dict[str, Any]:
    problems: list[str] = []
    facts: list[str] = []
    for i, case in enumerate(scn.data.get("decide", [])):
        p, fact = _decide(scn, case, i)
        problems += p
        facts.append(fact)
    for i, case in enumerate(scn.data.get("reuse", [])):
        p, fact = _reuse(case, i)
        problems += p
        facts.append(fact)
    return {"status": "fail" if problems else "pass", "problems": problems,
            "summary": "; ".join(dict.fromkeys(f for f in facts if f))}


# --- one rank ------------------------------------------------------------------------------------


def _per_rank(step: dict[str, Any], key: str, rank: int, default: Any) -> Any:
    by_rank = step.get(f"{key}_by_rank")
    if isinstance(by_rank, dict) and str(rank) in by_rank:
        return by_rank[str(rank)]
    return step.get(key, default)


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list) else [value]


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
            if record["ok"] == bool(step.get("expect", {}).get("error")):
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
        tokens = _as_list(_per_rank(step, "tokens", self.rank, 1))
        patterns = _as_list(_per_rank(step, "pattern", self.rank, "norm_residual"))
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
            mode = getattr(ws, "mode", None)
            if mode is not None and n <= comm.capacity:
                modes.add(mode(n))
            result = run_pattern(comm, pattern, xs[ranks.index(self.rank)], residual, weight)
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
    from arfuse.backends.shm import workspace as shm_ws

    original = shm_ws.ShmBackend.create

    def create(self: Any, ctx: Any, spec: Any) -> Any:
        directory = shm_ws.segment_dir()
        st = os.statvfs(directory)
        free = st.f_bavail * st.f_frsize
        if free > leave_bytes:
            fd = os.open(directory / "filler", os.O_CREAT | os.O_RDWR, 0o600)
            try:
                os.posix_fallocate(fd, 0, free - leave_bytes)
            finally:
                os.close(fd)
        shm_ws.ShmBackend.create = original  # type: ignore[method-assign]
        return original(self, ctx, spec)

    shm_ws.ShmBackend.create = create  # type: ignore[method-assign]


def _rank_main(scn: dict[str, Any], rank: int, world: int, listener: socket.socket,
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


# --- one job (one scenario) -------------------------------------------------------------------


def _pgid_members(pgid: int) -> list[int]:
    """Live processes of a process group (zombies excluded), from /proc."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            text = Path(f"/proc/{entry}/stat").read_text()
            fields = text[text.rindex(")") + 2:].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry))
    return members


def _segments_of(pids: Iterable[int], directories: Iterable[Path]) -> list[str]:
    left = []
    for directory in directories:
        with contextlib.suppress(OSError):
            for name in os.listdir(directory):
                if name.startswith("arfuse-") and any(name.startswith(f"arfuse-{p}-")
                                                     for p in pids):
                    left.append(str(directory / name))
    return left


def _substitute(value: Any, tmp: Path) -> str:
    return str(value).replace("{tmp}", str(tmp))


def _rank_envs(scn: Scenario, tmp: Path, tmpfs: Path | None) -> list[dict[str, str]]:
    data = scn.data
    common = {k: _substitute(v, tmp) for k, v in data.get("settings", {}).items()}
    if data.get("faults"):
        common["ARFUSE_FAULTS"] = str(data["faults"])
    if tmpfs is not None:
        common.setdefault("ARFUSE_SHM_DIR", str(tmpfs))
    if "topology" in data:
        path = tmp / "topology.json"
        path.write_text(json.dumps(data["topology"]))
        common["ARFUSE_TOPOLOGY"] = str(path)
    elif "topology_file" in data:
        common["ARFUSE_TOPOLOGY"] = str(_resolve_path(scn, str(data["topology_file"])))
    envs = []
    for r in range(int(data["ranks"])):
        env = dict(common)
        env.update({k: _substitute(v, tmp) for k, v in
                    data.get("env_by_rank", {}).get(str(r), {}).items()})
        envs.append(env)
    return envs


def _records(path: Path) -> list[dict[str, Any]]:
    out = []
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line))
    return out


def _check_step(step: dict[str, Any], recs: dict[int, dict[str, Any]],
                ops_ws: dict[tuple[int, str], str], index: int) -> list[str]:
    """The step's expectations on every rank that ran it; numerics and identical bytes."""
    expect = step.get("expect", {})
    problems: list[str] = []
    for rank, rec in sorted(recs.items()):
        where = f"step {index} ({step['do']}) rank {rank}"
        if expect.get("error"):
            if rec.get("ok"):
                problems.append(f"{where}: expected {expect['error']}, the step succeeded")
            else:
                if expect["error"] not in rec.get("error_mro", []):
                    problems.append(f"{where}: raised {rec.get('error_type')}, expected "
                                    f"{expect['error']}: {rec.get('error', '')[:400]}")
                problems += [f"{where}: message lacks {f!r}: {rec.get('error', '')[:400]}"
                             for f in expect.get("message", [])
                             if not _mentions(rec.get("error", ""), f)]
        elif not rec.get("ok"):
            problems.append(f"{where}: raised {rec.get('error_type')}: "
                            f"{rec.get('error', '')[:400]}")
            continue
        for key in ("backend", "plan_backend", "node_count", "capacity", "fused",
                    "unfused_over_capacity", "live", "modes", "viable", "path"):
            if key in expect and rec.get(key) != expect[key]:
                problems.append(f"{where}: {key}={rec.get(key)!r}, expected {expect[key]!r}")
        if "within_s" in expect and rec["seconds"] > float(expect["within_s"]):
            problems.append(f"{where}: took {rec['seconds']:.2f} s, limit {expect['within_s']}")
        attempts = " | ".join(rec.get("attempts", []))
        if "attempt_failed" in expect and f"{expect['attempt_failed']}: failed" not in attempts:
            problems.append(f"{where}: no failed {expect['attempt_failed']} attempt: {attempts}")
        problems += [f"{where}: attempts lack {f!r}: {attempts}"
                     for f in expect.get("attempts_mention", []) if f not in attempts]
        for name, fragment in expect.get("reasons", {}).items():
            reason = rec.get("candidates", {}).get(name, "")
            if fragment not in reason:
                problems.append(f"{where}: reason for {name} {reason!r} lacks {fragment!r}")
        if "same_workspace_as" in expect and expect["same_workspace_as"] not in rec.get(
                "same_as", []):
            problems.append(f"{where}: not the workspace of op {expect['same_workspace_as']}")
        if expect.get("new_workspace") and rec.get("same_as"):
            problems.append(f"{where}: reused the workspace of {rec['same_as']}")
        if step["do"] == "create" and rec.get("backend") == "shm":
            modes = rec.get("segment_modes", [])
            if not modes or any(m != 0o600 for m in modes):
                problems.append(f"{where}: segment modes {[oct(m) for m in modes]}, expected "
                                "0o600 owned by this user")
        if step["do"] == "call" and rec.get("max_ratio", 0.0) > 1.0:
            problems.append(f"{where}: result off the float64 reference: {rec['max_ratio']:.3g} "
                            "x the tolerance")
    if step["do"] == "call" and expect.get("identical", True):
        by_group: dict[str, set[str]] = {}
        for rec in recs.values():
            if rec.get("ok") and "digest" in rec:
                by_group.setdefault(str(rec["group"]), set()).add(rec["digest"])
        for group, digests in by_group.items():
            if len(digests) > 1:
                problems.append(f"step {index}: ranks {group} got different bytes")
    return problems


def evaluate(scn: Scenario, per_rank: dict[int, list[dict[str, Any]]],
             exitcodes: dict[int, int | None], hung: list[int]) -> tuple[list[str], str]:
    """Compare what every rank reported with the scenario's expectations."""
    data = scn.data
    expect = data.get("expect", {})
    world = int(data["ranks"])
    problems: list[str] = []
    want_hung = sorted(int(r) for r in expect.get("hung", []))
    if sorted(hung) != want_hung:
        problems.append(f"ranks {sorted(hung)} had to be killed (hung); expected {want_hung}")
    want_codes = {int(k): int(v) for k, v in expect.get("exit_codes", {}).items()}
    for r in range(world):
        if r in hung:
            continue
        want = want_codes.get(r, 0)
        if exitcodes.get(r) != want:
            fatal = [rec["fatal"] for rec in per_rank.get(r, []) if "fatal" in rec]
            problems.append(f"rank {r} exited with {exitcodes.get(r)}, expected {want}"
                            + (f": {fatal[0][:400]}" if fatal else ""))
    ops_ws: dict[tuple[int, str], str] = {}
    for index, step in enumerate(data.get("steps", [])):
        runs_on = [r for r in step.get("ranks", range(world))]
        recs = {r: rec for r in runs_on for rec in per_rank.get(r, [])
                if rec.get("step") == index}
        missing = [r for r in runs_on if r not in recs and r not in want_hung
                   and want_codes.get(r, 0) == 0]
        if missing:
            problems.append(f"step {index} ({step['do']}): no report from rank(s) {missing} "
                            "(an earlier step diverged, or the rank died or hung)")
        problems += _check_step(step, recs, ops_ws, index)
    for r in range(world):
        finals = [rec for rec in per_rank.get(r, []) if rec.get("final")]
        if finals and finals[-1]["leaks"]:
            problems.append(f"rank {r} leaks after destroy_all: {finals[-1]['leaks']}")
        elif not finals and r not in hung and want_codes.get(r, 0) == 0:
            problems.append(f"rank {r} never reached its leak check")
    return problems, _summary(per_rank)


def _summary(per_rank: dict[int, list[dict[str, Any]]]) -> str:
    backends: dict[str, set[int]] = {}
    errors: dict[str, set[int]] = {}
    for rank, recs in per_rank.items():
        for rec in recs:
            if rec.get("do") == "create" and rec.get("ok"):
                backends.setdefault(str(rec["backend"]), set()).add(rank)
            if rec.get("ok") is False:
                errors.setdefault(str(rec.get("error_type")), set()).add(rank)
    parts = [f"{b} on ranks {sorted(rs)}" for b, rs in backends.items()]
    parts += [f"{e} on ranks {sorted(rs)}" for e, rs in errors.items()]
    return "; ".join(parts)


def _mount_tmpfs(target: Path, size: str) -> str:
    """Mount a tmpfs of ``size`` at ``target``; "" or why it could not be done."""
    target.mkdir(parents=True, exist_ok=True)
    if os.environ.get("ARFUSE_SCENARIO_PRIVATE_MOUNTS") != "1":
        return "not in a private mount namespace"
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=1777",
                           "arfuse-scenario", str(target)], capture_output=True, text=True)
    return "" if proc.returncode == 0 else f"mount failed: {proc.stderr.strip()}"


def run_job(scn: Scenario, deadline_s: float, tmp: Path | None = None) -> dict[str, Any]:
    """Fork the ranks, wait for them within ``deadline_s``, and check outcome and leaks. ``tmp``
    is the job's folder (the runner's, so that it can remove it when it has to kill the job)."""
    import multiprocessing as mp

    started = time.monotonic()
    data = scn.data
    world = int(data["ranks"])
    if tmp is None:
        tmp = Path(tempfile.mkdtemp(prefix="arfuse_scenario_"))
    tmpfs: Path | None = None
    result: dict[str, Any] = {}
    try:
        if scn.needs_tmpfs:
            tmpfs = tmp / "tmpfs"
            why = _mount_tmpfs(tmpfs, str(data["shm_tmpfs"]))
            if why:
                return {"status": "skip", "problems": [], "summary": f"no tmpfs: {why}"}
        envs = _rank_envs(scn, tmp, tmpfs)
        dirs = {Path("/dev/shm")} | {Path(e["ARFUSE_SHM_DIR"]) for e in envs
                                     if "ARFUSE_SHM_DIR" in e}
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
        import torch  # noqa: F401  (loaded once, shared by the forked ranks)

        if not any(e.get("ARFUSE_SHM_PURE_TORCH") == "1" for e in envs):
            from ..backends.shm import build as shm_build

            shm_build.load()  # built or imported once, before any rank's timed step
        ctx = mp.get_context("fork")
        reports = [tmp / f"rank{r}.jsonl" for r in range(world)]
        with store_listener() as listener:  # rank 0 serves the store on it; forks inherit it
            procs = [ctx.Process(target=_rank_main, args=(data, r, world, listener, envs[r],
                                                          str(reports[r]), deadline_s))
                     for r in range(world)]
            for p in procs:
                p.start()
        pids = [int(p.pid or 0) for p in procs]
        want_hung = {int(r) for r in data.get("expect", {}).get("hung", [])}
        end = started + deadline_s
        while time.monotonic() < end and any(p.is_alive() for p in procs):
            others = [p for r, p in enumerate(procs) if r not in want_hung]
            if want_hung and not any(p.is_alive() for p in others):
                time.sleep(0.3)  # the expected hang must still be hanging, not exiting late
                break
            time.sleep(0.02)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        exitcodes = {r: p.exitcode for r, p in enumerate(procs)}
        per_rank = {r: _records(reports[r]) for r in range(world)}
        problems, summary = evaluate(scn, per_rank, exitcodes, hung)
        left = [p for p in pids if Path(f"/proc/{p}").exists()
                and "Z" not in Path(f"/proc/{p}/stat").read_text().split(")")[-1][:3]]
        if left:
            problems.append(f"rank processes still alive: {left}")
        stray = [p for p in _pgid_members(os.getpgrp()) if p != os.getpid()
                 and p not in (os.getppid(),)]
        if stray:
            problems.append(f"processes of the job still running: {stray}")
        segs = _segments_of(pids, dirs)
        private = [d for d in dirs if d != Path("/dev/shm")]
        segs += [str(d / n) for d in private for n in os.listdir(d) if n.startswith("arfuse-")]
        if segs:
            problems.append(f"segments left behind: {sorted(set(segs))}")
        result = {"status": "fail" if problems else "pass", "problems": problems,
                  "summary": summary, "pids": pids, "hung": hung,
                  "exitcodes": {str(k): v for k, v in exitcodes.items()}}
        return result
    finally:
        if tmpfs is not None:
            subprocess.run(["umount", "-l", str(tmpfs)], capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)


def job_main(argv: list[str] | None = None) -> None:
    """``python -c 'from arfuse.cli.scenario import job_main; job_main()' FILE OUT [SCALE
    [TMP]]``: the file is read again here, so the runner's ``--limit-scale`` comes as SCALE
    (else the ranks' deadline would be the unscaled one) and its folder for the job as TMP."""
    argv = sys.argv[1:] if argv is None else argv
    path, out = argv[0], argv[1]
    scale = float(argv[2]) if len(argv) > 2 else 1.0
    tmp = Path(argv[3]) if len(argv) > 3 else None
    die_with_parent()
    started = time.monotonic()
    try:
        scn = load_scenario(path).scaled(scale)
        margin = min(3.0, 0.2 * scn.limit_s)
        if scn.level == "decision":
            result = run_decision(scn)
        else:
            result = run_job(scn, scn.limit_s - margin - 1.0, tmp)
    except Exception as exc:
        result = {"status": "fail", "problems": [f"{type(exc).__name__}: {exc}"], "summary": ""}
    result["seconds"] = round(time.monotonic() - started, 3)
    Path(out).write_text(json.dumps(result, default=str))
    sys.stdout.flush()
    os._exit(0)


# --- the runner ----------------------------------------------------------------------------------


@dataclass
class Outcome:
    scenario: Scenario
    status: str
    seconds: float
    summary: str
    problems: list[str]


_NS_PREFIXES = (["unshare", "--mount", "--propagation", "private", "--"],
                ["unshare", "--user", "--map-root-user", "--mount", "--propagation", "private",
                 "--"])


def private_mount_prefix() -> tuple[list[str] | None, str]:
    """How to start a job in a private mount namespace here, or why it cannot be done."""
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return None, "unshare(1) or mount(8) is not installed"
    why = ""
    for prefix in _NS_PREFIXES:
        probe = subprocess.run([*prefix, "sh", "-c", "d=$(mktemp -d) && mount -t tmpfs -o "
                                "size=64k x \"$d\" && umount \"$d\"; r=$?; rmdir \"$d\"; "
                                "exit $r"], capture_output=True, text=True, timeout=30)
        if probe.returncode == 0:
            return prefix, ""
        why = probe.stderr.strip()[-200:]
    return None, f"mount namespaces are not allowed here ({why})"


def _job_env() -> dict[str, str]:
    """Hermetic: the caller's ARFUSE_* settings do not leak into a scenario; what concerns the
    installation does (the kernel's cache, or running without it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARFUSE_")
           or k in ("ARFUSE_CACHE_DIR", "ARFUSE_SHM_PURE_TORCH")}
    env["ARFUSE_LOG"] = "warning"
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _stop_session(proc: subprocess.Popen[str]) -> None:
    """Kill the job's whole session (it runs in one of its own) and wait until none of it is
    left, so that nothing writes into the job's folder once it is removed."""
    if proc.poll() is None or _pgid_members(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)
    end = time.monotonic() + 5.0
    while _pgid_members(proc.pid) and time.monotonic() < end:
        time.sleep(0.02)


def run_one(path: Path, scale: float = 1.0) -> Outcome:
    """One scenario under its hard limit (times ``scale``): the job's whole session is
    killed when it overruns, and what it left is checked either way. The job's folder is made
    and removed here: a job killed (overrun, Ctrl-C) cannot clean up after itself."""
    started = time.monotonic()
    try:
        scn = load_scenario(path).scaled(scale)
    except ValueError as exc:
        return Outcome(Scenario(path, {}), "fail", 0.0, "", [str(exc)])
    env = _job_env()
    prefix: list[str] = []
    if scn.needs_tmpfs:
        found, why = private_mount_prefix()
        if found is None:
            return Outcome(scn, "skip", 0.0, f"/dev/shm full needs a tmpfs: {why}", [])
        prefix = found
        env["ARFUSE_SCENARIO_PRIVATE_MOUNTS"] = "1"
    limit = scn.limit_s
    with tempfile.TemporaryDirectory(prefix="arfuse_scenario_out_") as out_dir:
        out = Path(out_dir) / "result.json"
        job_tmp = tempfile.mkdtemp(prefix="arfuse_scenario_")
        proc: subprocess.Popen[str] | None = None
        try:
            proc = subprocess.Popen([*prefix, sys.executable, "-c", _JOB_ENTRY, str(path),
                                     str(out), repr(scale), job_tmp],
                                    env=env, start_new_session=True, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
            seen: set[int] = set()
            overran = False
            output = ""
            try:
                output, _ = proc.communicate(timeout=limit)
            except subprocess.TimeoutExpired:
                overran = True
                seen.update(_pgid_members(proc.pid))
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                output, _ = proc.communicate()
            time.sleep(0.05)
            remaining = _pgid_members(proc.pid)
        finally:  # also on Ctrl-C: the job's session goes, then its folder
            if proc is not None:
                _stop_session(proc)
            shutil.rmtree(job_tmp, ignore_errors=True)
        seconds = time.monotonic() - started
        if overran:
            left = _segments_of(seen, [Path("/dev/shm")])
            return Outcome(scn, "fail", seconds, "", [
                f"overran its limit of {limit:g} s: killed (a hang fails, it never blocks)"]
                + ([f"segments left: {left}"] if left else []))
        try:
            result = json.loads(out.read_text())
        except (OSError, json.JSONDecodeError):
            return Outcome(scn, "fail", seconds, "", [
                f"the job ended (code {proc.returncode}) without a result: {output[-800:]}"])
    problems = list(result.get("problems", []))
    if remaining:
        problems.append(f"processes of the job outlived it: {remaining}")
    left = _segments_of(result.get("pids", []), [Path("/dev/shm")])
    if left:
        problems.append(f"segments left in /dev/shm: {left}")
    status = "fail" if problems else str(result.get("status", "fail"))
    return Outcome(scn, status, seconds, str(result.get("summary", "")), problems)


def format_table(outcomes: list[Outcome]) -> str:
    width = max([len(o.scenario.name) for o in outcomes] + [8])
    lines = [f"{'scenario':<{width}}  {'rows':<8} {'level':<8} {'result':<6} {'s':>6}  detail"]
    for o in outcomes:
        rows = ",".join(map(str, o.scenario.rows)) or "-"
        detail = o.problems[0] if o.problems else o.summary
        lines.append(f"{o.scenario.name:<{width}}  {rows:<8} {o.scenario.level:<8} "
                     f"{o.status.upper():<6} {o.seconds:>6.1f}  {detail[:160]}")
        for extra in o.problems[1:4]:
            lines.append(f"{'':<{width}}  {'':<8} {'':<8} {'':<6} {'':>6}  {extra[:160]}")
    passed = sum(o.status == "pass" for o in outcomes)
    failed = sum(o.status == "fail" for o in outcomes)
    skipped = sum(o.status == "skip" for o in outcomes)
    lines.append(f"\n{passed} passed, {failed} failed, {skipped} skipped, "
                 f"{sum(o.seconds for o in outcomes):.1f} s")
    return "\n".join(lines)


def coverage(outcomes: list[Outcome]) -> str:
    """DESIGN 1 row -> scenarios -> level -> result, as markdown (docs/reliability.md)."""
    lines = ["| design row | scenario | level | result |", "|---|---|---|---|"]
    for row in range(1, 13):
        for o in outcomes:
            if row in o.scenario.rows:
                level = "decision" if o.scenario.level == "decision" else "real ranks"
                lines.append(f"| {row} | `{o.scenario.name}` | {level} | {o.status} |")
    cases = [(c, o) for o in outcomes for c in o.scenario.cases]
    if cases:
        lines += ["", "| case | scenario | level | result |", "|---|---|---|---|"]
        for case, o in sorted(cases, key=lambda item: item[0]):
            level = "decision" if o.scenario.level == "decision" else "real ranks"
            lines.append(f"| {case} | `{o.scenario.name}` | {level} | {o.status} |")
    return "\n".join(lines)


def recorded_figures(paths: Iterable[str | os.PathLike[str]]) -> str:
    """What docs/reliability.md records beyond the scenarios (two hosts, soak, fuzzing, leaks,
    findings), found next to a scenarios directory: the command prints the whole report."""
    for item in paths:
        doc = Path(item).resolve().parent / "docs" / "reliability.md"
        if Path(item).is_dir() and doc.is_file():
            text = doc.read_text()
            start = text.find("\n## Two hosts")
            if start >= 0:
                return f"(recorded in {doc})\n" + text[start + 1:].rstrip()
    return ""


MAX_LIMIT_SCALE = 100.0  # 600 s (the largest limit_s) times this still fits every timeout


def limit_scale(text: str) -> float:
    """``--limit-scale``: a positive finite factor (0, a negative, inf, nan or a huge one would
    turn every limit into nonsense or a traceback)."""
    allowed = f"use a number > 0 and <= {MAX_LIMIT_SCALE:g}, such as 2 or 0.5"
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; {allowed}") from None
    if not math.isfinite(value) or not 0 < value <= MAX_LIMIT_SCALE:
        raise argparse.ArgumentTypeError(f"{text!r} is out of range; {allowed}")
    return value


def check_output_file(path: str) -> None:
    """``--json``: checked before the first scenario runs, not after all of them."""
    target = Path(path)
    parent = target.parent
    if target.is_dir():
        raise ValueError(f"--json {path!r} is a directory; give a file path")
    if not parent.is_dir():
        raise ValueError(f"--json {path!r}: directory {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (target.exists()
                                                    and not os.access(target, os.W_OK)):
        raise ValueError(f"--json {path!r} cannot be written (permission denied)")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("scenario", help="replay the field's failures as scenarios")
    verbs = p.add_subparsers(dest="scenario_command", required=True)
    run_p = verbs.add_parser("run", help="run scenario files (FILE or DIR of *.toml)")
    run_p.add_argument("paths", nargs="+", help="scenario files or directories")
    run_p.add_argument("--json", default=None, help="write the outcomes to this file")
    run_p.add_argument("--limit-scale", type=limit_scale, default=1.0,
                       help="multiply every scenario's hard limit, in (0, 100] (slow "
                       "machines)")
    run_p.set_defaults(func=run)


def run(args: argparse.Namespace, say: Callable[[str], None] = print) -> int:
    if args.json:
        check_output_file(args.json)
    files = scenario_files(args.paths)
    if not files:
        raise ValueError(f"no scenario files in {args.paths}")
    if os.environ.get("ARFUSE_SHM_PURE_TORCH") != "1":
        from ..backends.shm import build as shm_build

        shm_build.load()  # a first build (~40 s) must not count against a scenario's limit
    outcomes = []
    for path in files:
        outcome = run_one(path, args.limit_scale)
        say(f"{outcome.status.upper():<5} {outcome.scenario.name} ({outcome.seconds:.1f} s)")
        outcomes.append(outcome)
    say("")
    say(format_table(outcomes))
    if len(files) > 1:
        say("")
        say(coverage(outcomes))
        recorded = recorded_figures(args.paths)
        if recorded:
            say("")
            say(recorded)
    if args.json:
        text = json.dumps([
            {"scenario": o.scenario.name, "file": str(o.scenario.path), "rows": o.scenario.rows,
             "cases": o.scenario.cases, "level": o.scenario.level, "status": o.status,
             "seconds": round(o.seconds, 2), "summary": o.summary, "problems": o.problems}
            for o in outcomes], indent=2)
        try:
            Path(args.json).write_text(text)
        except OSError as exc:  # removed or filled since the check: still one line
            raise ValueError(f"--json {args.json!r} cannot be written: {exc}") from None
    return 1 if any(o.status == "fail" for o in outcomes) else 0
