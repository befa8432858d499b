#!/usr/bin/env bash
# The FlashInfer contract (tests/contract/flashinfer_contract.py) against the REAL packages, one
# virtual environment per version, on a CPU machine: flashinfer-python, nvidia-cuda-runtime-cu12
# (libcudart.so.12, loaded before FlashInfer imports), triton, and arfuse from src/
# (PYTHONPATH). Torch (the CPU 2.13.0 build) and the other packages both need come from .venv
# through a .pth file, so torch is not installed once more per version. A venv is kept and
# reused while its stamp matches what it was built from. Needs .venv (scripts/setup.sh);
# MAIN_VENV to use another.
#
#   scripts/flashinfer_contract.sh                  # 0.6.13 and 0.7.2.post1 (the primary)
#   scripts/flashinfer_contract.sh 0.6.16.post4     # any versions, one venv each
#   ARFUSE_FI_REBUILD=1 scripts/flashinfer_contract.sh   # rebuild the venvs
#   ARFUSE_PREPARE_ONLY=1 scripts/flashinfer_contract.sh # build the venvs, run nothing
set -euo pipefail
cd "$(dirname "$0")/.."

versions=("$@")
if [ ${#versions[@]} -eq 0 ]; then
    versions=(0.6.13 0.7.2.post1)
fi
main_venv=$(cd "${MAIN_VENV:-.venv}" && pwd)
main_site=$("$main_venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
main_torch=$("$main_venv/bin/python" -c "import torch; print(torch.__version__.split('+')[0])")
started=$(date +%s)
failed=()

venv_dir() {  # 0.7.2.post1 -> .venv-fi-0.7.2 (the post release is the same code line)
    local short
    short=$(echo "$1" | sed -E 's/\.post[0-9]+$//')
    echo ".venv-fi-${short}"
}

build() {
    local version=$1 dir=$2
    local stamp="$dir/.arfuse-stamp"
    local want="flashinfer-python==$version on $main_site (torch $main_torch)"
    if [ "${ARFUSE_FI_REBUILD:-0}" != 1 ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]
    then
        return 0
    fi
    rm -rf "$dir"
    "$main_venv/bin/python" -m venv --without-pip "$dir"  # .venv's pip installs into it
    local site
    site=$("$dir/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    # after this venv's own packages: .venv's torch, numpy and the rest
    echo "import site; site.addsitedir('$main_site')" > "$site/arfuse-main-venv.pth"
    # triton: flashinfer.comm < 0.7 imports it at import time (CPU torch does not bring it).
    # pip sees .venv's packages as installed (torch pinned to .venv's own: a CUDA build is
    # gigabytes and useless here); what FlashInfer needs besides lands in this venv
    local log status=0
    log=$(mktemp)
    "$main_venv/bin/python" -m pip --python "$dir/bin/python" install -q --no-compile \
        --disable-pip-version-check "flashinfer-python==$version" nvidia-cuda-runtime-cu12 \
        triton "torch==$main_torch" >"$log" 2>&1 || status=$?
    grep -v "is ignored" "$log" || true
    rm -f "$log"
    [ "$status" -eq 0 ] || { echo "$dir: pip failed (exit $status)" >&2; return 1; }
    "$dir/bin/python" -c 'import sys, torch; sys.exit(torch.version.cuda is not None)' || {
        echo "$dir: the torch it imports is a CUDA build; .venv must hold the CPU one" >&2
        return 1
    }
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
    [ "${ARFUSE_PREPARE_ONLY:-0}" = 1 ] && continue
    if ! PYTHONPATH="$PWD/src" "$dir/bin/python" tests/contract/flashinfer_contract.py; then
        failed+=("$version")
    fi
done
echo "flashinfer contract: ${#versions[@]} version(s) in $(( $(date +%s) - started )) s"
if [ ${#failed[@]} -gt 0 ]; then
    echo "FAILED: ${failed[*]}" >&2
    exit 1
fi
