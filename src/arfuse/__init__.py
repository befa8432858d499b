"""arfuse: the fused all-reduce of tensor-parallel inference, on the backend the machine supports.

    comm = arfuse.FusedAllReduce(group, max_token_num=2048, hidden_dim=4096, dtype=torch.bfloat16)
    res = comm(x, residual=residual, weight=weight)     # res.out, res.residual_out, ...

The names that need torch (the op, its result, the compile backend, ``destroy_all``) load on
first use: the policy, settings, topology and errors import without it, so ``arfuse explain``
and a bad flag answer in a fraction of a second instead of after torch's import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import lazy
from .catalog import BackendDescriptor, Footprint, register
from .errors import (
    ArfuseError,
    CallTimeout,
    CollectiveTimeout,
    CreationFailed,
    MismatchedCall,
    NegotiationError,
    NegotiationTimeout,
    PeerAborted,
    WorkspaceBroken,
)
from .pattern import Pattern
from .policy import Candidate, Plan, resolve
from .settings import ResidualPromise, Settings
from .spec import Spec
from .topology import Topology

if TYPE_CHECKING:
    from .compile import compile_backend
    from .ops import FusedAllReduce
    from .registry import destroy_all
    from .result import FusedOutput

_WITH_TORCH = {"FusedAllReduce": "ops", "FusedOutput": "result", "compile_backend": "compile",
               "destroy_all": "registry"}
"""Public name -> the module (importing torch) that defines it."""


__getattr__ = lazy.attributes(__name__, _WITH_TORCH, globals())


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WITH_TORCH))


__all__ = [
    "ArfuseError",
    "BackendDescriptor",
    "CallTimeout",
    "Candidate",
    "CollectiveTimeout",
    "CreationFailed",
    "Footprint",
    "FusedAllReduce",
    "FusedOutput",
    "MismatchedCall",
    "NegotiationError",
    "NegotiationTimeout",
    "Pattern",
    "PeerAborted",
    "Plan",
    "ResidualPromise",
    "Settings",
    "Spec",
    "Topology",
    "WorkspaceBroken",
    "compile_backend",
    "destroy_all",
    "register",
    "resolve",
]
__version__ = "0.1.0"
