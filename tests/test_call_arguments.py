"""Each argument of an op or of a call is checked before any collective step: a value fp32
cannot carry, a number that is no number, a tensor on another device or without plain values,
a destination that requires grad. Each is a ValueError or TypeError naming the argument, in
one process and on every rank of a real group; values at the edge of fp32 are accepted."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import arfuse
from arfuse.arg_checks import OpShape
from arfuse.call_checks import check_call

import ranks_calls
from harness import run_ranks, values

SHAPE = OpShape(hidden=16, dtype=torch.float32, dtype_name="fp32", device=torch.device("cpu"))


def check(**kwargs: object) -> object:
    args = {"x": torch.ones(2, 16), "residual": None, "weight": torch.ones(16), "eps": 1e-6,
            "weight_bias": 0.0, "quant": None, "scale": None, "layout": "swizzled_128x4",
            "out": None, "residual_out": None, "shared": None, "slot_start": None}
    args.update(kwargs)
    return check_call(SHAPE, **args)  # type: ignore[arg-type]


@pytest.mark.parametrize("device", ["cuda:0", "cuda:1"])
def test_x_on_another_device_than_the_workspace_is_refused(device: str) -> None:
    """The workspace's device with its index: x on cuda:1 for a workspace on cuda:0 was let
    through when only the device type was compared (here: the CPU against a CUDA shape)."""
    from dataclasses import replace

    with pytest.raises(ValueError, match=f"x is on cpu; this op's workspace is on {device}"):
        check_call(replace(SHAPE, device=torch.device(device)), torch.ones(2, 16), None,
                   torch.ones(16), 1e-6, 0.0, None, None, "linear", None, None, None, None)


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"eps": 1e39}, "eps"), ({"eps": 1e-50}, "eps"), ({"eps": float("inf")}, "eps"),
    ({"eps": 10**400}, "eps"), ({"weight_bias": 1e39}, "weight_bias"),
    ({"weight_bias": -(10**400)}, "weight_bias"), ({"weight_bias": float("nan")}, "weight_bias"),
    ({"quant": "fp8", "scale": 1e-300}, "scale"), ({"quant": "fp8", "scale": 1e39}, "scale"),
    ({"quant": "fp8", "scale": 1e-39}, "scale"), ({"quant": "fp8", "scale": 10**400}, "scale"),
])
def test_values_outside_fp32_are_refused_naming_the_argument(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        check(**kwargs)


def test_values_at_the_edge_of_fp32_are_accepted_and_compute_finite_results() -> None:
    comm = arfuse.FusedAllReduce(max_token_num=4, hidden_dim=16, dtype=torch.float32)
    zero = torch.zeros(2, 16)
    out = comm(zero, weight=torch.ones(16), eps=1.5e-45).out  # subnormal eps: still > 0
    assert torch.equal(out, zero)  # not NaN (0 * rsqrt(eps) with eps > 0)
    big = comm(torch.ones(2, 16), weight=torch.ones(16), eps=3e38).out
    assert torch.all(torch.isfinite(big)) and torch.all(big > 0)
    q = comm(torch.ones(2, 16), weight=torch.ones(16), quant="fp8", scale=3e-39).quant_out
    assert q is not None and not torch.any(torch.isnan(q.float()))
    comm.close()


@pytest.mark.parametrize("eps", [np.float32(1e-5), np.float64(1e-5), np.int64(1),
                                 torch.tensor(1e-5), torch.tensor([1e-5])])
def test_numpy_and_tensor_scalars_are_numbers(eps: object) -> None:
    call = check(eps=eps, weight_bias=np.float32(0.5))
    assert isinstance(call.eps, float) and isinstance(call.weight_bias, float)  # type: ignore[attr-defined]


@pytest.mark.parametrize("eps", [True, np.bool_(True), "1e-5", torch.tensor(True), [1e-5]])
def test_non_numbers_are_type_errors(eps: object) -> None:
    with pytest.raises(TypeError, match="eps"):
        check(eps=eps)


@pytest.mark.parametrize(("tokens", "error"), [(-1, ValueError), (1.5, TypeError),
                                               ("4", TypeError), (True, TypeError)])
def test_input_buffer_arguments(tokens: object, error: type[Exception]) -> None:
    comm = arfuse.FusedAllReduce(max_token_num=4, hidden_dim=16, dtype=torch.float32)
    with pytest.raises(error, match="tokens"):
        comm.input_buffer(tokens)  # type: ignore[arg-type]
    comm.close()


def test_group_and_device_arguments_name_themselves() -> None:
    with pytest.raises(TypeError, match="group must be a torch"):
        arfuse.FusedAllReduce("abc", max_token_num=4, hidden_dim=16)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cuda'"):
            arfuse.FusedAllReduce(max_token_num=4, hidden_dim=16, device="cuda")


def test_a_timeout_beyond_float_is_a_value_error_naming_it() -> None:
    from arfuse import settings

    with pytest.raises(ValueError, match="timeout_s"):  # was OverflowError
        settings.load(timeout_s=10**400)


@pytest.mark.parametrize("backend", ["torch", "shm"])
def test_out_requiring_grad_is_refused_on_every_backend(backend: str) -> None:
    for result in values(run_ranks(ranks_calls.requires_grad_destination, 2, backend)):
        assert result["type"] == "ValueError" and "requires grad" in result["error"], result
        assert result["version"] == 0 and result["then_works"], result


def test_the_torch_operators_fake_names_x_for_a_0d_input() -> None:
    """torch.compile's fake of the shm operator refuses a 0-d x as the kernel does."""
    from arfuse.backends.shm import build as shm_build

    if shm_build.load() is None:
        pytest.skip(f"no compiled kernel: {shm_build.why_not()}")
    x = torch.empty((), device="meta", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"x must be 2-D \[tokens, hidden\]"):
        torch.ops.arfuse.shm_fused_allreduce(1, x, None, None, 1e-6, 0.0, 0, 0.0, None,
                                             None)


BAD_TENSOR_CALLS = ranks_calls.bad_tensor_calls(2, 16, torch.float32)


@pytest.mark.parametrize("name", list(BAD_TENSOR_CALLS))
def test_a_tensor_argument_without_plain_values_is_an_error_naming_it(name: str) -> None:
    """Sparse, nested, meta or quantized tensors, lazily negated or conjugated views, complex x
    and meta numbers: torch-internal RuntimeErrors, misleading advice ("call .contiguous()")
    or, for a negated view, a result from its raw memory. One process: the torch backend."""
    comm = arfuse.FusedAllReduce(max_token_num=4, hidden_dim=16, dtype=torch.float32)
    try:
        with pytest.raises((ValueError, TypeError)) as info:
            comm(**ranks_calls.bad_tensor_calls(2, 16, torch.float32)[name])
        assert ranks_calls.argument_named(name) in str(info.value), info.value
    finally:
        comm.close()


@pytest.mark.parametrize("backend", ["torch", "shm"])
def test_tensor_arguments_without_plain_values_are_errors_on_a_real_group(backend: str) -> None:
    """The same calls on two ranks: on shm they reach the kernel's fast path first, which must
    decline each so that the Python path raises the error that names the argument."""
    for errors in values(run_ranks(ranks_calls.bad_tensor_errors, 2, backend, timeout=120)):
        assert errors.pop("then") == {"works": True, "backend": backend}
        for name, error in errors.items():
            assert error["type"] in ("ValueError", "TypeError"), (name, error)
            assert ranks_calls.argument_named(name) in error["error"], (name, error)
