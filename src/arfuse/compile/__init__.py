"""torch.compile support: a post-grad Inductor pass that puts arfuse's fused op in place of
all-reduce + residual add + RMSNorm in any tensor-parallel model (``docs/compile.md``).

    model = torch.compile(model, backend=arfuse.compile_backend(group=None, max_token_num=None))

or, for an engine that owns its backend, the pass in Inductor's config while compiling::

    with arfuse.compile.fusion(group):
        compiled = torch.compile(model)  # and its first calls, which compile

Importing this package is cheap: Inductor is imported when a pass is made.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["close", "compile_backend", "fusion", "make_pass", "stats"]


def _check(max_token_num: object) -> int | None:
    if max_token_num is None:
        return None
    if isinstance(max_token_num, bool) or not isinstance(max_token_num, int):
        raise TypeError(f"max_token_num must be an int or None, got "
                        f"{type(max_token_num).__name__}")
    from .graph_pass import MAX_TOKENS

    if not 1 <= max_token_num <= MAX_TOKENS:
        raise ValueError(f"max_token_num={max_token_num} is not valid; it must be 1.."
                         f"{MAX_TOKENS}")
    return max_token_num


def _group_name(group: Any) -> str | None:
    """The name the traced collectives carry for ``group``; ``None`` (every group) for
    ``None``."""
    if group is None:
        return None
    import torch.distributed as dist

    if not dist.is_available() or not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got "
                        f"{type(group).__name__}")
    return str(group.group_name)


def make_pass(group: Any = None, max_token_num: int | None = None, then: Any = None) -> Any:
    """The pass (an Inductor ``CustomGraphPass``) for the all-reduces of every process group
    the graphs name, or of ``group``'s only (a group with the same ranks under another name
    is another group); ``then``: a pass to run after it."""
    capacity = _check(max_token_num)
    name = _group_name(group)
    from .graph_pass import FusionPass

    return FusionPass(name, capacity, then)


def compile_backend(group: Any = None, max_token_num: int | None = None) -> Callable[..., Any]:
    """A ``torch.compile`` backend: Inductor with the pass, for every process group the
    graphs' all-reduces name (``group``: that group's only). ``max_token_num``: the fused
    capacity (tokens per call; larger calls run unfused); by default the largest token count
    traced. Every graph it compiles logs its count, one served from Inductor's cache too."""
    _check(max_token_num)
    _group_name(group)
    made: list[Any] = []  # the pass, made at the first graph: one count of graphs

    def backend(gm: Any, example_inputs: Any) -> Any:
        from torch._inductor import config
        from torch._inductor.compile_fx import compile_fx

        if not made:
            made.append(make_pass(group, max_token_num, config.post_grad_custom_pre_pass))
        fusion_pass = made[0]
        return fusion_pass.compile(compile_fx, gm, example_inputs,
                                   config_patches={"post_grad_custom_pre_pass": fusion_pass})

    return backend


@contextlib.contextmanager
def fusion(group: Any = None, max_token_num: int | None = None) -> Iterator[Any]:
    """Inductor's ``post_grad_custom_pre_pass`` set to the pass (before any pass already
    there) for the block; compiles inside it get the fusion. Yields the pass. A graph served
    from Inductor's cache is not passed, and logs nothing (``compile_backend``'s does)."""
    from torch._inductor import config

    previous = config.post_grad_custom_pre_pass
    installed = make_pass(group, max_token_num, previous)
    config.post_grad_custom_pre_pass = installed
    try:
        yield installed
    finally:
        config.post_grad_custom_pre_pass = previous


def stats() -> dict[str, dict[str, Any]]:
    """The ops compiled graphs made in this process, by ``"group <name>, <dtype>, hidden
    <n>"``: the backend and the chains' calls (``calls``, ``fused``, ``unfused``), those the
    shm kernel ran straight from the graph included."""
    from . import runtime

    return runtime.stats()


def close() -> None:
    """Close the ops compiled graphs made (collective: every rank). The next call of a
    compiled graph creates them again."""
    from . import runtime

    runtime.close_all()
