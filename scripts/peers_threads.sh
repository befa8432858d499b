#!/usr/bin/env bash
# arfuse's fused call beside vLLM's and SGLang's CPU kernels at 1, 2, 4 and 8 threads per rank
# (benchmarks/peers.py --threads; each rank pinned to that many cores where the machine has
# them: 16 cores for 8), one report per thread count under out/peers-threads/. The peers'
# sources are read from PEER_SRC (default out/peer-src: vllm/ and sglang/, extracted as
# benchmarks/peers.py's docstring says), so a machine without a network can run it.
#
#   scripts/peers_threads.sh                   # THREADS="1 2 4 8" RUNS=2 by default
#   THREADS="1 2" RUNS=3 scripts/peers_threads.sh
set -euo pipefail
cd "$(dirname "$0")/.."
src=${PEER_SRC:-out/peer-src}
python=.venv/bin/python
if [ ! -x "$python" ]; then
  python=${PYTHON:-python3}
  "$python" -m pip install -q --no-deps -e . 2>&1 | grep -v "is ignored" || true
fi
sglang=()
[ -d "$src/sglang" ] && sglang=(--sglang-src "$src/sglang")
for threads in ${THREADS:-1 2 4 8}; do
  "$python" benchmarks/peers.py --vllm-src "$src/vllm" "${sglang[@]}" --threads "$threads" \
    --runs "${RUNS:-2}" --modes --out "out/peers-threads/threads$threads"
done
