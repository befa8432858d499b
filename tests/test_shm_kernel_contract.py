"""What the compiled shm kernel promises the Python side:

* the segment layout of ``csrc/layout.h`` is the one of ``layout.py``, number for number;
* the kernel's fast entry declines (returns ``None``) every call that ``call_checks`` refuses,
  so the Python path raises the error that names the argument, and accepts the boundary values
  that ``call_checks`` accepts; its checked entry ``run`` refuses them too (``ValueError``);
* the torch backend's fast path, the same checks without shared memory, makes the
  ``CallArgs`` that ``check_call`` makes, or declines where it raises;
* ``torch.ops.arfuse.shm_fused_allreduce`` gives the fast path's bits, and traces under
  ``torch.compile``;
* mismatch messages are the same text from C++ and from the pure-torch path;
* a peer's liveness (``csrc/liveness.h``) is judged alike by the kernel and by Python.

One rank on private memory (a ``ShmComm`` of world 1), except the last test (real ranks)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from arfuse import ctables, signature
from arfuse.arg_checks import FP32_MAX, FP32_TINY, OpShape
from arfuse.backends.shm import build as shm_build
from arfuse.backends.shm import layout as shm_layout
from arfuse.backends.torch import workspace as torch_workspace
from arfuse.call_checks import check_call
from arfuse.pattern import QUANT_OUTPUTS, Pattern, output_code
from arfuse.result import FusedOutput

import ranks_calls
from harness import run_ranks, values
from ranks_calls import bad_tensor_calls

DTYPE = {torch.bfloat16: (0, "bf16"), torch.float16: (1, "fp16"), torch.float32: (2, "fp32")}
QUANTS = (None, "fp8", "nvfp4")


def kernel() -> Any:
    module = shm_build.load()
    if module is None:
        pytest.skip(f"no compiled kernel here: {shm_build.why_not()}")
    return module


@dataclass
class Comm:
    """A one-rank kernel on private memory, and what check_call needs to judge a call."""

    comm: Any
    memory: torch.Tensor
    dtype: torch.dtype
    hidden: int
    tokens: int

    @property
    def shape(self) -> OpShape:
        return OpShape(self.hidden, self.dtype, DTYPE[self.dtype][1], torch.device("cpu"))

    @property
    def shared(self) -> tuple[int, int]:
        return self.memory.data_ptr(), self.memory.data_ptr() + self.memory.numel()

    def slot_start(self) -> int:
        return self.memory.data_ptr() + int(self.comm.next_input_offset())

    def view(self, offset: int, tokens: int) -> torch.Tensor:
        nbytes = tokens * self.hidden * self.dtype.itemsize
        return self.memory[offset:offset + nbytes].view(self.dtype).view(tokens, self.hidden)

    def slot(self, tokens: int) -> torch.Tensor:
        """input_buffer(tokens) of the next call."""
        return self.view(int(self.comm.next_input_offset()), tokens)

    def x(self, tokens: int | None = None) -> torch.Tensor:
        return torch.randn(tokens or self.tokens, self.hidden).to(self.dtype)

    def w(self) -> torch.Tensor:
        return (torch.rand(self.hidden) + 0.5).to(self.dtype)


def private_comm(dtype: torch.dtype = torch.float32, hidden: int = 64, tokens: int = 8,
                 oneshot_max_bytes: int = 1 << 40) -> Comm:
    module = kernel()
    layout = shm_layout.ShmLayout(1, tokens + 2, hidden, dtype.itemsize)
    memory = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    comm = module.ShmComm(memory.data_ptr(), 1, 0, tokens + 2, hidden, DTYPE[dtype][0],
                          shm_layout.HEADER_BYTES, layout.slot_bytes, layout.input_bytes, 10.0,
                          oneshot_max_bytes)
    comm.set_result_type(FusedOutput)
    return Comm(comm, memory, dtype, hidden, tokens)


ARGS = ("x", "residual", "weight", "eps", "weight_bias", "quant", "scale", "layout", "out",
        "residual_out")
DEFAULTS: dict[str, Any] = {"residual": None, "weight": None, "eps": 1e-6, "weight_bias": 0.0,
                            "quant": None, "scale": None, "layout": "swizzled_128x4",
                            "out": None, "residual_out": None}


def full(call: dict[str, Any]) -> list[Any]:
    merged = {**DEFAULTS, **call}
    return [merged[name] for name in ARGS]


def fast(c: Comm, call: dict[str, Any]) -> Any:
    return c.comm.call(*full(call), 0, call.get("group_size"))


def checked(c: Comm, call: dict[str, Any]) -> Any:
    return check_call(c.shape, *full(call), c.shared, c.slot_start(), 0,
                      call.get("group_size"))


# --- the layout -------------------------------------------------------------------------------

def test_the_segment_identity_is_where_the_kernel_layout_puts_it() -> None:
    """Line 0 as Python writes it, read at the layout's offsets (layout.h's, as compiled:
    test_ctables_compiled): the magic, the version and the creator, all before the first
    rank's identity line."""
    import struct

    constants = {name: getattr(shm_layout, name) for name in dir(shm_layout) if name.isupper()}
    data = shm_layout.SegmentId(constants["SEGMENT_VERSION"], 1234, 5678, 42).encode()
    assert len(data) == constants["SEGMENT_ID_BYTES"] <= constants["IDENTITY_OFFSET"]
    fields = {name: struct.unpack_from("<q", data, constants[f"{name}_OFFSET"])[0]
              for name in ("MAGIC", "VERSION", "CREATOR_PID", "CREATOR_START",
                           "CREATOR_PIDNS")}
    assert fields == {"MAGIC": constants["SEGMENT_MAGIC"],
                      "VERSION": constants["SEGMENT_VERSION"], "CREATOR_PID": 1234,
                      "CREATOR_START": 5678, "CREATOR_PIDNS": 42}
    assert struct.pack("<q", constants["SEGMENT_MAGIC"]) == b"arfuseSM"
    assert shm_layout.SegmentId.decode(data) == shm_layout.SegmentId(
        constants["SEGMENT_VERSION"], 1234, 5678, 42)
    assert shm_layout.SegmentId.decode(bytes(len(data))) is None  # no magic: not a segment


