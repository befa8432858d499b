"""What users run without arfuse, as rows of ``arfuse bench``: the two lines they write
(torch's all-reduce on the group, then the residual added in place and torch's RMSNorm: the
baseline), and DeepSpeed's inference all-reduce with and without the same add + RMSNorm;
DeepSpeed's setup, build and cleanup; DeepSeek's per-token-group ``act_quant`` in eager torch."""

from __future__ import annotations

import contextlib
import glob
import os
from typing import Any

import torch

from .options import EPS
from .timing import Row


def rmsnorm_add(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What a layer runs after an unfused all-reduce: the residual added in place, then
    torch's RMSNorm of it."""
    residual.add_(x)
    return torch.nn.functional.rms_norm(residual, (x.shape[-1],), weight, EPS)


def act_quant(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's act_quant in eager torch with vLLM's eps clamp: e4m3 codes ``[T, H]`` and
    fp32 scales ``[T, H / group]``."""
    grouped = x.float().view(x.shape[0], x.shape[1] // group, group)
    scale = grouped.abs().amax(-1, keepdim=True).clamp(min=1e-10) / 448.0
    codes = (grouped / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return codes.view(x.shape), scale.squeeze(-1)


def _all_reduce(dist: Any, tensor: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(tensor)
    return tensor


def _ds_all_reduce(ds: Any, tensor: torch.Tensor) -> torch.Tensor:
    ds.inference_all_reduce(tensor)  # in place; the return value differs by path
    return tensor


def _then(after: Any, out: torch.Tensor) -> Any:
    return out if after is None else after(out)


def torch_row(work: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
              reset: Any, after: Any = None) -> Row:
    """``torch``: the user's two lines: torch's all-reduce of ``work`` in place on the group,
    then ``residual`` added in place and RMSNorm (and ``after``: the quantisation step, with
    ``--quant``); ``reset`` restores both."""
    import torch.distributed as dist

    return (lambda w_=work, r=residual, w=weight: _then(
        after, rmsnorm_add(_all_reduce(dist, w_), r, w)), reset)


def deepspeed_rows(ds: Any, work: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                   reset: Any, after: Any = None) -> dict[str, Row]:
    """``deepspeed`` (its all-reduce alone) and ``deepspeed+norm`` (with the add + RMSNorm,
    and ``after``, the quantisation step, with ``--quant``)."""
    return {"deepspeed": (lambda w_=work: ds.inference_all_reduce(w_), reset),
            "deepspeed+norm": (lambda w_=work, r=residual, w=weight: _then(
                after, rmsnorm_add(_ds_all_reduce(ds, w_), r, w)), reset)}


def deepspeed_setup(rank: int) -> tuple[Any, str]:
    """``deepspeed.comm`` over gloo, and a note on its version and shm kernel level (None and
    why, when DeepSpeed cannot be imported)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
        import deepspeed.comm as ds_dist
        from deepspeed.comm import comm as ds_comm
    except Exception as exc:
        return None, f"deepspeed not importable: {type(exc).__name__}: {exc}"
    # DeepSpeed's shm op reads LOCAL_SIZE (torchrun sets LOCAL_WORLD_SIZE) and crashes
    # without it
    os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE",
                                                       os.environ.get("WORLD_SIZE", "1")))
    deepspeed.init_distributed(dist_backend="gloo")
    level = getattr(ds_comm.cdb, "shm_vector_kernel_level", None)
    return ds_dist, f"deepspeed {deepspeed.__version__}, shm kernel level {level}"


def deepspeed_path(dtype: str, note: str) -> str:
    """DeepSpeed's CPU guard: fp32 needs kernel level 1 (AVX2), bf16/fp16 level 2 (AVX-512)."""
    try:
        level = int(note.rsplit(" ", 1)[-1])
    except ValueError:
        return "unknown"
    need = 1 if dtype == "fp32" else 2
    return "shm kernel" if level >= need else "gloo fallback (no AVX-512 for 16-bit here)"


def clean_deepspeed_segments() -> None:
    """DeepSpeed never unlinks its /dev/shm buffers; remove the ones of this run's port."""
    port = os.environ.get("MASTER_PORT", "")
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):
        with contextlib.suppress(OSError):
            os.unlink(path)


def prebuild_deepspeed() -> str:
    """Build DeepSpeed's shm op once before the ranks start (about a minute the first time);
    why it is unavailable ("" when it is available)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.accelerator import get_accelerator

        get_accelerator().create_op_builder("ShareMemCommBuilder").load(verbose=False)
    except Exception as exc:  # the bench then reports deepspeed as unavailable
        return f"{type(exc).__name__}: {exc}"
    return ""
