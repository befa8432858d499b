"""Drop-ins that let other frameworks run their fused all-reduce through arfuse.

* ``arfuse.integrations.vllm``: vLLM 0.33.0's
  ``vllm/distributed/device_communicators/flashinfer_all_reduce.py`` (``docs/vllm.md``).
* ``arfuse.integrations.sglang``: SGLang 0.5.23's ``sglang/srt/layers/flashinfer_comm_fusion.py``
  (``docs/sglang.md``).
* ``arfuse.integrations.common``: what both share (the group's agreed setting and facts, the
  drop-ins' deadline).

Nothing is imported here, so that ``import arfuse`` never loads a framework or FlashInfer.
"""