@pytest.mark.parametrize("world", [1, 2, 3, 16])
@pytest.mark.parametrize(("max_tokens", "hidden", "elem"), [(1, 1, 2), (7, 37, 4),
                                                            (2048, 4096, 2), (130, 1040, 2)])
def test_slot_geometry_is_the_python_one(world: int, max_tokens: int, hidden: int,
                                         elem: int) -> None:
    geometry = kernel().slot_geometry(world, max_tokens, hidden, elem)
    layout = shm_layout.ShmLayout(world, max_tokens, hidden, elem)
    for name, value in geometry.items():
        assert getattr(layout, name) == value, name


def sig(tokens: int, dtype: int, hidden: int, epilogue: str, quant: str | None = None,
        layout: str | None = None, twoshot: bool = False, op: int = 0,
        group_size: int = 0) -> tuple[int, int]:
    return signature.words(tokens, dtype, hidden, Pattern(epilogue, quant, layout).code,
                           twoshot, op, group_size=group_size)


def test_mismatch_messages_are_the_same_text_in_cpp_and_python() -> None:
    module = kernel()
    signatures = [
        [sig(1, 2, 64, "none"), sig(2, 2, 64, "none")],
        [sig(4, 0, 2048, "residual_rmsnorm", "nvfp4", "swizzled_128x4"),
         sig(4, 0, 2048, "rmsnorm", "nvfp4", "linear"),
         sig(4, 1, 2048, "residual_rmsnorm", "fp8")],
        [sig(0, 2, 7, "rmsnorm")] * 2,
        [sig(40, 2, 64, "none", twoshot=True, op=signature.MAX_OP),
         sig(40, 2, 64, "none", op=5)],
        [sig(4, 0, 64, "rmsnorm", "fp8_dynamic"), sig(4, 0, 64, "rmsnorm", "fp8")],
        [(0x7F << 32, 64), sig(1, 2, 64, "none")],  # a pattern code that is none
        [sig(4, 0, 1024, "rmsnorm", "fp8_group", "fp32", group_size=128),
         sig(4, 0, 1024, "rmsnorm", "fp8_group", "fp32", group_size=64),
         sig(4, 0, 1024, "rmsnorm", "fp8_group", "ue8m0_packed", group_size=128)],
    ]
    for call, found in enumerate(signatures, start=1):
        assert module.mismatch_message(call, found) == signature.mismatch_message(
            "shm", call, found)
        for words in found:
            assert module.describe_signature(*words) == signature.describe(*words)
    text = signature.mismatch_message("shm", 3, signatures[1])
    assert "they differ in dtype, pattern, quant, layout;" in text
    assert "rank 0: tokens=4 dtype=bf16 hidden=2048 pattern=norm+residual quant=nvfp4 " \
           "layout=swizzled_128x4 mode=oneshot op=0; rank 1:" in text
    text = signature.mismatch_message("shm", 4, signatures[3])
    assert "they differ in mode, op;" in text
    assert "rank 0: tokens=40 dtype=fp32 hidden=64 pattern=plain quant=none mode=twoshot " \
           f"op={signature.MAX_OP}; rank 1:" in text
    assert "quant=fp8_dynamic" in signature.describe(*signatures[4][0])
    text = signature.mismatch_message("shm", 7, signatures[6])
    assert "they differ in layout, group_size;" in text
    assert "quant=fp8_group layout=fp32 group_size=64 mode=oneshot" in text


