#!/usr/bin/env bash
# Set up .venv: PyTorch (the CPU build on this machine's disk, unless torch is already there),
# then arfuse itself, editable, with the test tools (transformers, accelerate and deepspeed
# among them). EXTRAS=bench: what `arfuse bench` needs (matplotlib, tqdm, deepspeed).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/pip install -q torch==2.13.0
fi
extras="test${EXTRAS:+,$EXTRAS}"
# pip's notes about index locations this machine lacks are noise; its failure is not
log=$(mktemp)
status=0
.venv/bin/pip install -q -e ".[${extras}]" >"$log" 2>&1 || status=$?
grep -v "is ignored" "$log" || true
rm -f "$log"
if [ "$status" -ne 0 ]; then
  echo "setup.sh: installing arfuse[${extras}] failed (pip exit $status)" >&2
  exit "$status"
fi
.venv/bin/python -c "import arfuse, torch; print(f'arfuse {arfuse.__version__}, torch {torch.__version__}')"
