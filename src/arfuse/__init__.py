"""arfuse: the fused all-reduce of tensor-parallel inference, on the backend the machine supports.

    comm = arfuse.FusedAllReduce(group, max_token_num=2048, hidden_dim=4096, dtype=torch.bfloat16)
    res = comm(x, residual=residual, weight=weight)     # res.out, res.residual_out, ...
"""

from .epilogue import FusedOutput
from .negotiate import NegotiationError
from .ops import FusedAllReduce
from .policy import Candidate, Plan, resolve
from .registry import destroy_all
from .rendezvous import NegotiationTimeout
from .settings import Settings
from .spec import Spec
from .topology import Topology

__all__ = [
    "Candidate",
    "FusedAllReduce",
    "FusedOutput",
    "NegotiationError",
    "NegotiationTimeout",
    "Plan",
    "Settings",
    "Spec",
    "Topology",
    "destroy_all",
    "resolve",
]
__version__ = "0.1.0"
