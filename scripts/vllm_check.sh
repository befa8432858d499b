#!/usr/bin/env bash
# Check the vLLM drop-in against vLLM 0.33.0's real module on this machine (CPU only): build
# .venv-vllm (CPU torch 2.13.0, vllm 0.33.0 without its dependencies, flashinfer-python
# 0.7.2.post1, and the few packages their imports need), apply docs/vllm.md's patch to the
# installed flashinfer_all_reduce.py, then run vLLM's own resolver, getters, checkpoint and
# destroy functions, patched, on two real gloo ranks with ARFUSE_TOPOLOGY describing GPU nodes
# (one node, two nodes), and compare every answer with the unpatched module's on the same facts.
# Without a GPU no FlashInfer workspace can exist: every getter must return None (or raise
# vLLM's ValueError for trtllm across nodes) in both. Prints the table and the times taken.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
venv=${VLLM_VENV:-.venv-vllm}
python=${PYTHON:-python3}
t0=$(date +%s.%N)

quiet_pip() {  # vLLM's own pins (torch 2.14, ...) are not wanted here: say nothing of them
  "$venv/bin/pip" install -q "$@" 2>&1 | grep -v -e "is ignored" -e "^vllm 0.33.0 requires" \
    -e "^flashinfer-python 0.7.2.post1 requires" -e "dependency resolver does not" || true
}

# --- the environment ---------------------------------------------------------------------------
deps=(nvidia-cuda-runtime-cu12 psutil pyzmq regex pydantic cbor2 transformers aiohttp
      openai-harmony openai urllib3 requests                      # what vllm's imports need
      "apache-tvm-ffi>=0.1.11,<0.2" click einops ninja numpy tabulate tqdm nvidia-ml-py
      "cuda-python>=12,<13")                                      # what flashinfer.comm needs
