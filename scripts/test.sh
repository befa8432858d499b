#!/usr/bin/env bash
# Set up, then lint, type-check, run the whole test suite and check arfuse's calls against the
# real FlashInfer packages (0.6.13 and 0.7.2.post1, one venv each; ~3.5 min cold). What CI runs.
# The suite runs on two pytest-xdist workers (much of it waits on ranks and timeouts; `-n 0` as
# an argument runs it in one process); the FlashInfer contract, mostly pip on one core, runs
# beside it and prints its report when the suite is done.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/ruff check src tests benchmarks
.venv/bin/mypy
contract_log=$(mktemp)
./scripts/flashinfer_contract.sh >"$contract_log" 2>&1 &
contract=$!
trap 'kill "$contract" 2>/dev/null || true; rm -f "$contract_log"' EXIT
suite=0
.venv/bin/python -m pytest -q -n 2 "$@" || suite=$?
contract_status=0
wait "$contract" || contract_status=$?
cat "$contract_log"
if [ "$suite" -ne 0 ] || [ "$contract_status" -ne 0 ]; then
  echo "test.sh: test suite exit $suite, FlashInfer contract exit $contract_status" >&2
  exit 1
fi
