"""Backends: torch (unfused reference), shm (CPU shared memory), flashinfer (trtllm, mnnvl)."""
