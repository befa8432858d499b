#!/usr/bin/env bash
# Set up, then lint, type-check, run the whole test suite, check arfuse's calls against the
# real FlashInfer packages (0.6.13 and 0.7.2.post1, one venv each on .venv's torch) and the
# SGLang drop-in against SGLang 0.5.23's real module (.venv-sglang on .venv's torch). What CI
# runs. Those three venvs are built, and their checks run, in the background while the suite
# runs (mostly downloads, unpacking and imports); what they print follows the suite's.
# The shm kernel of each instruction set this CPU runs (the suite loads them all), then
# DeepSpeed's shm op (its AutoTP test's ranks load it), is compiled into the user's kernel
# cache in the background too, from while lint and the type check run (a build is most of a
# minute of one core; the suite's own loads wait for it, not build again).
# The suite runs on two pytest-xdist workers that take tests as they free up (much of it waits
# on ranks and timeouts; `-n 0` as an argument runs it in one process).
# The aarch64 job (scripts/arm_check.sh: the kernel cross-compiled, its instruction-set tests
# and the cross-machine bytes under qemu) is prepared in the background from the start (its
# downloads and trees), and runs after the suite, alone: beside it the two would share two
# cores. Its output and time follow the suite's. ARM_CHECK=0 leaves it out (a machine
# without root).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
checks_log=$(mktemp)
kernel_log=$(mktemp)
arm_log=$(mktemp)
trap 'rm -f "$checks_log" "$kernel_log" "$arm_log"' EXIT
# Under emulation a process start costs seconds, so the job leaves out what another of its
# tests covers: the numerics matrix keeps world 3 (two-shot, streaming, replicated), since
# tests/test_cross_machine.py runs world 2 in both modes on every path (against x86's bytes,
# the MoE step's too); each path's name is checked there as well; and the one-rank NaN
# comparison with torch's epilogue (a pytest process per path).
ARM_SELECTION=(-k "not (numerics_matrix or each_process_runs or one_rank_with_nan) or 3-twoshot-streaming-True"
  tests/test_isa_paths.py tests/test_cross_machine.py
  tests/test_kernel_exact.py::test_the_callers_float_environment_changes_nothing_and_is_given_back)
arm_job=""
if [ "${ARM_CHECK:-1}" != 0 ]; then
  (start=$SECONDS; status=0
   ARM_CHECK_PREPARE=1 ./scripts/arm_check.sh || status=$?
   echo "arm_check: prepared in $((SECONDS - start)) s, beside the suite"; exit $status) \
    >"$arm_log" 2>&1 &
  arm_job=$!
fi
(./scripts/flashinfer_contract.sh && ./scripts/sglang_check.sh) >"$checks_log" 2>&1 &
checks_job=$!
(for isa in $(.venv/bin/python -c "from arfuse.backends.shm import build
print(' '.join(build.host_isas()))"); do
   ARFUSE_SHM_ISA=$isa .venv/bin/python -c "from arfuse.backends.shm import build
build.load() or print('$isa: no kernel:', build.why_not())"
 done
 .venv/bin/python -c "from deepspeed.comm.torch import build_shm_op
build_shm_op() or print('DeepSpeed: no kernel')") >"$kernel_log" 2>&1 &
kernels=$!
.venv/bin/ruff check src tests benchmarks
.venv/bin/mypy
status=0
.venv/bin/python -m pytest -q -n 2 --dist worksteal "$@" || status=$?
wait "$kernels" || true  # a failed build shows in the suite (its tests say why)
grep "no kernel" "$kernel_log" || true
checks=0
wait "$checks_job" || checks=$?
cat "$checks_log"
arm=0
if [ -n "$arm_job" ]; then
  wait "$arm_job" || arm=$?
  if [ "$arm" -eq 0 ]; then
    start=$SECONDS
    ./scripts/arm_check.sh "${ARM_SELECTION[@]}" >>"$arm_log" 2>&1 || arm=$?
    echo "arm_check: $((SECONDS - start)) s after the suite" >>"$arm_log"
  fi
  cat "$arm_log"
fi
if [ "$checks" -ne 0 ]; then
  echo "test.sh: the FlashInfer contract or the SGLang check failed (exit $checks)" >&2
  exit 1
fi
if [ "$arm" -ne 0 ]; then
  echo "test.sh: the aarch64 check (scripts/arm_check.sh) failed (exit $arm)" >&2
  exit 1
fi
exit "$status"
