"""Recognise RMSNorm in a post-grad FX graph, in the forms models write it.

Post-grad graphs hold aten and prims ops only, so ``F.rms_norm``, ``nn.RMSNorm`` and the
hand-written norms of HF's modelling code all arrive decomposed. From the norm's input ``h``:

    c = h, or convert(h, float32)
    v = mean(pow(c, 2) | mul(c, c), [-1], keepdim=True)
    n = mul(c, rsqrt(add(v, eps)))                  (either operand order, here and below)
    "weight in fp32" (F.rms_norm, nn.RMSNorm, Gemma):  out = convert(mul(n, W), T)
        W = w | convert(w, float32) | add(w | convert(w, float32), 1.0)   (Gemma: weight_bias=1)
    "weight in T" (Llama, Qwen, Mistral):             out = mul(convert(n, T), w)

Then, optionally, static FP8 quantisation of ``out`` as vLLM's ``QuantFP8`` writes it in torch
(the per-tensor form its all-reduce fusion matches, ``find_fp8``):

    q = convert(clamp(mul(convert(out, float32), reciprocal(scale)), -448, 448), float8_e4m3fn)

(``clamp`` as ``clamp_min``/``clamp_max`` in either order or one ``clamp``; ``scale`` a
one-element fp32 tensor: the dequantisation scale). That is arfuse's ``quant="fp8"`` to the
bit. ``out / scale`` rounds differently from ``out * (1 / scale)`` and is left alone.

Or per-token-group FP8 of ``out`` as DeepSeek's ``act_quant`` writes it in torch, with the eps
clamp of vLLM's ``per_token_group_quant_fp8`` reference (``find_fp8_group``):

    y = view(out | convert(out, float32), [..., g])          (g in 32, 64, 128, dividing H)
    s = div(clamp_min(amax(abs(y), [-1], keepdim), eps), 448)   (amax in fp32, eps 1e-10)
    q = convert(clamp(div(y, s), -448, 448), float8_e4m3fn)

(``amax`` or ``max(...)[0]``; the view and the convert in either order). That is arfuse's
``quant="fp8_group"`` with fp32 scales to the bit, except where a group holds a NaN: torch's
``amax`` is NaN there, arfuse's leaves NaN out (the operator then quantises those rows as the
graph does, ``runtime``). Forms that round otherwise are left in the graph, with why in the
debug log: another eps, no eps, the clamp after the division by 448 or in the activation
dtype, a multiplication by ``1/448`` or by the scale's reciprocal.

With ``T`` float32 the converts vanish and both forms read ``mul(n, w)``. The first form is
arfuse's epilogue to the bit; the second rounds once more (to ``T`` before the weight), which
arfuse does not: with ``T`` bf16 or fp16 the fused output may differ from the graph's in the
last bit of some elements.

Pure FX: no torch.distributed, no arfuse backend, so the tests can feed it any graph.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Node

from ..pattern import GROUP_SIZES
from ..quant import FP8_GROUP_EPS, FP8_MAX, f32

aten = torch.ops.aten
prims = torch.ops.prims

WEIGHT_FP32 = 0
"""Form code: ``out = T(n * (w + weight_bias))`` (one rounding; arfuse's epilogue)."""
WEIGHT_IN_T = 1
"""Form code: ``out = T(n) * w`` (rounded to ``T`` before the weight)."""

_ADD = (aten.add.Tensor, aten.add.Scalar)
_MUL = (aten.mul.Tensor, aten.mul.Scalar)


@dataclass(frozen=True)
class Norm:
    """An RMSNorm of ``h`` found in a graph: its output node, weight node, numbers and form."""

    output: Node
    weight: Node
    eps: float | Node  # a node: a graph input holding the number
    weight_bias: float
    form: int
    nodes: tuple[Node, ...]  # every node of the norm after h, in graph order


@dataclass(frozen=True)
class Fp8:
    """Static FP8 quantisation of a norm's output: the fp8 node, the scale node, and every
    node of it after the output (``reciprocal`` included, if nothing else uses it)."""

    output: Node
    scale: Node
    nodes: tuple[Node, ...]


def val(node: Any) -> Any:
    """The fake tensor FX recorded for ``node`` (``None`` for a constant or no record)."""
    return node.meta.get("val") if isinstance(node, Node) else None


def _is(node: Any, targets: tuple[Any, ...]) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def _convert_to(node: Any, dtype: torch.dtype) -> Node | None:
    """The input of ``node`` when ``node`` converts it to ``dtype``."""
    if _is(node, (prims.convert_element_type.default,)) and node.args[1] == dtype:
        source = node.args[0]
        return source if isinstance(source, Node) else None
    return None


def _other(node: Node, one: Any) -> Any:
    """The operand of binary ``node`` that is not ``one`` (``None`` when neither is)."""
    a, b = node.args[0], node.args[1]
    return b if a is one else a if b is one else None


def _users(node: Node, targets: tuple[Any, ...]) -> list[Node]:
    return [u for u in node.users if _is(u, targets)]


def constant(value: Any, depth: int = 4) -> float | None:
    """The number ``value`` is: a Python number, or a node that makes a one-element tensor
    of one (``full``, ``scalar_tensor``, a converted one; dynamic shapes lift ``eps`` so)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if not isinstance(value, Node) or value.op != "call_function" or depth == 0:
        return None
    if value.target == prims.convert_element_type.default:
        return constant(value.args[0], depth - 1)
    if value.target == aten.full.default and value.args[0] in ([], [1], (), (1,)):
        return constant(value.args[1], depth - 1)
    if value.target == aten.scalar_tensor.default:
        return constant(value.args[0], depth - 1)
    return None


def _graph_input(value: Any) -> Node | None:
    """The graph input a 0-d ``value`` converts (with dynamic shapes Dynamo passes a float
    attribute such as ``eps`` as an input): the runtime reads its number."""
    while isinstance(value, Node) and value.op == "call_function" \
            and value.target == prims.convert_element_type.default:
        value = value.args[0]
    held = val(value)
    if isinstance(value, Node) and value.op == "placeholder" and held is not None \
            and held.numel() == 1 and held.is_floating_point():
        return value
    return None


def _only_user(node: Node) -> Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _squares_mean(c: Node) -> tuple[Node, Node] | None:
    """``(square, mean)`` when ``mean(c * c over the last dim, keepdim)`` is computed."""
    ndim = val(c).dim()
    squares = [u for u in _users(c, (aten.pow.Tensor_Scalar,)) if u.args[1] == 2]
    squares += [u for u in _users(c, (aten.mul.Tensor,)) if u.args[0] is c and u.args[1] is c]
    for square in squares:
        mean = _only_user(square)
        if not _is(mean, (aten.mean.dim,)) or mean is None:
            continue
        dims = mean.args[1]
        if not isinstance(dims, (list, tuple)):
            continue
        keepdim = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
        if keepdim and len(dims) == 1 and dims[0] % ndim == ndim - 1:
            return square, mean
    return None


def _normalised(c: Node, mean: Node) -> tuple[list[Node], float | Node] | None:
    """``([add, rsqrt, n], eps)`` when ``n = c * rsqrt(mean + eps)``."""
    add = _only_user(mean)
    if not _is(add, _ADD) or add is None or add.args[0] is not mean:
        return None
    eps: float | Node | None = constant(add.args[1])
    if eps is None:
        eps = _graph_input(add.args[1])
    if eps is None:
        return None
    rsqrt = _only_user(add)
    if not _is(rsqrt, (aten.rsqrt.default,)) or rsqrt is None:
        return None
    n = _only_user(rsqrt)
    if not _is(n, (aten.mul.Tensor,)) or n is None or _other(n, rsqrt) is not c:
        return None
    return [add, rsqrt, n], eps


def _weight_of(factor: Any, dtype: torch.dtype) -> tuple[Node, float, list[Node]] | None:
    """``(w, weight_bias, nodes)`` for a weight factor ``w``, ``float32(w)`` or ``+ 1.0`` of
    either, ``w`` a 1-D tensor of ``dtype``."""
    nodes: list[Node] = []
    bias = 0.0
    if _is(factor, _ADD) and not isinstance(factor.args[1], Node):
        constant = factor.args[1]
        if isinstance(constant, bool) or not isinstance(constant, (int, float)):
            return None
        nodes.append(factor)
        bias, factor = float(constant), factor.args[0]
    converted = _convert_to(factor, torch.float32)
    if converted is not None:
        nodes.append(factor)
        factor = converted
    weight = val(factor)
    if not isinstance(factor, Node) or weight is None or weight.dim() != 1:
        return None
    if weight.dtype != dtype:
        return None
    return factor, bias, nodes


def find_norm(h: Node) -> Norm | None:
    """The RMSNorm over the last dimension of ``h``, if the graph computes one (see the module
    docstring for the forms), with a weight of ``h``'s dtype and size."""
    dtype = val(h).dtype
    cs = [h] if dtype == torch.float32 else _users(h, (prims.convert_element_type.default,))
    for c in cs:
        if c is not h and _convert_to(c, torch.float32) is not h:
            continue
        found = _squares_mean(c)
        if found is None:
            continue
        normalised = _normalised(c, found[1])
        if normalised is None:
            continue
        middle, eps = normalised
        tail = _weighted(middle[-1], dtype, val(h).shape[-1])
        if tail is None:
            continue
        output, weight, bias, form, tail_nodes = tail
        head = [c] if c is not h else []
        return Norm(output, weight, eps, bias, form,
                    (*head, *found, *middle, *tail_nodes))
    return None


def _weighted(n: Node, dtype: torch.dtype,
              hidden: Any) -> tuple[Node, Node, float, int, list[Node]] | None:
    """``(output, w, weight_bias, form, nodes)``: the weight step after the normalised ``n``."""
    user = _only_user(n)
    if user is None:
        return None
    if dtype == torch.float32:  # no converts: n * W
        if not _is(user, (aten.mul.Tensor,)):
            return None
        weight = _weight_of(_other(user, n), dtype)
        if weight is None or not _fits(weight[0], hidden):
            return None
        return user, weight[0], weight[1], WEIGHT_FP32, [*weight[2], user]
    if _convert_to(user, dtype) is n:  # weight in T: convert(n, T) * w
        product = _only_user(user)
        if not _is(product, (aten.mul.Tensor,)) or product is None:
            return None
        factor = _other(product, user)
        weight_t = val(factor)
        if not isinstance(factor, Node) or weight_t is None or weight_t.dim() != 1 \
                or weight_t.dtype != dtype or not _fits(factor, hidden):
            return None
        return product, factor, 0.0, WEIGHT_IN_T, [user, product]
    if not _is(user, (aten.mul.Tensor,)):  # weight in fp32: convert(n * W, T)
        return None
    weight = _weight_of(_other(user, n), dtype)
    output = _only_user(user)
    if weight is None or output is None or _convert_to(output, dtype) is not user \
            or not _fits(weight[0], hidden):
        return None
    return output, weight[0], weight[1], WEIGHT_FP32, [*weight[2], user, output]


def _fits(weight: Node, hidden: Any) -> bool:
    return bool(val(weight).shape[0] == hidden)


_CLAMPS = (aten.clamp_min.default, aten.clamp_max.default, aten.clamp.default)


def _clamped(node: Node) -> Node | None:
    """The end of ``clamp(node, -448, 448)`` (one ``clamp`` or ``clamp_min`` and
    ``clamp_max`` in either order), ``None`` when it is not that."""
    low = high = None
    for _ in range(2):
        user = _only_user(node)
        if user is None or not _is(user, _CLAMPS) or user.args[0] is not node:
            return None
        if user.target == aten.clamp.default:
            low, high = constant(user.args[1]), constant(user.args[2]) if len(
                user.args) > 2 else None
        elif user.target == aten.clamp_min.default:
            low = constant(user.args[1])
        else:
            high = constant(user.args[1])
        node = user
        if low is not None and high is not None:
            break
    return node if (low, high) == (-FP8_MAX, FP8_MAX) else None


def find_fp8(out: Node) -> Fp8 | None:
    """Static FP8 quantisation of ``out`` (the module docstring's form), if the graph has it."""
    c = out if val(out).dtype == torch.float32 else next(
        (u for u in _users(out, (prims.convert_element_type.default,))
         if u.args[1] == torch.float32), None)
    if c is None:
        return None
    for product in _users(c, (aten.mul.Tensor,)):
        inverse = _other(product, c)
        if not _is(inverse, (aten.reciprocal.default,)):
            continue
        scale = inverse.args[0]
        held = val(scale)
        if not isinstance(scale, Node) or held is None or held.numel() != 1 \
                or held.dtype != torch.float32:
            continue
        clamped = _clamped(product)
        q = _only_user(clamped) if clamped is not None else None
        if q is None or _convert_to(q, torch.float8_e4m3fn) is not clamped:
            continue
        nodes = [c] if c is not out else []
        nodes += [inverse] if len(inverse.users) == 1 else []
        chain = [product]
        while chain[-1] is not clamped:
            chain.append(next(iter(chain[-1].users)))
        return Fp8(q, scale, (*nodes, *chain, q))
    return None


@dataclass(frozen=True)
class Fp8Group:
    """Per-token-group FP8 of a norm's output: the e4m3 node, the scale node (the grouped
    shape with a last dimension of 1), the group size, and every node of it after the
    output."""

    output: Node
    scale: Node
    group_size: int
    nodes: tuple[Node, ...]
    shape: Any  # the grouped view's size argument (ints, or nodes of symbolic sizes); None:
    # rows of one group, no view


_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def _grouped_views(out: Node) -> dict[Node, int]:
    """Nodes holding ``out``'s values (exactly: fp32 converts of it) viewed as groups of g
    consecutive columns, g a group size dividing the hidden size: node -> g. A row of one
    group needs no view (``out`` and its convert are grouped already)."""
    hidden = val(out).shape[-1]
    whole = hidden if isinstance(hidden, int) and hidden in GROUP_SIZES else 0
    found: dict[Node, int] = {out: whole} if whole else {}
    frontier: list[tuple[Node, int]] = [(out, whole)]
    for _ in range(2):  # a view and a convert, in either order
        step: list[tuple[Node, int]] = []
        for node, group in frontier:
            for user in node.users:
                if _convert_to(user, torch.float32) is node:
                    step.append((user, group))
                elif _is(user, _VIEWS) and user.args[0] is node:
                    shape = val(user).shape if val(user) is not None else ()
                    g = shape[-1] if shape else 0
                    if isinstance(g, int) and g in GROUP_SIZES and not hidden % g:
                        step.append((user, g))
        frontier = step
        found.update((node, group) for node, group in step if group)
    return found


def _symbolic_groups(out: Node) -> bool:
    """Whether ``out`` (or its fp32 convert) is viewed with a symbolic last dimension, then
    its absolute values taken: a group amax whose group size is not fixed."""
    sources = [out, *(u for u in out.users if _convert_to(u, torch.float32) is out)]
    for source in sources:
        for view in source.users:
            held = val(view)
            if _is(view, _VIEWS) and held is not None and held.dim() \
                    and not isinstance(held.shape[-1], int) \
                    and _users(view, (aten.abs.default,)):
                return True
    return False


def _amax(node: Node) -> Node | None:
    """The keepdim amax over the last dimension of ``node`` (``amax``, or ``max.dim``'s values)."""
    ndim = val(node).dim()
    for user in node.users:
        if _is(user, (aten.amax.default,)):
            dims = user.args[1] if len(user.args) > 1 else user.kwargs.get("dim")
            keep = user.args[2] if len(user.args) > 2 else user.kwargs.get("keepdim", False)
            if isinstance(dims, (list, tuple)) and len(dims) == 1 and keep \
                    and dims[0] % ndim == ndim - 1:
                return user
        if _is(user, (aten.max.dim,)):
            dim = user.args[1]
            keep = user.args[2] if len(user.args) > 2 else user.kwargs.get("keepdim", False)
            values = [u for u in user.users if u.target is operator.getitem and u.args[1] == 0]
            if isinstance(dim, int) and dim % ndim == ndim - 1 and keep and len(values) == 1:
                return values[0]
    return None


def _clamp_min_of(node: Node) -> tuple[Node, float] | None:
    """``(clamp node, its lower bound)`` when ``node``'s one use clamps it from below only."""
    user = _only_user(node)
    if user is None or not _is(user, (aten.clamp_min.default, aten.clamp.default)) \
            or user.args[0] is not node:
        return None
    low = constant(user.args[1]) if len(user.args) > 1 else None
    high = user.args[2] if len(user.args) > 2 else user.kwargs.get("max")
    if low is None or high is not None:
        return None
    return user, low


def find_fp8_group(out: Node) -> tuple[Fp8Group | None, str]:
    """Per-token-group FP8 of ``out`` (the module docstring's form), or ``(None, why)`` where a
    group amax of ``out`` is computed but the rest rounds otherwise than arfuse's rule (``""``
    when there is no group amax at all)."""
    grouped = _grouped_views(out)
    if not grouped and _symbolic_groups(out):
        return None, ("the group size is symbolic (dynamic=True makes integers dynamic): the "
                      "fused call needs it fixed; mark only the token dimension dynamic")
    for y, group in grouped.items():
        for absolute in _users(y, (aten.abs.default,)):
            amax = _amax(absolute)
            if amax is None:
                continue
            found, why = _group_scale(out, grouped, y, group, absolute, amax)
            if found is not None or why:
                return found, why
    return None, ""


def _group_scale(out: Node, grouped: dict[Node, int], y: Node, group: int, absolute: Node,
                 amax: Node) -> tuple[Fp8Group | None, str]:
    nodes: list[Node] = [absolute]
    if amax.target is operator.getitem and isinstance(amax.args[0], Node):
        nodes.append(amax.args[0])  # the max.dim node
    nodes.append(amax)
    start = amax
    if val(amax).dtype != torch.float32:
        widened = next((u for u in amax.users if _convert_to(u, torch.float32) is amax), None)
        if widened is None:
            return None, "the group amax is clamped in the activation dtype, not in fp32"
        nodes.append(widened)
        start = widened
    clamped = _clamp_min_of(start)
    if clamped is None:
        after = _only_user(start)
        if _is(after, (aten.div.Tensor,)) and after is not None:
            return None, ("no eps clamp before the division by 448 (a group of zeros divides "
                          "by zero; arfuse's rule takes max(amax, 1e-10))")
        return None, ""
    clamp, eps = clamped
    if f32(eps) != FP8_GROUP_EPS:
        return None, f"eps {eps:g} is not fp8_group's {FP8_GROUP_EPS:g}"
    nodes.append(clamp)
    scale = _only_user(clamp)
    if scale is not None and _convert_to(scale, torch.float32) is None \
            and _is(scale, (prims.convert_element_type.default,)):
        return None, "the clamped amax is rounded to another dtype before the division"
    if scale is None or not _is(scale, (aten.div.Tensor,)) or scale.args[0] is not clamp \
            or constant(scale.args[1]) != FP8_MAX:
        return None, ("the scale is not max(amax, eps) / 448 as one fp32 division (a "
                      "multiplication by 1/448 rounds otherwise)")
    nodes.append(scale)
    divided = [u for u in scale.users if _is(u, (aten.div.Tensor,)) and u.args[1] is scale
               and isinstance(u.args[0], Node) and grouped.get(u.args[0]) == group]
    if len(divided) != 1:
        return None, ("the group values are not divided by the scale (a multiplication by its "
                      "reciprocal rounds otherwise)")
    clamped_q = _clamped(divided[0])
    q = _only_user(clamped_q) if clamped_q is not None else None
    if q is None or _convert_to(q, torch.float8_e4m3fn) is not clamped_q:
        return None, "the quotient is not clamped to +-448 and cast to float8_e4m3fn"
    chain = [divided[0]]
    while chain[-1] is not clamped_q:
        chain.append(next(iter(chain[-1].users)))
    dividend = divided[0].args[0]
    assert isinstance(dividend, Node)
    view = next((n for n in _between(out, [dividend]) if _is(n, _VIEWS)), None)
    between = _between(out, [y, dividend])
    return Fp8Group(q, scale, group, (*between, *nodes, *chain, q),
                    None if view is None else view.args[1]), ""


def _between(out: Node, ends: list[Node]) -> list[Node]:
    """The nodes from ``out`` (excluded) to each of ``ends`` (included), in graph order."""
    found: list[Node] = []
    for end in ends:
        node: Any = end
        path: list[Node] = []
        while node is not out:
            path.append(node)
            node = node.args[0]
        found.extend(n for n in reversed(path) if n not in found)
    return found
