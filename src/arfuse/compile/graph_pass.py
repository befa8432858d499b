"""The post-grad pass: all-reduce (+ residual add) + RMSNorm -> one arfuse call.

Dynamo traces ``torch.distributed.all_reduce(t)``, ``_functional_collectives.all_reduce`` and
DTensor's Partial -> Replicate alike, as ``wait_tensor(_c10d_functional.all_reduce(x, "sum",
group_name))``: the chain's group is the process group of that name. DeepSpeed's AutoTP calls
its own ``deepspeed.inference_all_reduce(x)``, which names no group: it sums the ranks of the
world DeepSpeed started with when they are all on this host (``LOCAL_SIZE`` equal to the
world's size), so its chains are the default group's then and are left otherwise
(``_deepspeed_group``). The pattern matcher finds either, and the handler looks after it for

* ``h = sum + residual`` (either order; ``sum`` used by nothing else), then an RMSNorm of
  ``h`` (``match.find_norm``): the fused call's ``out`` replaces the norm's output and its
  ``residual_out`` replaces ``h``;
* or an RMSNorm of the sum itself: ``residual_out`` (the sum) replaces the sum's other uses;
* either, when static FP8 quantisation of the norm's output follows (``match.find_fp8``),
  with the quantisation: the fused call's ``quant_out`` replaces the fp8 tensor;
* or, when per-token-group FP8 follows in the form of DeepSeek's ``act_quant``
  (``match.find_fp8_group``), with ``quant="fp8_group"``: ``quant_out`` and ``scale_out``
  (fp32) replace the fp8 tensor and the scale, viewed to their shapes. A form that would
  round otherwise stays in the graph after the fused chain, and the debug log says why.

Chains of groups other than the one given (if one was), of one-rank groups, other reductions,
sums used elsewhere, norms ``find_norm`` does not know, an ``eps`` the fused call would refuse
(``arg_checks.fp32_number``) and weights computed after the chain starts are left as they
are. Every graph logs one line at INFO: what was replaced and what was not, and why ("no
all-reduce found" included). A graph Inductor serves from its FX graph cache is not passed
again; ``compile`` logs the line the pass recorded when it compiled that graph.
"""

from __future__ import annotations

import hashlib
import operator
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch._inductor import pattern_matcher as pm
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx import Graph, Node

from .. import log
from ..arg_checks import fp32_number
from . import match, runtime

_c10d = torch.ops._c10d_functional
_ALL_REDUCE = _c10d.all_reduce.default
_WAIT = _c10d.wait_tensor.default
MAX_TOKENS = 1_048_560  # the most any backend takes (shm's progress counter)
DYNAMIC_TOKENS = 2048  # capacity for a dynamic token count without a bound or max_token_num
DEEPSPEED = "deepspeed.inference_all_reduce"
MIN_RANKS = 2
"""Groups of fewer ranks are left: their all-reduce sums nothing, and the fused call would run
unfused (the tests lower it to exercise the pass in one process)."""


@dataclass
class _Graph:
    """What one run of the pass saw in one graph."""

    order: dict[Node, int]
    replaced: Counter[str] = field(default_factory=Counter)
    left: Counter[str] = field(default_factory=Counter)


