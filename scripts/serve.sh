#!/usr/bin/env bash
# Run Treadle in embedded mode: no configuration, one process, data under the user data directory.
# Arguments go to `treadle-server serve` (e.g. --port 9000).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh serve
exec .venv/bin/treadle-server serve "$@"
