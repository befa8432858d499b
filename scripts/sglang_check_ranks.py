"""SGLang 0.5.23's flashinfer_comm_fusion, patched to delegate to arfuse, against the same module
unpatched, on real gloo ranks initialised through SGLang's own parallel_state. Run by
scripts/sglang_check.sh (``python sglang_check_ranks.py WORK ROOT``), which applies the patch.

SGLang's callers are SGLang's own functions, imported from their modules and called as SGLang
calls them: ``layer_boundary``'s ``flashinfer_ar_fusion_applies``, the runner's
``BaseRunner._pre_initialize_flashinfer_allreduce_workspace`` and Beam's
``BeamModel._setup_flashinfer_ar``. Only torchvision is stood in for: SGLang's model configs
import it at module level for image preprocessing, and this index has no CPU build for torch
2.13 (the 0.28.0 wheel is CUDA's). The stand-in is served to SGLang's imports only, and any
use of it raises: nothing checked here can reach it.

SGLang is imported once, in the harness's forkserver, and every rank forks from it."""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import json
import os
import sys
import time
import types
from pathlib import Path

FUSION = "sglang.srt.layers.flashinfer_comm_fusion"
SETTINGS = (None, "auto", "trtllm", "mnnvl", "cutedsl")
NAMES = ("uses_cutedsl_ar_fusion", "resolve_flashinfer_allreduce_fusion_backend",
         "is_flashinfer_allreduce_unavailable", "FlashInferWorkspaceManager",
         "resolve_fusion_world_size", "resolve_fusion_group", "ensure_workspace_initialized",
         "flashinfer_allreduce_residual_rmsnorm", "can_use_flashinfer_allreduce",
         "flashinfer_allreduce", "pre_initialize_workspaces", "cleanup_flashinfer_workspace")
ADD_NORM = "sglang.srt.layers.layer_boundary.residual.add_norm"
CALLER_MODULES = (ADD_NORM, "sglang.srt.model_executor.runner.base_runner",
                  "sglang.srt.models.beam")


# --- torchvision, which this machine cannot have --------------------------------------------


class Absent(type):
    """Any torchvision name: attributes are more of the same (module-level ``T.Compose`` or
    ``InterpolationMode.BICUBIC`` import fine), a call raises."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return Absent(f"{cls.__name__}.{name}", (), {})

    def __call__(cls, *args, **kwargs):
        raise RuntimeError(f"torchvision is not installed here: {cls.__name__} was called")


def _importer():
    """The module whose ``import`` statement is running (import machinery skipped)."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith("<frozen importlib")
                                 or frame.f_globals.get("__name__") == __name__):
        frame = frame.f_back
    return "" if frame is None else str(frame.f_globals.get("__name__", ""))


class TorchvisionStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """torchvision for SGLang's imports; absent for everyone else (transformers' availability
    check asks through ``importlib.util.find_spec`` and must keep hearing "no")."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] != "torchvision":
            return None
        if name != "torchvision" and "torchvision" not in sys.modules:
            return None
        if not _importer().startswith(("sglang.", "torchvision")):
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []

        def attribute(name, where=spec.name):
            if name.startswith("__"):
                raise AttributeError(name)
            return Absent(f"{where}.{name}", (), {})

        module.__getattr__ = attribute
        return module

    def exec_module(self, module):
        pass


def stand_in_for_torchvision():
    """Once per process (this file may run as __main__ and be imported by name too)."""
    if importlib.util.find_spec("torchvision") is None and not any(
            type(f).__name__ == TorchvisionStandIn.__name__ for f in sys.meta_path):
        sys.meta_path.append(TorchvisionStandIn())


stand_in_for_torchvision()
# imported once in the harness's forkserver (this file by name first, for the stand-in), so
# that every rank forks with SGLang loaded
PRELOAD = ("sglang_check_ranks", "sglang.srt.distributed.parallel_state", FUSION,
           *CALLER_MODULES)


def load_sglang():
    """SGLang's parallel_state, its fusion module (patched) and the callers' modules."""
    import warnings

    warnings.filterwarnings("ignore")
    for name in PRELOAD[1:]:
        importlib.import_module(name)


# --- the two modules --------------------------------------------------------------------------


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


class AsFusion:
    """``fusion`` as SGLang's fusion module for a call: in sys.modules (the callers that
    import it when called) and in the names add_norm bound at its import."""

    def __init__(self, fusion, patched):
        self.fusion, self.patched = fusion, patched

    def __enter__(self):
        self.saved = sys.modules[FUSION]
        sys.modules[FUSION] = self.fusion
        self.bound = {}
        for module_name in CALLER_MODULES:
            module = sys.modules[module_name]
            for name in NAMES:
                if getattr(module, name, None) is getattr(self.patched, name):
                    self.bound[(module, name)] = True
                    setattr(module, name, getattr(self.fusion, name))

    def __exit__(self, *exc):
        sys.modules[FUSION] = self.saved
        for module, name in self.bound:
            setattr(module, name, getattr(self.patched, name))


def attempt(fn):
    try:
        value = fn()
    except Exception as exc:
        return ["raised", type(exc).__name__, str(exc).splitlines()[0][:160]]
    if isinstance(value, tuple) and len(value) == 3 and hasattr(value[2], "cpu_group"):
        value = (value[0], value[1], type(value[2]).__name__)
    return ["returned", repr(value)]


def publish(world, rank):
    from sglang.srt import runtime_context as rc
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path="dummy", tp_size=world, device="cpu")
    args._resolution_finished = True  # resolution loads the model's config: none here
    rc.publish(args, role="test", ranks=rc.SpawnRanks(world_rank=rank))


def calls(fusion, world):
    """Every public function, and SGLang's callers, as SGLang calls them."""
    import torch
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.model_executor.runner.base_runner import BaseRunner
    from sglang.srt.models.beam import BeamModel

    applies = sys.modules[ADD_NORM].flashinfer_ar_fusion_applies
    x = torch.ones(8, 256, dtype=torch.bfloat16)
    tp = ps.get_tp_group()
    op = getattr(fusion.flashinfer_allreduce_residual_rmsnorm, "__wrapped__",
                 fusion.flashinfer_allreduce_residual_rmsnorm)
    runner = types.SimpleNamespace(model_runner=types.SimpleNamespace(
        is_draft_worker=False, model=torch.nn.Module(), max_running_requests=8,
        model_config=types.SimpleNamespace(hidden_size=256), dtype=torch.bfloat16))
    row = {
        "uses_cutedsl_ar_fusion": attempt(fusion.uses_cutedsl_ar_fusion),
        "resolve_flashinfer_allreduce_fusion_backend":
            attempt(fusion.resolve_flashinfer_allreduce_fusion_backend),
        "is_flashinfer_allreduce_unavailable":
            attempt(fusion.is_flashinfer_allreduce_unavailable),
        "resolve_fusion_world_size(attn)":
            attempt(lambda: fusion.resolve_fusion_world_size(use_attn_tp_group=True)),
        "resolve_fusion_world_size(moe)":
            attempt(lambda: fusion.resolve_fusion_world_size(use_attn_tp_group=False)),
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
        "runner: _pre_initialize_flashinfer_allreduce_workspace": attempt(
            lambda: BaseRunner._pre_initialize_flashinfer_allreduce_workspace(runner)),
        "pre_initialize_workspaces":
            attempt(lambda: fusion.pre_initialize_workspaces(2048, 256, torch.bfloat16)),
    }
    beam = types.SimpleNamespace(_flashinfer_ar_tokens=(1, 64), _flashinfer_ar=None)
    row["beam: _setup_flashinfer_ar"] = attempt(
        lambda: (BeamModel._setup_flashinfer_ar(beam, 256), beam._flashinfer_ar_tokens)[1])
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