# --- bad calls: the fast path declines exactly what call_checks refuses -------------------------

Build = Callable[[Comm], dict[str, Any]]


def _shared_weight(c: Comm) -> dict[str, Any]:
    """weight starts where x does (the kernel once compared data pointers, not spans)."""
    buf = torch.randn(c.tokens * c.hidden).to(c.dtype)
    x = buf.view(c.tokens, c.hidden)
    return {"x": x, "weight": buf[:c.hidden], "out": x}


def _other_buffer(c: Comm) -> dict[str, Any]:
    layout = shm_layout.ShmLayout(1, c.tokens + 2, c.hidden, c.dtype.itemsize)
    older = layout.slot_offset(0, 1) if c.comm.next_input_offset() == layout.slot_offset(0, 0) \
        else layout.slot_offset(0, 0)
    return {"x": c.view(older, c.tokens)}


def _result_slot(c: Comm) -> dict[str, Any]:
    layout = shm_layout.ShmLayout(1, c.tokens + 2, c.hidden, c.dtype.itemsize)
    return {"x": c.view(int(c.comm.next_input_offset()) + layout.input_bytes, 2)}


BAD: dict[str, tuple[str, Build]] = {
    # x
    "x not a tensor": ("fp32", lambda c: {"x": [1.0] * c.hidden}),
    "x 1-D": ("fp32", lambda c: {"x": torch.ones(c.hidden)}),
    "x 3-D": ("fp32", lambda c: {"x": torch.ones(1, c.tokens, c.hidden)}),
    "x dtype": ("fp32", lambda c: {"x": torch.ones(c.tokens, c.hidden, dtype=torch.float64)}),
    "x hidden": ("fp32", lambda c: {"x": torch.ones(c.tokens, c.hidden + 1)}),
    "x not contiguous": ("fp32", lambda c: {"x": torch.ones(c.hidden, c.tokens).t()}),
    # residual, weight
    "residual without weight": ("fp32", lambda c: {"x": c.x(), "residual": c.x()}),
    "residual not a tensor": ("fp32", lambda c: {"x": c.x(), "residual": 1.0, "weight": c.w()}),
    "residual shape": ("fp32", lambda c: {"x": c.x(), "residual": c.x(c.tokens - 1),
                                          "weight": c.w()}),
    "residual dtype": ("fp32", lambda c: {"x": c.x(), "residual": c.x().double(),
                                          "weight": c.w()}),
    "residual not contiguous": ("fp32", lambda c: {
        "x": c.x(), "residual": torch.ones(c.hidden, c.tokens).t(), "weight": c.w()}),
    "weight not a tensor": ("fp32", lambda c: {"x": c.x(), "weight": [1.0] * c.hidden}),
    "weight shape": ("fp32", lambda c: {"x": c.x(), "weight": torch.ones(c.hidden + 1)}),
    "weight 2-D": ("fp32", lambda c: {"x": c.x(), "weight": torch.ones(1, c.hidden)}),
    "weight dtype": ("fp32", lambda c: {"x": c.x(), "weight": c.w().half()}),
    "weight not contiguous": ("fp32", lambda c: {"x": c.x(),
                                                 "weight": torch.ones(2 * c.hidden)[::2]}),
    # eps, weight_bias: finite in float32, eps > 0 after rounding to float32
    **{f"eps {v!r}": ("fp32", lambda c, v=v: {"x": c.x(), "weight": c.w(), "eps": v})
       for v in (0.0, -1e-6, float("nan"), float("inf"), 1e-46, 1.4e-45, 3.5e38, 10**39, True,
                 "1e-6", None)},
    **{f"weight_bias {v!r}": ("fp32", lambda c, v=v: {"x": c.x(), "weight": c.w(),
                                                       "weight_bias": v})
       for v in (float("inf"), float("-inf"), float("nan"), 3.5e38, -3.5e38, -(10**39), True,
                 "0", None)},
    # quant, scale, layout
    "quant name": ("fp32", lambda c: {"x": c.x(), "quant": "int8", "scale": 1.0}),
    "quant not a string": ("fp32", lambda c: {"x": c.x(), "quant": 1, "scale": 1.0}),
    "quant bytes": ("fp32", lambda c: {"x": c.x(), "quant": b"fp8", "scale": 1.0}),
    "fp8 without scale": ("fp32", lambda c: {"x": c.x(), "quant": "fp8"}),
    **{f"fp8 scale {v!r}": ("fp32", lambda c, v=v: {"x": c.x(), "quant": "fp8", "scale": v})
       for v in (0.0, -0.5, float("nan"), float("inf"), 1e-39, 2.9e-39, 3.5e38, True, "0.5",
                 torch.tensor([0.5, 0.5]))},
    "nvfp4 on fp32": ("fp32", lambda c: {"x": c.x(), "quant": "nvfp4", "scale": 1.0}),
    "nvfp4 hidden 40": ("bf16-40", lambda c: {"x": c.x(), "quant": "nvfp4", "scale": 1.0}),
    **{f"nvfp4 scale {v!r}": ("bf16", lambda c, v=v: {"x": c.x(), "quant": "nvfp4", "scale": v})
       for v in (0.0, 1e-46, 1.4e-45, 3.5e38, float("inf"), float("nan"), -1.0)},
    "nvfp4 layout": ("bf16", lambda c: {"x": c.x(), "quant": "nvfp4", "scale": 1.0,
                                        "layout": "rowmajor"}),
    "nvfp4 layout int": ("bf16", lambda c: {"x": c.x(), "quant": "nvfp4", "scale": 1.0,
                                            "layout": 1}),
    "fp8_group layout": ("bf16", lambda c: {"x": c.x(), "quant": "fp8_group",
                                            "layout": "linear"}),
    "fp8_group scale": ("bf16", lambda c: {"x": c.x(), "quant": "fp8_group", "scale": 1.0}),
    **{f"fp8_group group_size {g!r}": ("bf16-256", lambda c, g=g: {
        "x": c.x(), "quant": "fp8_group", "layout": "ue8m0_packed", "group_size": g})
       for g in (96, 256, 16, 0, -32, True, 32.0, "32")},
    "fp8_group hidden 40": ("bf16-40", lambda c: {"x": c.x(), "quant": "fp8_group"}),
    "fp8_group default 128 on hidden 64": ("bf16", lambda c: {"x": c.x(), "quant": "fp8_group"}),
    "fp8_group 64 not dividing hidden 96": ("fp32-96", lambda c: {
        "x": c.x(), "quant": "fp8_group", "group_size": 64}),
    "group_size without fp8_group": ("bf16", lambda c: {"x": c.x(), "quant": "fp8_dynamic",
                                                        "group_size": 128}),
    "group_size without quant": ("bf16", lambda c: {"x": c.x(), "group_size": 128}),
    # inputs in the shared segment
    "x offset view of input_buffer": ("fp32", lambda c: {"x": c.slot(c.tokens + 1)[1:]}),
    "x offset view, two-shot": ("fp32-twoshot", lambda c: {"x": c.slot(c.tokens + 1)[1:]}),
    "x in the other buffer's slot": ("fp32", _other_buffer),
    "x in the result slot": ("fp32", _result_slot),
    "x in the header": ("fp32", lambda c: {"x": c.view(0, 2)}),
    "residual in input_buffer": ("fp32", lambda c: {"x": c.x(), "residual": c.slot(c.tokens),
                                                    "weight": c.w()}),
    "weight in input_buffer": ("fp32", lambda c: {"x": c.x(), "weight": c.slot(1)[0]}),
    "residual in the header": ("fp32", lambda c: {"x": c.x(), "residual": c.view(0, c.tokens),
                                                  "weight": c.w()}),
    # outputs
    "out not a tensor": ("fp32", lambda c: {"x": c.x(), "out": 1.0}),
    "out shape": ("fp32", lambda c: {"x": c.x(), "out": torch.empty(c.tokens - 1, c.hidden)}),
    "out dtype": ("fp32", lambda c: {"x": c.x(), "out": c.x().double()}),
    "out not contiguous": ("fp32", lambda c: {"x": c.x(),
                                              "out": torch.empty(c.hidden, c.tokens).t()}),
    "out requires grad": ("fp32", lambda c: {"x": c.x(),
                                             "out": torch.empty(c.tokens, c.hidden,
                                                                requires_grad=True)}),
    "residual_out requires grad": ("fp32", lambda c: {
        "x": c.x(), "weight": c.w(),
        "residual_out": torch.empty(c.tokens, c.hidden, requires_grad=True)}),
    "x requiring grad, out=x": ("fp32", lambda c: (lambda x: {"x": x, "out": x})(
        c.x().requires_grad_())),
    "out in input_buffer": ("fp32", lambda c: {"x": c.x(), "out": c.slot(c.tokens)}),
    "slot input, out=x": ("fp32", lambda c: (lambda s: {"x": s, "out": s})(c.slot(c.tokens))),
    "residual_out in input_buffer": ("fp32", lambda c: {"x": c.x(), "weight": c.w(),
                                                        "residual_out": c.slot(c.tokens)}),
    "out partly x": ("fp32", lambda c: (lambda big: {"x": big[:c.tokens],
                                                     "out": big[2:c.tokens + 2]})(
        torch.ones(c.tokens + 2, c.hidden))),
    "out is residual": ("fp32", lambda c: (lambda r: {"x": c.x(), "residual": r,
                                                      "weight": c.w(), "out": r})(c.x())),
    "out over weight": ("fp32", lambda c: (lambda buf: {
        "x": c.x(), "weight": buf[:c.hidden], "out": buf.view(c.tokens, c.hidden)})(
        torch.ones(c.tokens * c.hidden))),
    "out=x, weight starts at x": ("fp32", _shared_weight),
    "residual_out without weight": ("fp32", lambda c: {"x": c.x(),
                                                       "residual_out": torch.empty_like(c.x())}),
    "residual_out is x": ("fp32", lambda c: (lambda x: {"x": x, "residual": c.x(),
                                                        "weight": c.w(), "residual_out": x})(
        c.x())),
    "residual_out partly residual": ("fp32", lambda c: (lambda big: {
        "x": c.x(), "residual": big[:c.tokens], "weight": c.w(),
        "residual_out": big[1:c.tokens + 1]})(torch.ones(c.tokens + 1, c.hidden))),
    "out and residual_out same": ("fp32", lambda c: (lambda o: {
        "x": c.x(), "residual": c.x(), "weight": c.w(), "out": o, "residual_out": o})(
        torch.empty(c.tokens, c.hidden))),
    # tensors whose memory does not hold their values as they read, complex x, meta numbers
    **{name: ("fp32", lambda c, name=name: bad_tensor_calls(c.tokens, c.hidden, c.dtype)[name])
       for name in bad_tensor_calls(2, 16, torch.float32)},
}