class FusionPass(CustomGraphPass):
    """An Inductor post-grad pass for the all-reduces of every process group a graph names, or
    of one (``group_name``; the others are left)."""

    def __init__(self, group_name: str | None = None, max_token_num: int | None = None,
                 then: Any = None) -> None:
        self.group_name = group_name
        self.max_token_num = max_token_num
        self.then = then  # a pass that was installed before this one, run after it
        runtime.register()  # before any compile: a graph from the FX graph cache calls it
        self._patterns = pm.PatternMatcherPass(pass_name="arfuse_fusion")
        self._seen: _Graph | None = None
        reduced = pm.CallFunction(_ALL_REDUCE, pm.KeywordArg("x"), "sum",
                                  pm.KeywordArg("group_name"))
        pm.register_graph_pattern(pm.CallFunction(_WAIT, reduced),
                                  pass_dict=self._patterns)(self._replace)
        self._deepspeed = False  # whether DeepSpeed's op is among the patterns
        self.graphs = 0  # graphs logged: passed, or served from Inductor's cache
        self.fused: Counter[str] = Counter()  # over every graph passed: what was replaced
        self.left: Counter[str] = Counter()  # and why the rest was not
        self._compiling: str | None = None  # the key of the graph ``compile`` is compiling
        self._passed = 0  # runs of the pass

    def __call__(self, graph: Graph) -> None:
        self._add_deepspeed()
        self._seen = seen = _Graph({node: i for i, node in enumerate(graph.nodes)})
        try:
            self._patterns.apply(graph)
        finally:
            self._seen = None
        self._passed += 1
        self.fused.update(seen.replaced)
        self.left.update(seen.left)
        if seen.replaced or seen.left:
            graph.eliminate_dead_code()
        count = summary(seen.replaced, seen.left)
        if self._compiling is not None:
            _record(self._compiling, count)
        self._log(count)
        if self.then is not None:
            self.then(graph)

    def compile(self, compile_fx: Callable[..., Any], gm: torch.fx.GraphModule,
                example_inputs: Any, **kwargs: Any) -> Any:
        """``compile_fx(gm, example_inputs, **kwargs)`` with this pass installed by the
        caller. Inductor serves a graph it compiled before from its FX graph cache without
        running post-grad passes: then the line the pass recorded for that graph (on disk,
        next to Inductor's cache) is logged, marked as cached."""
        key = _graph_key(gm, example_inputs, self.uuid())
        passed, self._compiling = self._passed, key
        try:
            compiled = compile_fx(gm, example_inputs, **kwargs)
        finally:
            self._compiling = None
        if self._passed == passed:
            self._log(f"{_recorded(key) or 'its count was not recorded'} "
                      "(from Inductor's cache: the pass did not run)")
        return compiled

    def _log(self, count: str) -> None:
        self.graphs += 1
        log.configure_once()  # before any op exists: ARFUSE_LOG's level and handler
        log.logger.info("arfuse compile: graph %d: %s", self.graphs, count)

    def uuid(self) -> bytes:
        """What makes this pass's output differ: its source, group and capacity, and what it
        reads of the process (the groups and their sizes, ``LOCAL_SIZE``, ``ARFUSE_BACKEND``):
        the FX graph cache keys compiled graphs by it."""
        digest = hashlib.sha256()
        for name in ("graph_pass.py", "match.py", "runtime.py"):
            digest.update((Path(__file__).parent / name).read_bytes())
        digest.update(f"{self.group_name}|{self.max_token_num}|{_context()}".encode())
        if self.then is not None:
            then = self.then.uuid() if hasattr(self.then, "uuid") else repr(self.then)
            digest.update(then if isinstance(then, bytes) else str(then).encode())
        return digest.digest()

    def _add_deepspeed(self) -> None:
        """DeepSpeed's all-reduce among the patterns once its operator exists (DeepSpeed
        defines it when its communication backend starts)."""
        if self._deepspeed or not hasattr(torch.ops, "deepspeed") \
                or not hasattr(torch.ops.deepspeed, "inference_all_reduce"):
            return
        op = torch.ops.deepspeed.inference_all_reduce.default
        pm.register_graph_pattern(pm.CallFunction(op, pm.KeywordArg("x")),
                                  pass_dict=self._patterns)(self._replace_deepspeed)
        self._deepspeed = True

    def _replace(self, found: pm.Match, x: Node, group_name: str) -> None:
        wait = found.output_node()
        reduce = wait.args[0]
        assert isinstance(reduce, Node)
        self._fuse(wait, (wait, reduce), x, group_name, self._group_problem(group_name))

    def _replace_deepspeed(self, found: pm.Match, x: Node) -> None:
        group_name, why = _deepspeed_group()
        if not why:
            why = self._group_problem(group_name)
        self._fuse(found.output_node(), (found.output_node(),), x, group_name,
                   f"{DEEPSPEED}: {why}" if why else "")

    def _fuse(self, summed: Node, reduce: tuple[Node, ...], x: Node, group_name: str,
              why: str) -> None:
        """The chain from ``summed`` (the all-reduce's result; ``reduce``: its nodes) fused
        on ``group_name``, or left for ``why`` or what ``_why_not`` finds."""
        seen = self._seen
        assert seen is not None
        why = why or _why_not(summed)
        if why:
            seen.left[why] += 1
            return
        residual, h = _residual_add(summed)
        norm = match.find_norm(h)
        if norm is None and h is not summed:
            residual, h = None, summed
            norm = match.find_norm(summed)
        if norm is None:
            seen.left["no RMSNorm after it"] += 1
            return
        why = _eps_problem(norm.eps)
        if why:  # the fused call would refuse it on every rank; the graph's own norm runs it
            seen.left[why] += 1
            return
        quant: match.Fp8 | match.Fp8Group | None = match.find_fp8(norm.output)
        inputs = [norm.weight] + ([norm.eps] if isinstance(norm.eps, Node) else [])
        if isinstance(quant, match.Fp8) and \
                seen.order.get(quant.scale, len(seen.order)) > seen.order[h]:
            quant = None  # a scale computed after the chain starts: fuse the chain without it
        if quant is None:
            quant, why = match.find_fp8_group(norm.output)
            if why:  # the chain is fused; the quantisation stays as the graph wrote it
                log.logger.debug("arfuse compile: a per-token-group FP8 quantisation is left "
                                 "in the graph: %s", why)
        if any(seen.order.get(node, len(seen.order)) > seen.order[h] for node in inputs):
            seen.left["weight computed after the sum"] += 1
            return
        _rewrite(summed.graph, reduce, group_name, x, residual, h, norm, quant,
                 self._capacity(x))
        seen.replaced[("residual + RMSNorm" if residual is not None else "RMSNorm") + (
            "" if quant is None else " + FP8" if isinstance(quant, match.Fp8)
            else f" + FP8 per {quant.group_size}-group")] += 1

    def _group_problem(self, group_name: str) -> str:
        """Why the chains of ``group_name`` are left, or ``""``."""
        if self.group_name is not None and group_name != self.group_name:
            return f"group {group_name} (not the group given)"
        from .. import settings

        if settings.load().backend == "torch":
            return "ARFUSE_BACKEND=torch"
        size = _group_size(group_name)
        if size is None:
            return f"group {group_name} (no such process group here)"
        return f"group {group_name} (one rank)" if size < MIN_RANKS else ""

    def _capacity(self, x: Node) -> int:
        """Tokens per call the op is sized for: ``max_token_num``, else the traced count, else
        (a dynamic count) its upper bound if finite, else ``DYNAMIC_TOKENS``."""
        if self.max_token_num is not None:
            return self.max_token_num
        value = match.val(x)
        tokens = value.numel() // value.shape[-1] if value.shape[-1] != 0 else 0
        if isinstance(tokens, int):
            return max(1, min(tokens, MAX_TOKENS))
        upper = _upper_bound(tokens)
        return DYNAMIC_TOKENS if upper is None else max(1, min(upper, MAX_TOKENS))