def same_signature(theirs, ours):
    """Parameter names, kinds and defaults (annotations aside)."""
    if inspect.isclass(theirs):
        return all(same_signature(getattr(theirs, m), getattr(ours, m)) for m in
                   ("initialize", "is_buffer_size_sufficient", "cleanup"))
    a = list(inspect.signature(theirs).parameters.values())
    b = list(inspect.signature(ours).parameters.values())
    return len(a) == len(b) and all(p.name == q.name and p.kind == q.kind
                                    and p.default == q.default for p, q in zip(a, b, strict=True))


def rank_main(rank, world, work, topologies):
    load_sglang()  # already there when the forkserver preloaded it
    from sglang.srt import runtime_context as rc
    from sglang.srt.distributed import parallel_state as ps

    import arfuse
    import arfuse.integrations.sglang as dropin

    publish(world, rank)
    ps.init_distributed_environment(world_size=world, rank=rank, local_rank=rank,
                                    backend="gloo")
    ps.initialize_model_parallel()
    patched, orig = sys.modules[FUSION], original(work)
    facts = {
        "delegated": all(getattr(patched, n) is getattr(dropin, n) for n in NAMES),
        "signatures": all(same_signature(getattr(orig, n), getattr(patched, n)) for n in NAMES),
        "batch limit": dropin.FUSE_ALLREDUCE_MAX_BATCH_SIZE
        == sys.modules[ADD_NORM].FUSE_ALLREDUCE_MAX_BATCH_SIZE}
    rows = []
    for name, path, nodes, sm in topologies:
        platform = {"is_sm90": sm == 90, "is_sm100": sm in (100, 103)} if path else {}
        if path:
            os.environ["ARFUSE_TOPOLOGY"] = path
        else:
            os.environ.pop("ARFUSE_TOPOLOGY", None)
        for setting in SETTINGS:
            rc.get_context().override("check", flashinfer_allreduce_fusion_backend=setting)
            rc.get_context().override("check", nnodes=nodes)
            answers = []
            for module in (orig, patched):
                with rc.override_platform(**platform), AsFusion(module, patched):
                    answers.append(calls(module, world))
            for call in answers[0]:
                rows.append({"topology": name, "setting": setting, "call": call,
                             "sglang": answers[0][call], "arfuse": answers[1][call]})
    facts["held"] = len(arfuse.registry.REGISTRY.workspaces())
    teardown(ps)
    return {"rows": rows, **facts}


def teardown(ps):
    """What SGLang's destroy_model_parallel and destroy_distributed_environment do, without
    the former's import of the server's bootstrap (it needs uvicorn, fastapi, ...): destroy
    every group coordinator, the world's last; their broadcasters' shared memory goes too."""
    import gc

    coordinators = {id(g): g for g in vars(ps).values() if isinstance(g, ps.GroupCoordinator)}
    world = ps.get_world_group()
    for group in [g for g in coordinators.values() if g is not world] + [world]:
        group.destroy()
    for name, value in list(vars(ps).items()):
        if isinstance(value, ps.GroupCoordinator):
            setattr(ps, name, None)
    del coordinators, world, group
    gc.collect()


# --- the parent: topologies, the table, the verdict -------------------------------------------


def expected(row, table):
    """Equal to SGLang's, or what docs/sglang.md's table says both answer."""
    if row["sglang"] == row["arfuse"]:
        return True
    key = (row["topology"], row["setting"] or "unset", row["call"])
    return table.get(key) == (answer(row["sglang"]), answer(row["arfuse"]))


def answer(outcome):
    return outcome[1] if outcome[0] == "returned" else f"{outcome[1]}: {outcome[2]}"