COMMS: dict[str, Callable[[], Comm]] = {
    "fp32": lambda: private_comm(),
    "fp32-twoshot": lambda: private_comm(oneshot_max_bytes=-1),
    "bf16": lambda: private_comm(torch.bfloat16),
    "bf16-40": lambda: private_comm(torch.bfloat16, hidden=40),
    "bf16-256": lambda: private_comm(torch.bfloat16, hidden=256),
    "fp32-96": lambda: private_comm(hidden=96),
}


@pytest.fixture(scope="module")
def comms() -> dict[str, Comm]:
    return {name: make() for name, make in COMMS.items()}


def test_the_table_has_working_comms(comms: dict[str, Comm]) -> None:
    """A good call runs on every comm of the table (so a None below means declined)."""
    for c in comms.values():
        result = fast(c, {"x": c.x(), "weight": c.w(), "residual": c.x()})
        assert isinstance(result, FusedOutput) and result.residual_out is not None


@pytest.mark.parametrize("name", list(BAD))
def test_fast_path_declines_what_call_checks_refuses(comms: dict[str, Comm], name: str) -> None:
    comm_name, build = BAD[name]
    c = comms[comm_name]
    call = build(c)
    with pytest.raises((ValueError, TypeError)):
        checked(c, call)
    assert fast(c, call) is None, f"{name}: the kernel ran a call that call_checks refuses"


