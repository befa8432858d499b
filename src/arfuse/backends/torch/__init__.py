"""``torch``: the unfused reference (``torch.distributed`` on the group, then the epilogue).

Runs everywhere, any world size, across nodes; every plan ends with it (unless strict), and every
call over a fused workspace's capacity runs on it. Descriptor only; see ``workspace``.
"""

from __future__ import annotations

from ...catalog import BackendDescriptor

DESCRIPTORS = (BackendDescriptor(
    name="torch", fused=False, devices=("cpu", "cuda"),
    implementation="arfuse.backends.torch.workspace:TorchBackend"),)