stamp="$venv/.arfuse-vllm-check"
want="torch==2.13.0 vllm==0.33.0 flashinfer-python==0.7.2.post1 ${deps[*]}"
built=reused
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  built=built
  [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
  # this machine's local index has the CPU build; a bare `torch` would pull a CUDA one
  "$venv/bin/python" -c "import torch" 2>/dev/null || quiet_pip torch==2.13.0
  quiet_pip --no-deps vllm==0.33.0 flashinfer-python==0.7.2.post1
  quiet_pip "${deps[@]}"
  echo "$want" > "$stamp"
fi
"$venv/bin/python" - <<'EOF'
import sys, torch
if not torch.__version__.startswith("2.13.0") or torch.version.cuda is not None:
    sys.exit(f"torch {torch.__version__} (CUDA {torch.version.cuda}) is not the CPU 2.13.0 build")
EOF
t1=$(date +%s.%N)

# --- the patch -----------------------------------------------------------------------------------
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
target="$site/vllm/distributed/device_communicators/flashinfer_all_reduce.py"
awk '/^```diff$/{f=1;next} /^```$/{if(f)exit} f' docs/vllm.md > "$work/arfuse-vllm.patch"
[ -s "$work/arfuse-vllm.patch" ] || { echo "no diff block in docs/vllm.md"; exit 1; }
if patch -p1 -d "$site" --forward --dry-run -s < "$work/arfuse-vllm.patch" >/dev/null; then
  cp "$target" "$work/vllm_fi_ar_original.py"
  patch -p1 -d "$site" --forward -s < "$work/arfuse-vllm.patch"
  echo "patched $target"
elif patch -p1 -d "$site" -R --dry-run -s < "$work/arfuse-vllm.patch" >/dev/null; then
  patch -s -R -o "$work/vllm_fi_ar_original.py" "$target" < "$work/arfuse-vllm.patch"
  echo "already patched: $target"
else
  echo "docs/vllm.md's patch applies neither way to $target (not vLLM 0.33.0's file?)"; exit 1
fi
[ "$(sha256sum < "$work/vllm_fi_ar_original.py" | cut -d' ' -f1)" = \
  4925c48c149ae32e20b4d95fc67ffdda376c2729ea3b9cd488d03c66e077a783 ] \
  || { echo "the unpatched file is not vLLM 0.33.0's"; exit 1; }

# --- the check -----------------------------------------------------------------------------------
cat > "$work/vllm_check.py" <<'EOF'
"""vLLM 0.33.0's flashinfer_all_reduce, patched to delegate to arfuse, against the same module
unpatched, on two real gloo ranks; the unpatched one sees the node count and SM that
ARFUSE_TOPOLOGY describes (this machine has one host and no GPU)."""

import ast
import ctypes
import importlib.util
import inspect
import json
import os
import sys
import sysconfig
import time
import types
from pathlib import Path

ENV = "VLLM_FLASHINFER_ALLREDUCE_BACKEND"
SETTINGS = (None, "auto", "mnnvl", "trtllm", "MNNVL", "")


def load_cudart() -> None:
    """Before vllm: flashinfer's import needs libcudart even where no GPU is."""
    site = sysconfig.get_paths()["purelib"]
    ctypes.CDLL(f"{site}/nvidia/cuda_runtime/lib/libcudart.so.12", mode=ctypes.RTLD_GLOBAL)


def original(work: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("vllm_fi_ar_original",
                                                  f"{work}/vllm_fi_ar_original.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Platform:
    """What vLLM's current_platform would say on the GPU the topology describes."""

    def __init__(self, sm):
        self.sm = sm

    def has_device_capability(self, capability):
        return self.sm is not None and self.sm >= capability

    def get_device_capability(self):
        return None if self.sm is None else types.SimpleNamespace(to_int=lambda: self.sm)

    def is_cuda(self):
        return False  # the process itself has no GPU


def same_signature(theirs, ours):
    """Parameter names and kinds, and vLLM's defaults (annotations aside; the drop-in's
    resolver adds one default, group=None)."""
    a = list(inspect.signature(theirs).parameters.values())
    b = list(inspect.signature(ours).parameters.values())
    return len(a) == len(b) and all(
        p.name == q.name and p.kind == q.kind and (p.default is p.empty or p.default == q.default)
        for p, q in zip(a, b))


def attempt(fn):
    try:
        return ["returned", repr(fn())]
    except Exception as exc:
        return ["raised", type(exc).__name__, str(exc)]


def rank_main(rank, world, work, topologies):
    load_cudart()
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    import arfuse.integrations.vllm as dropin
    import vllm.distributed.device_communicators.flashinfer_all_reduce as patched

    orig = original(work)
    real_node_count, real_platform = orig._node_count, orig.current_platform
    group = dist.new_group(backend="gloo")  # vLLM's cpu_group
    rows = []
    names = ("get_fi_ar_workspace", "get_fi_ar_quant_workspace", "destroy_fi_ar_workspace",
             "checkpoint_prepare_fi_ar_workspaces", "checkpoint_restore_fi_ar_workspaces",
             "FlashInferAllReduce", "_resolve_fi_ar_backend", "fi_ar_available",
             "PDL_ADVANCE_LAUNCH_TOKENS", "flashinfer_comm")
    delegated = all(getattr(patched, n) is getattr(dropin, n) for n in names)
    for name, path, nodes, sm in topologies:
        if path:
            os.environ["ARFUSE_TOPOLOGY"] = path
            orig.current_platform = Platform(sm)
            # one host really: vLLM's own shared-memory test stands for one node; more nodes
            # are what the topology says
            orig._node_count = real_node_count if nodes == 1 else (lambda g, n=nodes: n)
        else:
            os.environ.pop("ARFUSE_TOPOLOGY", None)
            orig.current_platform, orig._node_count = real_platform, real_node_count
        for setting in SETTINGS:
            if setting is None:
                os.environ.pop(ENV, None)
            else:
                os.environ[ENV] = setting
            row = {"topology": name, "setting": setting}
            row["resolver"] = [attempt(lambda m=m: m._resolve_fi_ar_backend(group))
                               for m in (orig, patched)]
            kw = {"world_size": world, "rank": rank, "max_token_num": 64, "hidden_dim": 4096,
                  "dtype": torch.bfloat16, "group": group}
            for getter in ("get_fi_ar_workspace", "get_fi_ar_quant_workspace"):
                row[getter] = [attempt(lambda m=m, g=getter: getattr(m, g)(**kw))
                               for m in (orig, patched)]
            for fn in ("checkpoint_prepare_fi_ar_workspaces",
                       "checkpoint_restore_fi_ar_workspaces"):
                row[fn] = [attempt(lambda m=m, f=fn: getattr(m, f)(group)) for m in (orig, patched)]
            row["destroy_fi_ar_workspace"] = [attempt(m.destroy_fi_ar_workspace)
                                              for m in (orig, patched)]
            rows.append(row)
        os.environ.pop(ENV, None)
        comm = [m.FlashInferAllReduce(group=group, device=torch.device("cpu"))
                for m in (orig, patched)]
        disabled = [["returned", repr(c.disabled)] for c in comm]
        rows.append({"topology": name, "setting": None, "FlashInferAllReduce.disabled": disabled})
    orig.current_platform, orig._node_count = real_platform, real_node_count
    return {"rows": rows, "delegated": delegated,
            "fi_ar_available": [orig.fi_ar_available, patched.fi_ar_available],
            "signatures": all(same_signature(getattr(orig, n), getattr(patched, n))
                              for n in names[:7]),
            "held": len(dropin._held)}


def literal(path, name):
    """A table as vLLM's source defines it (importing the fusion pass needs vllm's CUDA ops)."""
    for node in ast.walk(ast.parse(Path(path).read_text())):
        targets = ([node.target] if isinstance(node, ast.AnnAssign)
                   else getattr(node, "targets", []))
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return ast.literal_eval(node.value)
    raise KeyError(name)


def main():
    work, root = sys.argv[1], sys.argv[2]
    from harness import run_ranks, values

    import arfuse.integrations.vllm as dropin

    site = sysconfig.get_paths()["purelib"]
    fusion = f"{site}/vllm/compilation/passes/fusion/allreduce_rms_fusion.py"
    utils = f"{site}/vllm/distributed/device_communicators/all_reduce_utils.py"
    tables = {
        "FI_ALLREDUCE_FUSION_MAX_SIZE_MB": literal(fusion, "FI_ALLREDUCE_FUSION_MAX_SIZE_MB")
        == dropin.FI_ALLREDUCE_FUSION_MAX_SIZE_MB,
        "FI_MNNVL_ALLREDUCE_MAX_SIZE_MB": literal(utils, "FI_MNNVL_ALLREDUCE_MAX_SIZE_MB")
        == dropin.FI_MNNVL_ALLREDUCE_MAX_SIZE_MB,
        "PDL_ADVANCE_LAUNCH_TOKENS": literal(fusion, "PDL_ADVANCE_LAUNCH_TOKENS")
        == dropin.PDL_ADVANCE_LAUNCH_TOKENS,
    }
    cuts = [("one node, 2x H200 NVSwitch", "h200-nvswitch-8", 0, 1),
            ("two nodes, GB200 MNNVL fabric", "gb200-2nodes-mnnvl-fabric", 0, 7),
            ("two nodes, H100 no fabric", "h100-2nodes-no-fabric", 0, 15)]
    topologies = [("this machine (no ARFUSE_TOPOLOGY)", "", 1, None)]
    for label, example, first, last in cuts:
        data = json.loads(Path(f"{root}/examples/topologies/{example}.json").read_text())
        data["world_size"], data["hosts"] = 2, [data["hosts"][first], data["hosts"][last]]
        path = f"{work}/{example}-2.json"
        Path(path).write_text(json.dumps(data))
        topologies.append((label, path, len(set(data["hosts"])), data["sm"]))
    started = time.perf_counter()
    results = values(run_ranks(rank_main, 2, work, topologies, timeout=540))
    ranks_s = time.perf_counter() - started
    failures = [f"{name} differs from vLLM 0.33.0's" for name, ok in tables.items() if not ok]
    for rank, result in enumerate(results):
        if not result["delegated"]:
            failures.append(f"rank {rank}: the patched module does not re-export arfuse's")
        if not result["signatures"]:
            failures.append(f"rank {rank}: signatures differ")
        if len(set(result["fi_ar_available"])) != 1:
            failures.append(f"rank {rank}: fi_ar_available {result['fi_ar_available']}")
        if result["held"]:
            failures.append(f"rank {rank}: {result['held']} workspaces left after destroy")
    print(f"{'topology':<34} {'setting':<8} {'call':<37} vLLM 0.33.0 == arfuse")
    for rank, result in enumerate(results):
        for row in result["rows"]:
            for call, (theirs, ours) in [(k, v) for k, v in row.items()
                                         if k not in ("topology", "setting")]:
                same = theirs == ours
                expected_none = not (call.startswith("get_fi_ar") and ours[0] == "returned"
                                     and ours[1] != "None")
                if not same or not expected_none:
                    failures.append(f"rank {rank} {row['topology']} {row['setting']!r} {call}: "
                                    f"vLLM {theirs} arfuse {ours}")
                if rank == 0:
                    answer = ours[1] if ours[0] == "returned" else f"{ours[1]}: {ours[2][:40]}"
                    setting = "unset" if row["setting"] is None else repr(row["setting"])
                    print(f"{row['topology'][:34]:<34} {setting:<8} {call:<37} "
                          f"{'yes' if same else 'NO '} {answer}")
    print(f"tables equal to vLLM 0.33.0's: {tables}")
    print(f"fi_ar_available (vLLM, arfuse): {results[0]['fi_ar_available']}")
    print(f"ranks: {ranks_s:.1f} s")
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        sys.exit(1)
    print("OK: vLLM 0.33.0's module, patched, answers as the unpatched one on every row")


if __name__ == "__main__":
    main()
EOF
t2=$(date +%s.%N)
status=0
# the ranks' logs (vLLM's warnings of failed creations, arfuse's) go to a file, shown on failure
PYTHONPATH="$root/src:$root/tests" ARFUSE_SHM_PURE_TORCH=1 ARFUSE_TIMEOUT_S=20 \
  ARFUSE_LOG=warning timeout 600 "$venv/bin/python" "$work/vllm_check.py" "$work" "$root" \
  2> "$work/ranks.log" || { status=$?; tail -40 "$work/ranks.log"; }
t3=$(date +%s.%N)
awk -v a="$t0" -v b="$t1" -v c="$t2" -v d="$t3" -v e="$built" 'BEGIN {
  printf "times: environment %.1f s (%s), patch %.1f s, check %.1f s, total %.1f s\n",
         b - a, e, c - b, d - c, d - a }'
exit $status
