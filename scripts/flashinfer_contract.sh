#!/usr/bin/env bash
# The FlashInfer contract (tests/contract/flashinfer_contract.py) against the REAL packages, one
# virtual environment per version, on a CPU machine: CPU torch 2.13.0, flashinfer-python,
# nvidia-cuda-runtime-cu12 (libcudart.so.12, loaded before FlashInfer imports) and arfuse from
# src/ (PYTHONPATH). A venv is kept and reused while its stamp matches what it was built from.
#
#   scripts/flashinfer_contract.sh                  # 0.6.13 and 0.7.2.post1 (the primary)
#   scripts/flashinfer_contract.sh 0.6.16.post4     # any versions, one venv each
#   ARFUSE_FI_REBUILD=1 scripts/flashinfer_contract.sh   # rebuild the venvs
set -euo pipefail
cd "$(dirname "$0")/.."

versions=("$@")
if [ ${#versions[@]} -eq 0 ]; then
    versions=(0.6.13 0.7.2.post1)
fi
python=${ARFUSE_FI_PYTHON:-python3}
torch_req=${ARFUSE_FI_TORCH:-torch==2.13.0}
started=$(date +%s)
failed=()

venv_dir() {  # 0.7.2.post1 -> .venv-fi-0.7.2 (the post release is the same code line)
    local short
    short=$(echo "$1" | sed -E 's/\.post[0-9]+$//')
    echo ".venv-fi-${short}"
}

build() {
    local version=$1 dir=$2
    local stamp="$dir/.arfuse-stamp" want="flashinfer-python==$version $torch_req"
    if [ "${ARFUSE_FI_REBUILD:-0}" != 1 ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]
    then
        return 0
    fi
    rm -rf "$dir"
    "$python" -m venv "$dir"
    "$dir/bin/pip" install -q --disable-pip-version-check "$torch_req"
    # a CUDA build of torch is gigabytes and useless here: refuse it rather than carry on
    "$dir/bin/python" -c 'import sys, torch; sys.exit(torch.version.cuda is not None)' || {
        echo "$dir: pip installed a CUDA torch; give ARFUSE_FI_TORCH a CPU build" >&2
        return 1
    }
    # triton: flashinfer.comm < 0.7 imports it at import time (CPU torch does not bring it)
    "$dir/bin/pip" install -q --disable-pip-version-check "flashinfer-python==$version" \
        nvidia-cuda-runtime-cu12 triton "$torch_req"
    echo "$want" > "$stamp"
}

for version in "${versions[@]}"; do
    dir=$(venv_dir "$version")
    t0=$(date +%s)
    if ! build "$version" "$dir"; then
        failed+=("$version (venv)")
        continue
    fi
    t1=$(date +%s)
    echo "== flashinfer $version ($dir, ready in $((t1 - t0)) s)"
    if ! PYTHONPATH="$PWD/src" "$dir/bin/python" tests/contract/flashinfer_contract.py; then
        failed+=("$version")
    fi
done
echo "flashinfer contract: ${#versions[@]} version(s) in $(( $(date +%s) - started )) s"
if [ ${#failed[@]} -gt 0 ]; then
    echo "FAILED: ${failed[*]}" >&2
    exit 1
fi