def differences(root):
    """docs/sglang.md's table of deliberate differences (topology | setting | call | SGLang's
    answer | arfuse's | why): (topology, setting, call) -> (SGLang's answer, arfuse's)."""
    text = Path(root, "docs/sglang.md").read_text()
    block = text.split("<!-- check-table -->")[1]
    table = {}
    for line in block.splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[0] not in ("topology", "---"):
            table[tuple(cells[:3])] = (cells[3], cells[4])
    return table


# (label, example topology, which hosts: "one node" or "two nodes", the launch's node count)
CUTS = (("H200 NVSwitch", "h200-nvswitch-8", "one node", 1),
        ("H200 NVL bridges", "h200-nvl-bridges-8", "one node", 1),
        ("H200 NVSwitch, node-local group, 2-node launch", "h200-nvswitch-8", "one node", 2),
        ("GB200 fabric, 2 nodes", "gb200-2nodes-mnnvl-fabric", "two nodes", 2),
        ("H100, 2 nodes, no fabric", "h100-2nodes-no-fabric", "two nodes", 2),
        ("H100 group across 2 nodes, 1-node launch", "h100-2nodes-no-fabric", "two nodes", 1))


def topologies(root, work, world):
    found = [("this machine", "", 1, None)]
    for label, example, hosts, nodes in CUTS:
        data = json.loads(Path(f"{root}/examples/topologies/{example}.json").read_text())
        every = data["hosts"]
        # the first ranks of the first node, or as many of the first and the last node
        picked = every[:world] if hosts == "one node" else \
            every[:world // 2] + every[-(world // 2):]
        data["world_size"], data["hosts"] = world, picked
        path = f"{work}/{label.replace(' ', '_').replace(',', '')}-{world}.json"
        Path(path).write_text(json.dumps(data))
        found.append((label, path, nodes, data["sm"]))
    return found


def main():
    work, root = sys.argv[1], sys.argv[2]
    import harness
    from harness import run_ranks, values

    harness._CTX.set_forkserver_preload([*PRELOAD, "torch", "torch.distributed", "arfuse"])
    table = differences(root)
    failures, timings, seen = [], {}, set()
    for world in (2, 4):
        started = time.perf_counter()
        # the first run's forkserver imports SGLang (~20 s on two busy cores)
        results = values(run_ranks(rank_main, world, work, topologies(root, work, world),
                                   timeout=240 if world == 2 else 120))
        timings[world] = time.perf_counter() - started
        for rank, result in enumerate(results):
            for fact in ("delegated", "signatures", "batch limit"):
                if not result[fact]:
                    failures.append(f"{world} ranks, rank {rank}: {fact} differs")
            if result["held"]:
                failures.append(f"{world} ranks, rank {rank}: {result['held']} workspaces held")
            for row in result["rows"]:
                if not expected(row, table):
                    failures.append(f"{world} ranks, rank {rank}: {row}")
                if row["sglang"] != row["arfuse"]:
                    seen.add((row["topology"], row["setting"] or "unset", row["call"]))
        rows = results[0]["rows"]
        differ = [r for r in rows if r["sglang"] != r["arfuse"]]
        print(f"{world} ranks: {len(rows) - len(differ)} of {len(rows)} calls (topology x "
              f"setting x call) answer as SGLang 0.5.23's on every rank; these differ:")
        for r in differ:
            print(f"  {r['topology']:<46} {r['setting'] or 'unset':<7} {r['call'][:44]:<44} "
                  f"{answer(r['sglang'])[:40]:<40} -> {answer(r['arfuse'])[:40]}")
    failures += [f"docs/sglang.md's table row {key} differs from nothing"
                 for key in table if key not in seen]
    print("ranks: " + ", ".join(f"{w} ranks {s:.1f} s" for w, s in timings.items())
          + " (the first includes SGLang's import)")
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        sys.exit(1)
    print("OK: SGLang 0.5.23's module, patched, answers as the unpatched one, or as "
          "docs/sglang.md's table says, on every row")


if __name__ == "__main__":
    main()
