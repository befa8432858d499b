#!/usr/bin/env bash
# Set up, then lint, type-check, run the whole test suite, check arfuse's calls against the
# real FlashInfer packages (0.6.13 and 0.7.2.post1, one venv each on .venv's torch; ~1.5 min
# cold) and the SGLang drop-in against SGLang 0.5.23's real module (.venv-sglang on .venv's
# torch; ~55 s cold, ~25 s warm). What CI runs.
# The suite runs on two pytest-xdist workers: much of it waits on ranks and timeouts (`-n 0` as
# an argument runs it in one process).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/ruff check src tests benchmarks
.venv/bin/mypy
.venv/bin/python -m pytest -q -n 2 "$@"
./scripts/flashinfer_contract.sh
./scripts/sglang_check.sh
