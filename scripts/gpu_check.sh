#!/usr/bin/env bash
# The checks for a lent GPU machine, as one prepared run (under 8 minutes): set up .venv with
# the `flashinfer` extra (keeping the machine's CUDA torch if it has one), then on every GPU:
# detection, FlashInfer's JIT build and the single-rank path (one GPU), every backend and
# pattern against a float64 reference, CUDA-graph capture and replay, the SGLang drop-in's rows
# (its resolver, workspaces, fused and plain calls and a graph capture, per flag and dtype, as
# SGLang's layers call them), and a latency table: fused and arfuse's torch backend against the
# user's two lines, NCCL all_reduce + residual add + F.rms_norm (two or more). Results:
# benchmarks/results/gpu-check-*.json and .txt.
#
#   scripts/gpu_check.sh                 # every GPU of this machine
#   NGPU=2 scripts/gpu_check.sh          # the first two
#   scripts/gpu_check.sh --device cpu    # the same steps on CPU ranks: checks the script itself
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    .venv/bin/pip install -q torch      # a CUDA build for the GPU machine
  else
    .venv/bin/pip install -q torch==2.13.0
  fi
fi
extras="test"
command -v nvidia-smi >/dev/null 2>&1 && extras="test,flashinfer"
.venv/bin/pip install -q -e ".[${extras}]" 2>&1 | grep -v "is ignored" || true
if [ "${1:-}" = "--device" ] && [ "${2:-}" = "cpu" ]; then
  exec timeout 480 .venv/bin/python benchmarks/gpu_check.py "$@"
fi
nvidia-smi -L || true
ngpu=${NGPU:-$(.venv/bin/python -c "import torch; print(torch.cuda.device_count())")}
.venv/bin/arfuse doctor --world-size "$ngpu" || true
export ARFUSE_LOG=${ARFUSE_LOG:-warning} ARFUSE_TIMEOUT_S=${ARFUSE_TIMEOUT_S:-60}
exec timeout 480 .venv/bin/torchrun --standalone --nproc-per-node "$ngpu" \
  benchmarks/gpu_check.py "$@"