def run_args(c: Comm, call: dict[str, Any]) -> list[Any] | None:
    """The call as ``ShmComm.run`` takes it, or None when its types do not fit run's."""
    merged = {**DEFAULTS, **call}
    tensors = ("residual", "weight", "out", "residual_out")
    if not isinstance(merged["x"], torch.Tensor) or not all(
            merged[n] is None or isinstance(merged[n], torch.Tensor) for n in tensors):
        return None
    numbers = [merged["eps"], merged["weight_bias"],
               0.0 if merged["scale"] is None else merged["scale"]]
    if any(isinstance(v, bool) or not isinstance(v, float | int) for v in numbers):
        return None
    if merged["quant"] not in QUANTS or merged["layout"] not in shm_layout_names():
        return None
    group = call.get("group_size")
    if group is None:
        group = 128 if merged["quant"] == "fp8_group" else 0
    if isinstance(group, bool) or not isinstance(group, int):
        return None
    try:
        code = output_code(merged["quant"], merged["layout"])
    except ValueError:  # a layout of another quant: the code of none names it in no way
        return None
    return [merged["x"], merged["residual"], merged["weight"], float(numbers[0]),
            float(numbers[1]), code, float(numbers[2]), merged["out"], merged["residual_out"],
            0, 0, group]


def shm_layout_names() -> tuple[str, ...]:
    return tuple(o.layout for o in QUANT_OUTPUTS if o.layout)