def summary(replaced: Counter[str], left: Counter[str]) -> str:
    """One graph's count: ``K of M all-reduces fused (what); left: n why, ...``."""
    total = sum(replaced.values()) + sum(left.values())
    if not total:
        return "no all-reduce found"
    return (f"{sum(replaced.values())} of {total} all-reduces fused "
            f"({_counts(replaced) or 'none'})" + (f"; left: {_counts(left)}" if left else ""))


def _why_not(summed: Node) -> str:
    value = match.val(summed)
    if value is None or value.dim() < 1 or value.dtype not in (
            torch.float32, torch.bfloat16, torch.float16):
        return "not a float tensor"
    return ""


def _group_size(group_name: str) -> int | None:
    """The size of the process group named ``group_name`` in this process, if there is one."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    resolve: Any = getattr(dist.distributed_c10d, "_resolve_process_group")  # noqa: B009
    try:
        return int(resolve(group_name).size())
    except (RuntimeError, ValueError, KeyError):
        return None


def _deepspeed_group() -> tuple[str, str]:
    """``(name, "")``: the group ``deepspeed.inference_all_reduce`` sums, the default group,
    when every rank of it is on this host (``LOCAL_SIZE`` equal to its size: only then has
    DeepSpeed's op a shared-memory workspace over the whole world); else ``("", why)``."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return "", "no process group"
    world = dist.get_world_size()
    local = os.environ.get("LOCAL_SIZE")
    if local != str(world):
        return "", (f"LOCAL_SIZE={local}" if local is not None else "no LOCAL_SIZE") + \
            f" is not the world's {world} ranks (DeepSpeed's op sums one host's ranks)"
    return str(dist.distributed_c10d._get_default_group().group_name), ""


def _context() -> str:
    """What the pass reads of the process: the process groups' names and sizes, the default
    group's name, ``LOCAL_SIZE`` and ``ARFUSE_BACKEND``."""
    import torch.distributed as dist

    groups = ""
    if dist.is_available() and dist.is_initialized():
        c10d = dist.distributed_c10d
        groups = ",".join(sorted(f"{name}:{group.size()}"
                                 for group, name in c10d._world.pg_names.items()))
        groups += f"|{c10d._get_default_group().group_name}"
    return f"{groups}|{os.environ.get('LOCAL_SIZE')}|{os.environ.get('ARFUSE_BACKEND')}"


def _graph_key(gm: torch.fx.GraphModule, example_inputs: Any, uuid: bytes) -> str:
    """A name for a graph Dynamo hands the backend: its code, its inputs' shapes and dtypes,
    and the pass's ``uuid`` (the same on every rank and in every process)."""
    digest = hashlib.sha256(uuid)
    digest.update(gm.code.encode())
    for value in example_inputs:
        held = value if isinstance(value, torch.Tensor) else None
        digest.update((f"{tuple(held.shape)}/{held.stride()}/{held.dtype}" if held is not None
                       else repr(value)).encode())
    return digest.hexdigest()[:32]


def _records() -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "arfuse-counts"


def _record(key: str, count: str) -> None:
    """Keep ``count`` for the graph ``key`` next to Inductor's cache (best effort: a count
    that cannot be written is not logged again on a cache hit, nothing worse)."""
    try:
        folder = _records()
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / key
        temporary = path.with_suffix(f".{os.getpid()}")
        temporary.write_text(count)
        temporary.replace(path)
    except OSError as e:
        log.logger.debug("arfuse compile: the graph's count was not recorded: %s", e)


def _recorded(key: str) -> str:
    try:
        return (_records() / key).read_text()
    except OSError:
        return ""


def _eps_problem(eps: float | Node) -> str:
    """Why the fused call would refuse the norm's ``eps`` (its call check's rule), or ``""``.
    A graph input's number is known only when the graph runs: ``runtime`` checks it then."""
    if isinstance(eps, Node):
        return ""
    try:
        fp32_number(eps, "eps", positive=True)
    except ValueError as e:
        return str(e)
    return ""


def _residual_add(wait: Node) -> tuple[Node | None, Node]:
    """``(residual, h)`` when the sum's one use is ``h = sum + residual`` of its shape and
    dtype, else ``(None, wait)``."""
    users = list(wait.users)
    add = users[0] if len(users) == 1 else None
    if add is None or add.op != "call_function" or add.target != torch.ops.aten.add.Tensor \
            or len(add.args) != 2 or add.kwargs:
        return None, wait
    other = match._other(add, wait)
    mine, theirs = match.val(wait), match.val(other)
    if not isinstance(other, Node) or theirs is None or other is wait:
        return None, wait
    if theirs.shape != mine.shape or theirs.dtype != mine.dtype:
        return None, wait
    return other, add


def _rewrite(graph: Graph, reduce: tuple[Node, ...], group_name: str, x: Node,
             residual: Node | None, h: Node, norm: match.Norm,
             quant: match.Fp8 | match.Fp8Group | None, capacity: int) -> None:
    """Put one fused call on ``group_name`` before ``h``; its outputs take the uses of the
    norm's output, of ``h`` and (with ``quant``) of the quantised output (and the group
    scale); the all-reduce's nodes (``reduce``, its result first) go."""
    with graph.inserting_before(h):
        eps, eps_input = (0.0, norm.eps) if isinstance(norm.eps, Node) else (norm.eps, None)
        args = (x, residual, norm.weight, eps, norm.weight_bias, group_name, capacity,
                norm.form)
        if quant is None:
            fused = graph.call_function(runtime.register(), (*args, eps_input))
        elif isinstance(quant, match.Fp8):
            fused = graph.call_function(runtime.register(runtime.FP8), (*args, quant.scale,
                                                                        eps_input))
        else:
            fused = graph.call_function(runtime.register(runtime.FP8_GROUP),
                                        (*args, quant.group_size, eps_input))
        fused.meta["val"] = (match.val(norm.output), match.val(h), *_quant_vals(x, quant))
        outputs = [graph.call_function(operator.getitem, (fused, i))
                   for i in range(len(fused.meta["val"]))]
        for output, value in zip(outputs, fused.meta["val"], strict=True):
            output.meta["val"] = value
        replaced = [norm.output, h]
        if isinstance(quant, match.Fp8):
            replaced.append(quant.output)
        elif quant is not None and quant.shape is None:  # rows of one group: as they are
            replaced += [quant.output, quant.scale]
        elif quant is not None:  # [..., H] codes and [..., G] scales in the graph's groups
            view, unsqueeze = torch.ops.aten.view.default, torch.ops.aten.unsqueeze.default
            grouped = list(quant.shape)
            scales = graph.call_function(view, (outputs[3], grouped[:-1]))
            scales.meta["val"] = match.val(quant.scale).squeeze(-1)
            outputs[2:] = [graph.call_function(view, (outputs[2], grouped)),
                           graph.call_function(unsqueeze, (scales, -1))]
            replaced += [quant.output, quant.scale]
    for output, old in zip(outputs, replaced, strict=True):
        output.meta.update(old.meta)
        old.replace_all_uses_with(output)
    quant_nodes = quant.nodes if quant is not None else ()
    for node in (*reversed(quant_nodes), *reversed(norm.nodes), h, *reduce):
        if not node.users and not node._erased:
            graph.erase_node(node)


def _quant_vals(x: Node, quant: match.Fp8 | match.Fp8Group | None) -> tuple[Any, ...]:
    """The fake values of the fused call's quantised outputs: static FP8's as the graph's;
    per group the operator's own ``[..., H]`` codes and ``[..., G]`` scales."""
    if quant is None:
        return ()
    if isinstance(quant, match.Fp8):
        return (match.val(quant.output),)
    held = match.val(x)
    groups = held.shape[-1] // quant.group_size
    return (held.new_empty(held.shape, dtype=torch.float8_e4m3fn),
            held.new_empty((*held.shape[:-1], groups), dtype=torch.float32))


def _upper_bound(expr: Any) -> int | None:
    """The finite upper bound of a symbolic size, if its shape environment knows one."""
    try:
        from torch.utils._sympy.value_ranges import bound_sympy

        node = expr.node
        upper = bound_sympy(node.expr, node.shape_env.var_to_range).upper
        return int(upper) if upper.is_finite else None
    except Exception:  # an unknown symbolic form: no bound
        return None


def _counts(counter: Counter[str]) -> str:
    return ", ".join(f"{n} {what}" for what, n in sorted(counter.items()))
