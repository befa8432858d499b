"""SGLang 0.5.23's flashinfer_comm_fusion, patched to delegate to arfuse, against the same module
unpatched, on real gloo ranks initialised through SGLang's own parallel_state. Run by
scripts/sglang_check.sh (``python sglang_check_ranks.py WORK ROOT``), which applies the patch.

SGLang's callers (``layer_boundary``'s ``flashinfer_ar_fusion_applies``, the runner's
``_pre_initialize_flashinfer_allreduce_workspace``, Beam's ``_setup_flashinfer_ar``) are run
as SGLang wrote them: their bodies are read from the installed files and executed against each
module (their own modules import every model's config, which needs torchvision, and this
machine has no CPU torchvision for torch 2.13)."""

import ast
import atexit
import importlib
import importlib.util
import inspect
import json
import logging
import os
import sys
import sysconfig
import time
import types
from functools import partial
from pathlib import Path

FUSION = "sglang.srt.layers.flashinfer_comm_fusion"
SETTINGS = (None, "auto", "trtllm", "mnnvl", "cutedsl")
NAMES = ("uses_cutedsl_ar_fusion", "resolve_flashinfer_allreduce_fusion_backend",
         "is_flashinfer_allreduce_unavailable", "FlashInferWorkspaceManager",
         "resolve_fusion_world_size", "resolve_fusion_group", "ensure_workspace_initialized",
         "flashinfer_allreduce_residual_rmsnorm", "can_use_flashinfer_allreduce",
         "flashinfer_allreduce", "pre_initialize_workspaces", "cleanup_flashinfer_workspace")
CALLERS = {"layer_boundary": ("sglang/srt/layers/layer_boundary/residual/add_norm.py",
                              "flashinfer_ar_fusion_applies"),
           "base_runner": ("sglang/srt/model_executor/runner/base_runner.py",
                           "_pre_initialize_flashinfer_allreduce_workspace"),
           "beam": ("sglang/srt/models/beam.py", "_setup_flashinfer_ar")}


