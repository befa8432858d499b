#!/usr/bin/env bash
# Set up, then run the main job on this machine's defaults: `arfuse run --world-size 2`
# (row-parallel layer + fused all-reduce + residual + RMSNorm, checked and timed).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/arfuse run --world-size 2 "$@"
