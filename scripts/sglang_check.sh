#!/usr/bin/env bash
# Check the SGLang drop-in against SGLang 0.5.23's real module on this machine (CPU only): build
# .venv-sglang (sglang 0.5.23 without its dependencies, and the few packages its import needs;
# torch 2.13.0 CPU and arfuse's own dependencies come from .venv through a .pth file, so torch
# is not installed twice), apply docs/sglang.md's patch to the installed
# flashinfer_comm_fusion.py, then on 2 and 4 real gloo ranks initialised through SGLang's own
# parallel_state call every function of the patched module, and of the unpatched one, as
# SGLang's callers do (scripts/sglang_check_ranks.py), for this machine and for ARFUSE_TOPOLOGY
# describing GPU nodes. Every answer must equal SGLang's, or docs/sglang.md's table where arfuse
# differs on purpose. Without a GPU no workspace can exist: every workspace function declines.
# Prints the differing rows and the times taken. Needs .venv (scripts/setup.sh); MAIN_VENV to
# use another. ARFUSE_PREPARE_ONLY=1 builds .venv-sglang and runs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
venv=${SGLANG_VENV:-.venv-sglang}
main_venv=$(cd "${MAIN_VENV:-.venv}" && pwd)
t0=$(date +%s.%N)

quiet_pip() {  # SGLang's own pins (torch 2.14.1, ...) are not wanted here: say nothing of them
  "$main_venv/bin/python" -m pip --python "$venv/bin/python" install -q --no-compile \
    --disable-pip-version-check --no-deps "$@" 2>&1 | grep -v "is ignored" || true
}

# --- the environment ---------------------------------------------------------------------------
# SGLang and what its import needs here that .venv lacks, pinned and installed without the
# resolver (torch, transformers, numpy, pydantic, pillow, psutil, anyio, httpx2 ... are .venv's;
# resolving took ~15 s of a cold run): triton, because sglang/srt/utils/common.py imports it
# unconditionally; apache-tvm-ffi, because parallel_state's GroupCoordinator imports SGLang's
# all-reduce kernels; the rest because the model configs and the callers' modules
# (models/beam.py reaches the OpenAI-compatible server's protocol) import them at module level
pkgs=(sglang==0.5.23 triton==3.9.0 apache-tvm-ffi==0.1.11
      orjson==3.13.0 pybase64==1.5.1 msgspec==0.23.0 pyzmq==27.3.0 starlette==1.10.0
      requests==2.34.2 certifi==2026.10.19.post1 charset-normalizer==3.5.3 urllib3==2.8.0
      aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 attrs==26.1.0 frozenlist==1.8.0
      multidict==7.2.1 propcache==0.5.4 yarl==1.25.1
      ipython==9.18.1 ipython_pygments_lexers==1.1.1 jedi==0.20.1 parso==0.8.7 pexpect==4.9.0
      ptyprocess==0.7.0 prompt_toolkit==3.0.53 wcwidth==0.9.4 stack-data==0.6.3
      asttokens==3.0.2 executing==2.3.0 pure_eval==0.2.4 traitlets==5.16.1
      matplotlib-inline==0.2.2
      dill==0.4.1 sentencepiece==0.2.3 compressed-tensors==0.20.1 loguru==0.7.3 gguf==0.19.0
      einops==0.8.2 openai==3.60.0 sniffio==1.3.1 partial-json-parser==0.2.1.1.post7)
stamp="$venv/.arfuse-sglang-check"
main_site=$("$main_venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
want="${pkgs[*]} on $main_site"
built=reused
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  built=built
  rm -rf "$venv"
  "$main_venv/bin/python" -m venv --without-pip "$venv"  # .venv's pip installs into it
  site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  # after this venv's own packages: torch, numpy, arfuse's dependencies
  echo "import site; site.addsitedir('$main_site')" > "$site/arfuse-main-venv.pth"
  quiet_pip "${pkgs[@]}"
  echo "$want" > "$stamp"
fi
"$venv/bin/python" - <<'PY'
import sys, torch
if not torch.__version__.startswith("2.13.0") or torch.version.cuda is not None:
    sys.exit(f"torch {torch.__version__} (CUDA {torch.version.cuda}) is not the CPU 2.13.0 build")
PY
t1=$(date +%s.%N)
if [ "${ARFUSE_PREPARE_ONLY:-0}" = 1 ]; then
  echo "$venv ready ($built)"
  exit 0
fi

# --- the patch -----------------------------------------------------------------------------------
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
target="$site/sglang/srt/layers/flashinfer_comm_fusion.py"
awk '/^```diff$/{f=1;next} /^```$/{if(f)exit} f' docs/sglang.md > "$work/arfuse-sglang.patch"
[ -s "$work/arfuse-sglang.patch" ] || { echo "no diff block in docs/sglang.md"; exit 1; }
if patch -p1 -d "$site" --forward --dry-run -s < "$work/arfuse-sglang.patch" >/dev/null; then
  cp "$target" "$work/sglang_fusion_original.py"
  patch -p1 -d "$site" --forward -s < "$work/arfuse-sglang.patch"
  echo "patched $target"
elif patch -p1 -d "$site" -R --dry-run -s < "$work/arfuse-sglang.patch" >/dev/null; then
  patch -s -R -o "$work/sglang_fusion_original.py" "$target" < "$work/arfuse-sglang.patch"
  echo "already patched: $target"
else
  echo "docs/sglang.md's patch applies neither way to $target (not SGLang 0.5.23's file?)"
  exit 1
fi
[ "$(sha256sum < "$work/sglang_fusion_original.py" | cut -d' ' -f1)" = \
  0a27d89d236e7431b458cf242e89b1bba85cb6707cfcbeedfba5b8d818cf32e5 ] \
  || { echo "the unpatched file is not SGLang 0.5.23's"; exit 1; }
t2=$(date +%s.%N)

# --- the check -----------------------------------------------------------------------------------
status=0
# the ranks' logs (SGLang's warnings, arfuse's) go to a file, shown on failure; scripts/ is on
# PYTHONPATH because the forkserver that preloads SGLang (Python 3.11's) ignores sys.path
PYTHONPATH="$root/src:$root/tests:$root/scripts" ARFUSE_SHM_PURE_TORCH=1 ARFUSE_TIMEOUT_S=20 \
  ARFUSE_LOG=warning timeout 420 "$venv/bin/python" scripts/sglang_check_ranks.py "$work" \
  "$root" 2> "$work/ranks.log" || { status=$?; tail -40 "$work/ranks.log"; }
t3=$(date +%s.%N)
awk -v a="$t0" -v b="$t1" -v c="$t2" -v d="$t3" -v e="$built" 'BEGIN {
  printf "times: environment %.1f s (%s), patch %.1f s, check %.1f s, total %.1f s\n",
         b - a, e, c - b, d - c, d - a }'
exit $status
