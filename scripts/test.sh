#!/usr/bin/env bash
# Run every check: lint, types, and the whole test suite (unit, integration, e2e).
# Extra arguments go to pytest, e.g. `scripts/test.sh -m unit` or `scripts/test.sh tests/e2e`.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh test
# shellcheck disable=SC1091
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TINKER_TELEMETRY=0
# Every process of the suite shares two cores; one intra-op thread each avoids oversubscription.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TREADLE_TORCH_THREADS=${TREADLE_TORCH_THREADS:-1}

if [ $# -eq 0 ]; then
    echo "== ruff"; ruff check .; ruff format --check .
    echo "== mypy"; mypy
fi
echo "== pytest"
python -m pytest "$@"
