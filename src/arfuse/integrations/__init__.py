"""Drop-ins that let other frameworks run their fused all-reduce through arfuse.

* ``arfuse.integrations.vllm``: vLLM 0.33.0's
  ``vllm/distributed/device_communicators/flashinfer_all_reduce.py`` (``docs/vllm.md``).

Nothing is imported here, so that ``import arfuse`` never loads a framework or FlashInfer.
"""