def without_model_imports() -> None:
    """``sglang.srt.configs``' __init__ imports every model's config, some of which need
    torchvision (no CPU build for torch 2.13 here): the package is entered without running it,
    and each name it exports is imported from its own submodule when first asked for."""
    spec = importlib.util.find_spec("sglang.srt")
    configs = os.path.join(spec.submodule_search_locations[0], "configs")
    where = {}
    for node in ast.parse(Path(configs, "__init__.py").read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module:
            module = node.module if node.level == 0 else f"sglang.srt.configs.{node.module}"
            where.update({alias.asname or alias.name: module for alias in node.names})
    package = types.ModuleType("sglang.srt.configs")
    package.__path__ = [configs]

    def lazy(name):
        if name not in where:
            raise AttributeError(name)
        return getattr(importlib.import_module(where[name]), name)

    package.__getattr__ = lazy
    sys.modules["sglang.srt.configs"] = package


def original(work):
    """The unpatched module; its op is SGLang's body itself (the op name is registered once,
    by the patched module, and registered ops run on CUDA tensors only)."""
    custom_op = importlib.import_module("sglang.srt.utils.custom_op")
    real = custom_op.register_custom_op
    custom_op.register_custom_op = lambda **kw: (lambda fn: fn)
    try:
        spec = importlib.util.spec_from_file_location("sglang_fusion_original",
                                                      f"{work}/sglang_fusion_original.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        custom_op.register_custom_op = real
    return module


def caller(key, fusion):
    """A caller's function as SGLang wrote it, importing ``fusion`` where it imports SGLang's
    module (a body in sys.modules' place for the call)."""
    path, name = CALLERS[key]
    site = sysconfig.get_paths()["purelib"]
    source = Path(site, path).read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            code = ast.get_source_segment(source, node)
            break
    rc = importlib.import_module("sglang.srt.runtime_context")
    utils = importlib.import_module("sglang.srt.utils")
    import torch

    namespace = {"torch": torch, "atexit": atexit, "partial": partial,
                 "logger": logging.getLogger("sglang.check"), "get_exec": rc.get_exec,
                 "get_parallel": rc.get_parallel, "get_platform": rc.get_platform,
                 "is_flashinfer_allreduce_unavailable": fusion.is_flashinfer_allreduce_unavailable,
                 "uses_cutedsl_ar_fusion": fusion.uses_cutedsl_ar_fusion,
                 "is_dp_attention_enabled": lambda: False,
                 "FUSE_ALLREDUCE_MAX_BATCH_SIZE": 2048,  # read from add_norm.py below
                 # add_norm.py computes these at its import, on this machine
                 "_is_sm90_supported": torch.cuda.is_available() and rc.get_platform().is_sm90,
                 "_is_sm100_supported": torch.cuda.is_available() and rc.get_platform().is_sm100,
                 "_is_flashinfer_available": utils.is_flashinfer_available(),
                 "_flashinfer_all_reduce": None}
    exec(compile(inspect.cleandoc("\n" + code) if code.startswith(" ") else code,
                 path, "exec"), namespace)
    return namespace[name]


def attempt(fn):
    try:
        value = fn()
    except Exception as exc:
        return ["raised", type(exc).__name__, str(exc).splitlines()[0][:160]]
    if isinstance(value, tuple) and len(value) == 3 and hasattr(value[2], "cpu_group"):
        value = (value[0], value[1], type(value[2]).__name__)
    return ["returned", repr(value)]


def publish(world, rank, setting):
    from sglang.srt import runtime_context as rc
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path="dummy", tp_size=world, device="cpu",
                      flashinfer_allreduce_fusion_backend=setting)
    args._resolution_finished = True  # resolution loads the model's config: none here
    rc.publish(args, role="test", ranks=rc.SpawnRanks(world_rank=rank))


def with_setting(setting):
    from sglang.srt import runtime_context as rc

    rc.get_context().override("check", flashinfer_allreduce_fusion_backend=setting)


def calls(fusion, world, rank, runner, beam, applies):
    """Every public function, called as SGLang's callers call it."""
    import torch

    from sglang.srt.distributed import parallel_state as ps

    x = torch.ones(8, 256, dtype=torch.bfloat16)
    tp = ps.get_tp_group()
    op = getattr(fusion.flashinfer_allreduce_residual_rmsnorm, "__wrapped__",
                 fusion.flashinfer_allreduce_residual_rmsnorm)
    row = {
        "uses_cutedsl_ar_fusion": attempt(fusion.uses_cutedsl_ar_fusion),
        "resolve_flashinfer_allreduce_fusion_backend":
            attempt(fusion.resolve_flashinfer_allreduce_fusion_backend),
        "is_flashinfer_allreduce_unavailable":
            attempt(fusion.is_flashinfer_allreduce_unavailable),
        "resolve_fusion_world_size(attn)":
            attempt(lambda: fusion.resolve_fusion_world_size(use_attn_tp_group=True)),
        "resolve_fusion_group(attn)":
            attempt(lambda: fusion.resolve_fusion_group(use_attn_tp_group=True)),
        "ensure_workspace_initialized(attn)":
            attempt(lambda: fusion.ensure_workspace_initialized(hidden_dim=256)),
        "ensure_workspace_initialized(moe)": attempt(
            lambda: fusion.ensure_workspace_initialized(hidden_dim=256, use_attn_tp_group=False)),
        "flashinfer_allreduce_residual_rmsnorm (body)": attempt(
            lambda: op(x, torch.ones_like(x), torch.ones(256, dtype=torch.bfloat16),
                       max_token_num=2048)),
        "can_use_flashinfer_allreduce": attempt(lambda: fusion.can_use_flashinfer_allreduce(
            x, use_attn_tp_group=True, expected_world_size=world,
            expected_group_key=(tp.device_group, tp.cpu_group))),
        "layer_boundary: flashinfer_ar_fusion_applies(8)": attempt(lambda: applies(8)),
        "runner: _pre_initialize_flashinfer_allreduce_workspace": attempt(lambda: runner(
            types.SimpleNamespace(model_runner=types.SimpleNamespace(
                is_draft_worker=False, model=None, max_running_requests=8,
                model_config=types.SimpleNamespace(hidden_size=256),
                dtype=torch.bfloat16)))),
        "pre_initialize_workspaces":
            attempt(lambda: fusion.pre_initialize_workspaces(2048, 256, torch.bfloat16)),
    }
    band = types.SimpleNamespace(_flashinfer_ar_tokens=(1, 64), _flashinfer_ar=None)
    row["beam: _setup_flashinfer_ar"] = attempt(lambda: (beam(band, 256),
                                                         band._flashinfer_ar_tokens)[1])
    manager = fusion.FlashInferWorkspaceManager()
    row["FlashInferWorkspaceManager.initialize(mnnvl)"] = attempt(lambda: manager.initialize(
        world_size=tp.world_size, rank=tp.rank_in_group, max_token_num=64, hidden_dim=256,
        backend="mnnvl", dtype=torch.bfloat16, device_group=tp.device_group,
        cpu_group=tp.cpu_group))
    row["FlashInferWorkspaceManager.workspace"] = attempt(lambda: manager.workspace)
    row["FlashInferWorkspaceManager.is_buffer_size_sufficient"] = attempt(
        lambda: manager.is_buffer_size_sufficient(8, 256, torch.bfloat16))
    row["FlashInferWorkspaceManager.cleanup"] = attempt(manager.cleanup)
    row["cleanup_flashinfer_workspace"] = attempt(fusion.cleanup_flashinfer_workspace)
    return row


def swapped(module, fn):
    """Run ``fn`` with ``module`` as SGLang's fusion module (what its callers import)."""
    saved = sys.modules[FUSION]
    sys.modules[FUSION] = module
    try:
        return fn()
    finally:
        sys.modules[FUSION] = saved


def rank_main(rank, world, work, topologies):
    without_model_imports()
    import warnings

    warnings.filterwarnings("ignore")
    from sglang.srt import runtime_context as rc
    from sglang.srt.distributed import parallel_state as ps

    publish(world, rank, None)
    ps.init_distributed_environment(world_size=world, rank=rank, local_rank=rank,
                                    backend="gloo")
    ps.initialize_model_parallel()
    import arfuse.integrations.sglang as dropin

    patched = importlib.import_module(FUSION)
    orig = original(work)
    delegated = all(getattr(patched, n) is getattr(dropin, n) for n in NAMES)
    signatures = all(same_signature(getattr(orig, n), getattr(patched, n)) for n in NAMES)
    rows = []
    for name, path, nodes, sm in topologies:
        platform = {"is_sm90": sm == 90, "is_sm100": sm in (100, 103)} if path else {}
        if path:
            os.environ["ARFUSE_TOPOLOGY"] = path
        else:
            os.environ.pop("ARFUSE_TOPOLOGY", None)
        for setting in SETTINGS:
            with_setting(setting)
            rc.get_context().override("check", nnodes=nodes)
            answers = []
            for module in (orig, patched):
                with rc.override_platform(**platform):
                    answers.append(swapped(module, lambda m=module: calls(
                        m, world, rank, caller("base_runner", m), caller("beam", m),
                        caller("layer_boundary", m))))
            for call in answers[0]:
                rows.append({"topology": name, "setting": setting, "call": call,
                             "sglang": answers[0][call], "arfuse": answers[1][call]})
    return {"rows": rows, "delegated": delegated, "signatures": signatures,
            "held": len(__import__("arfuse").registry.REGISTRY.workspaces())}


def same_signature(theirs, ours):
    """Parameter names, kinds and defaults (annotations aside)."""
    if inspect.isclass(theirs):
        return all(same_signature(getattr(theirs, m), getattr(ours, m)) for m in
                   ("initialize", "is_buffer_size_sufficient", "cleanup"))
    a = list(inspect.signature(theirs).parameters.values())
    b = list(inspect.signature(ours).parameters.values())
    return len(a) == len(b) and all(p.name == q.name and p.kind == q.kind
                                    and p.default == q.default for p, q in zip(a, b))


def expected(row, table):
    """Equal to SGLang's, or what docs/sglang.md's table says arfuse answers instead."""
    if row["sglang"] == row["arfuse"]:
        return True
    want = table.get((row["topology"], row["setting"] or "unset", row["call"]))
    return want is not None and want == row["arfuse"][1]


def differences(root):
    """docs/sglang.md's table of deliberate differences: (topology, setting, call) -> answer."""
    text = Path(root, "docs/sglang.md").read_text()
    block = text.split("<!-- check-table -->")[1]
    table = {}
    for line in block.splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0] not in ("topology", "---"):
            table[tuple(cells[:3])] = cells[3]
    return table


