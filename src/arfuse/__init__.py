"""arfuse: the fused all-reduce of tensor-parallel inference, on the backend the machine supports."""

from .policy import Candidate, Plan, resolve
from .settings import Settings
from .spec import Spec
from .topology import Topology

__all__ = ["Candidate", "Plan", "Settings", "Spec", "Topology", "resolve"]
__version__ = "0.1.0"
