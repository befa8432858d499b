#!/usr/bin/env bash
# Set up, then lint, type-check, run the whole test suite, and check arfuse's calls against the
# real FlashInfer packages (0.6.13 and 0.7.2.post1, one venv each; ~2 min cold). What CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/ruff check src tests benchmarks
.venv/bin/mypy
.venv/bin/python -m pytest -q "$@"
./scripts/flashinfer_contract.sh
