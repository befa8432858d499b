"""arfuse: the fused all-reduce of tensor-parallel inference, on the backend the machine supports.

    comm = arfuse.FusedAllReduce(group, max_token_num=2048, hidden_dim=4096, dtype=torch.bfloat16)
    res = comm(x, residual=residual, weight=weight)     # res.out, res.residual_out, ...
"""

from .catalog import BackendDescriptor, Footprint, register
from .compile import compile_backend
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
from .ops import FusedAllReduce
from .pattern import Pattern
from .policy import Candidate, Plan, resolve
from .registry import destroy_all
from .result import FusedOutput
from .settings import ResidualPromise, Settings
from .spec import Spec
from .topology import Topology

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