def test_run_refuses_what_call_checks_refuses(comms: dict[str, Comm]) -> None:
    checked_names = []
    for name, (comm_name, build) in BAD.items():
        c = comms[comm_name]
        args = run_args(c, build(c))
        if args is None:  # not in run()'s types: pybind refuses it (TypeError)
            continue
        with pytest.raises(ValueError):
            c.comm.run(*args)
        checked_names.append(name)
    assert len(checked_names) >= 60, checked_names


GOOD: dict[str, tuple[str, Build]] = {
    "eps = smallest fp32": ("fp32", lambda c: {"x": c.x(), "weight": c.w(), "eps": FP32_TINY}),
    "eps = FLT_MAX": ("fp32", lambda c: {"x": c.x(), "weight": c.w(), "eps": FP32_MAX}),
    "eps as int": ("fp32", lambda c: {"x": c.x(), "weight": c.w(), "eps": 1}),
    "weight_bias = FLT_MAX": ("fp32", lambda c: {"x": c.x(), "weight": c.w(),
                                                 "weight_bias": FP32_MAX}),
    "weight_bias = -FLT_MAX": ("fp32", lambda c: {"x": c.x(), "weight": c.w(),
                                                  "weight_bias": -FP32_MAX}),
    "fp8 scale = 1 / FLT_MAX": ("fp32", lambda c: {"x": c.x(), "quant": "fp8",
                                                   "scale": 1.0 / FP32_MAX}),
    "fp8 scale = FLT_MAX": ("fp32", lambda c: {"x": c.x(), "quant": "fp8", "scale": FP32_MAX}),
    "nvfp4 scale = smallest fp32": ("bf16", lambda c: {"x": c.x(), "quant": "nvfp4",
                                                       "scale": FP32_TINY}),
    "nvfp4 scale = FLT_MAX": ("bf16", lambda c: {"x": c.x(), "quant": "nvfp4",
                                                 "scale": FP32_MAX, "layout": "linear"}),
    "quant 'none'": ("fp32", lambda c: {"x": c.x(), "quant": "none"}),
    "nvfp4 layout None": ("bf16", lambda c: {"x": c.x(), "quant": "nvfp4", "scale": 1.0,
                                             "layout": None}),
    **{f"fp8_group {layout} {g}": ("bf16-256", lambda c, layout=layout, g=g: {
        "x": c.x(), "weight": c.w(), "quant": "fp8_group", "layout": layout, "group_size": g})
       for layout in ("fp32", "fp32_column_major", "ue8m0_packed") for g in (32, 64, 128)},
    "fp8_group defaults": ("fp32-96", lambda c: {"x": c.x(), "quant": "fp8_group",
                                                 "layout": None, "group_size": 32}),
    "plain, eps ignored": ("fp32", lambda c: {"x": c.x(), "eps": "anything"}),
    "in place": ("fp32", lambda c: (lambda x, r: {"x": x, "residual": r, "weight": c.w(),
                                                  "out": x, "residual_out": r})(c.x(), c.x())),
    "x in input_buffer": ("fp32", lambda c: {"x": c.slot(c.tokens), "weight": c.w()}),
    "x in input_buffer, two-shot": ("fp32-twoshot", lambda c: {"x": c.slot(c.tokens)}),
}


@pytest.mark.parametrize("name", list(GOOD))
def test_fast_path_accepts_the_boundaries_call_checks_accepts(comms: dict[str, Comm],
                                                              name: str) -> None:
    comm_name, build = GOOD[name]
    c = comms[comm_name]
    call = build(c)
    checked(c, call)
    assert isinstance(fast(c, call), FusedOutput), name


# --- the torch backend's fast path: the same rules, without shared memory ----------------------

CALL_FIELDS = ("x", "residual", "weight", "eps", "weight_bias", "quant", "scale", "layout",
               "out", "residual_out", "op", "group_size", "moe")