def main():
    work, root = sys.argv[1], sys.argv[2]
    from harness import run_ranks, values

    cuts = [("H200 NVSwitch, 1 node", "h200-nvswitch-8", 1),
            ("H200 NVL bridges, 1 node", "h200-nvl-bridges-8", 1),
            ("GB200 fabric, 2 nodes", "gb200-2nodes-mnnvl-fabric", 2),
            ("H100, 2 nodes, no fabric", "h100-2nodes-no-fabric", 2)]
    table = differences(root)
    failures, timings = [], {}
    print(f"{'ranks':<5} {'topology':<26} {'setting':<8} {'call':<55} same  arfuse's answer")
    for world in (2, 4):
        topologies = [("this machine", "", 1, None)]
        for label, example, nodes in cuts:
            data = json.loads(Path(f"{root}/examples/topologies/{example}.json").read_text())
            hosts = data["hosts"]
            # the first ranks of the first node, then as many of the last node
            picked = hosts[:world] if nodes == 1 else \
                hosts[:world // 2] + hosts[-(world // 2):]
            data["world_size"], data["hosts"] = world, picked
            path = f"{work}/{example}-{world}.json"
            Path(path).write_text(json.dumps(data))
            topologies.append((label, path, nodes, data["sm"]))
        started = time.perf_counter()
        results = values(run_ranks(rank_main, world, work, topologies, timeout=420))
        timings[world] = time.perf_counter() - started
        for rank, result in enumerate(results):
            if not result["delegated"]:
                failures.append(f"{world} ranks, rank {rank}: the patched module does not "
                                "re-export arfuse's")
            if not result["signatures"]:
                failures.append(f"{world} ranks, rank {rank}: signatures differ")
            if result["held"]:
                failures.append(f"{world} ranks, rank {rank}: {result['held']} workspaces held")
            for row in result["rows"]:
                if not expected(row, table):
                    failures.append(f"{world} ranks, rank {rank}: {row}")
                if rank == 0:
                    same = "yes" if row["sglang"] == row["arfuse"] else "table"
                    answer = row["arfuse"][1] if row["arfuse"][0] == "returned" else \
                        f"{row['arfuse'][1]}: {row['arfuse'][2][:40]}"
                    print(f"{world:<5} {row['topology'][:26]:<26} "
                          f"{row['setting'] or 'unset':<8} {row['call'][:55]:<55} "
                          f"{same:<5} {answer}")
    print("ranks: " + ", ".join(f"{w} ranks {s:.1f} s" for w, s in timings.items()))
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        sys.exit(1)
    print("OK: SGLang 0.5.23's module, patched, answers as the unpatched one, or as "
          "docs/sglang.md's table says, on every row")


if __name__ == "__main__":
    main()
