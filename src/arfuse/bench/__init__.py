"""The benchmark machinery behind ``arfuse bench`` and ``benchmarks/``: a latency sweep of the
fused op against what users run without arfuse.

Rows, measured side by side in one run on the same ranks (each rank's main thread pinned to one
core, after the process group exists so gloo's I/O threads are not confined with it, when the
machine has a core per rank; one torch thread; warm-up excluded). Before every call, untimed,
each row's input is written afresh, as a layer's output would be (and what a row updates in
place is restored), so every row starts from the same cache state:

* ``shm``: arfuse's fused all-reduce + residual + RMSNorm on the shm backend, new output
  tensors;
* ``shm-inplace``: the same in place, ``out=x`` and ``residual_out=residual`` (as vLLM's
  ``fused_add_rms_norm``): no fresh output buffers to pull into the cache;
* ``shm-slot``: in place, with the layer's output written straight into the rank's shared
  input slot (``FusedAllReduce.input_buffer``), which also saves the copy into shared memory;
* ``shm-replicated``, ``shm-inplace-replicated``: ``shm`` and ``shm-inplace`` with
  ``replicated_residual=True`` (the residual is the same on every rank here, as in tensor
  parallelism): two-shot sizes finish other ranks' rows from their ``residual_out``;
* ``torch``: ``torch.distributed.all_reduce`` (gloo) + eager add + RMSNorm: the baseline;
* ``deepspeed``: ``deepspeed.comm.inference_all_reduce`` alone, and ``deepspeed+norm`` with the
  eager add + RMSNorm, when deepspeed is importable.

Also measured: arfuse's Python overhead per call on top of the kernel (``overhead``),
negotiation time, page faults per timed call, and each row's memory floor: the bytes it must
move (``floor.traffic``) at one core's copy rate, and each kind of byte at its own rate measured
in the same run (``floor.Rates``: lines shared with a peer's core, both ways; new output
tensors).

Modules: ``options`` (what a run measures), ``timing`` (the interleaved timing loop),
``baselines`` (torch and DeepSpeed rows), ``floor`` (traffic and rates), ``overhead``,
``machine`` (the report's machine record), ``report`` (table, files, plot), ``body`` (one
rank's run); for the scripts of ``benchmarks/``: ``targets`` (verdicts per CPU target),
``soak`` (many checked calls, leaks watched).
"""