@pytest.mark.parametrize("name", [*BAD, *GOOD])
def test_torch_backend_checks_make_what_call_checks_makes(comms: dict[str, Comm],
                                                          name: str) -> None:
    """Every call of both tables on a workspace without shared memory (the torch backend's):
    where check_call raises, the kernel's checks decline; where it accepts (the segment's
    rules do not apply here), they make the same CallArgs, field for field."""
    comm_name, build = {**BAD, **GOOD}[name]
    c = comms[comm_name]
    call = build(c)
    try:
        expected = check_call(c.shape, *full(call), None, None, 7, call.get("group_size"))
    except (ValueError, TypeError):
        expected = None
    got = torch_workspace.kernel_checked(kernel(), c.hidden, DTYPE[c.dtype][0], *full(call), 7,
                                         call.get("group_size"))
    if expected is None:
        assert got is None, f"{name}: the torch backend's checks took a call check_call refuses"
        return
    assert got is not None, f"{name}: declined a call check_call accepts"
    for field in CALL_FIELDS:
        want, have = getattr(expected, field), getattr(got, field)
        if isinstance(want, torch.Tensor) or want is None:
            assert have is want, f"{name}: {field}"
        else:
            assert type(have) is type(want) and have == want, f"{name}: {field} {have!r}"


# --- the torch operator ----------------------------------------------------------------------

def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


OP_CASES = [
    ("plain", torch.float32, {}),
    ("norm", torch.float32, {"weight": True}),
    ("residual", torch.bfloat16, {"weight": True, "residual": True}),
    ("fp8", torch.float16, {"weight": True, "residual": True, "quant": "fp8", "scale": 0.5}),
    ("nvfp4", torch.bfloat16, {"weight": True, "quant": "nvfp4", "scale": 37.5,
                               "layout": "linear"}),
    ("nvfp4 swizzled", torch.bfloat16, {"weight": True, "residual": True, "quant": "nvfp4",
                                        "scale": 448.0}),
]


def op_inputs(c: Comm, spec: dict[str, Any]) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(3)
    call: dict[str, Any] = {"x": (torch.randn(c.tokens, c.hidden, generator=gen) * 3).to(c.dtype)}
    if spec.get("weight"):
        call["weight"] = (torch.rand(c.hidden, generator=gen) + 0.5).to(c.dtype)
    if spec.get("residual"):
        call["residual"] = torch.randn(c.tokens, c.hidden, generator=gen).to(c.dtype)
    for key in ("quant", "scale", "layout"):
        if key in spec:
            call[key] = spec[key]
    return call


def op_args(c: Comm, call: dict[str, Any]) -> list[Any]:
    merged = {**DEFAULTS, **call}
    return [int(c.comm.handle), merged["x"], merged["residual"], merged["weight"],
            merged["eps"], merged["weight_bias"], output_code(merged["quant"], merged["layout"]),
            merged["scale"] or 0.0]


def expected_list(result: FusedOutput) -> list[torch.Tensor]:
    return [t for t in result if t is not None]


@pytest.mark.parametrize(("name", "dtype", "spec"), OP_CASES, ids=[c[0] for c in OP_CASES])
def test_torch_op_gives_the_fast_path_bits(name: str, dtype: torch.dtype,
                                           spec: dict[str, Any]) -> None:
    c = private_comm(dtype, hidden=80 if dtype == torch.float32 else 64, tokens=5)
    call = op_inputs(c, spec)
    expected = expected_list(fast(c, call))
    got = torch.ops.arfuse.shm_fused_allreduce(*op_args(c, call), None, None)
    functional = torch.ops.arfuse.shm_fused_allreduce_functional(*op_args(c, call))
    for outputs in (got, functional):
        assert len(outputs) == len(expected)
        for a, b in zip(outputs, expected, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(bits(a), bits(b)), name
    if "weight" in call:  # in place, through the mutable schema
        x, residual = call["x"].clone(), (call.get("residual") if "residual" in call
                                          else None)
        residual = residual.clone() if residual is not None else None
        args = op_args(c, {**call, "x": x, "residual": residual})
        outputs = torch.ops.arfuse.shm_fused_allreduce(*args, x, residual)
        assert outputs[0].data_ptr() == x.data_ptr()
        assert torch.equal(bits(x), bits(expected[0]))
        if residual is not None:
            assert outputs[1].data_ptr() == residual.data_ptr()
            assert torch.equal(bits(residual), bits(expected[1]))


def test_torch_op_refuses_bad_arguments_and_unknown_handles() -> None:
    c = private_comm()
    x = c.x()
    with pytest.raises(ValueError, match="eps"):
        torch.ops.arfuse.shm_fused_allreduce(int(c.comm.handle), x, None, c.w(), 0.0, 0.0, 0,
                                             0.0, None, None)
    with pytest.raises(ValueError, match="input_buffer"):
        torch.ops.arfuse.shm_fused_allreduce(int(c.comm.handle), c.slot(c.tokens + 1)[1:],
                                             None, None, 1e-6, 0.0, 0, 0.0, None, None)
    with pytest.raises(ValueError, match="handle"):
        torch.ops.arfuse.shm_fused_allreduce(-5, x, None, None, 1e-6, 0.0, 0, 0.0, None,
                                             None)
    from arfuse.errors import WorkspaceBroken

    c.comm.invalidate("destroyed in a test")
    with pytest.raises(WorkspaceBroken, match="destroyed in a test"):
        torch.ops.arfuse.shm_fused_allreduce(int(c.comm.handle), x, None, None, 1e-6, 0.0, 0,
                                             0.0, None, None)


def test_torch_op_traces_under_torch_compile() -> None:
    c = private_comm(torch.bfloat16, hidden=64, tokens=5)
    call = op_inputs(c, OP_CASES[5][2])
    handle = int(c.comm.handle)
    _h, x, residual, weight, eps, bias, quant, scale = op_args(c, call)

    def mutable(x: torch.Tensor, residual: torch.Tensor,
                weight: torch.Tensor) -> list[torch.Tensor]:
        outs = torch.ops.arfuse.shm_fused_allreduce(handle, x, residual, weight, eps, bias,
                                                    quant, scale, None, None)
        return [outs[0] * 2, *outs[1:]]

    def functional(x: torch.Tensor, residual: torch.Tensor,
                   weight: torch.Tensor) -> list[torch.Tensor]:
        outs = torch.ops.arfuse.shm_fused_allreduce_functional(handle, x, residual, weight, eps,
                                                               bias, quant, scale)
        return [outs[0] * 2, *outs[1:]]

    expected = mutable(x, residual, weight)
    for fn, backend in ((mutable, "eager"), (functional, "eager"), (functional, "aot_eager")):
        torch._dynamo.reset()
        got = torch.compile(fn, backend=backend, fullgraph=True)(x, residual, weight)
        assert len(got) == len(expected) == 4
        for a, b in zip(got, expected, strict=True):
            assert torch.equal(bits(a), bits(b)), (fn.__name__, backend)
    torch._dynamo.reset()


# --- real ranks ------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["oneshot", "twoshot"])
def test_inputs_inside_the_segment_raise_instead_of_corrupting_rows(mode: str) -> None:
    """x = input_buffer(T + 1)[1:] used to corrupt a row per rank at T=65 and 130 in two-shot
    mode, and a residual inside input_buffer() was overwritten by the copy of x."""
    for errors in values(run_ranks(ranks_calls.offset_views, 2, mode, timeout=60)):
        for name, error in errors.items():
            if name.startswith("after"):
                assert error == "True", (name, errors)
            else:
                assert error.startswith("ValueError:") and "shared segment" in error, (name,
                                                                                     error)


def test_the_kernel_and_python_judge_a_peer_alive_by_the_same_rule() -> None:
    """``process_alive`` (the kernel's wait) and ``segment.alive`` (the pure-torch path's)
    on a live process, its reused-pid form (another start time), a zombie and a reaped one."""
    import os
    import subprocess
    import time

    from arfuse.backends.shm import segment

    module = kernel()
    pid, start = segment.process_identity()
    cases = {"this process": (pid, start), "another start": (pid, start + 1),
             "no such pid": (2**22 + 7, start)}
    child = subprocess.Popen(["true"])
    try:
        child_start = segment.process_identity(child.pid)[1]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # exited, not reaped: a zombie
            if os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG):
                break
            time.sleep(0.01)
        cases["zombie"] = (child.pid, child_start)
        judged = {name: (module.diagnostics.process_alive(*ids), segment.alive(*ids))
                  for name, ids in cases.items()}
    finally:
        child.wait()
    judged["reaped"] = (module.diagnostics.process_alive(child.pid, child_start),
                        segment.alive(child.pid, child_start))
    assert judged == {"this process": (True, True), "another start": (False, False),
                      "no such pid": (False, False), "zombie": (False, False),
                      "reaped": (False, False)}, judged
    look = ctables.float_constant("liveness.h", "kLookS", shm_build.CSRC)
    assert segment.LIVENESS_LOOK_S == look > 0
