#!/usr/bin/env bash
# Regenerate sdk/treadle/proto/treadle_wire_pb2.py and .pyi from treadle_wire.proto.
#
# protoc comes from grpcio-tools (PyPI), installed into a throwaway virtualenv so the
# project's own protobuf runtime is never touched. The generated module checks the runtime
# version at import time: after bumping GRPCIO_TOOLS_VERSION, raise the `protobuf>=` lower
# bound in sdk/pyproject.toml to the version this script prints.
#
# Usage: sdk/scripts/gen_proto.sh            (from anywhere; needs python3 >= 3.11 and PyPI)
set -euo pipefail

GRPCIO_TOOLS_VERSION="1.74.0"

SDK_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

"$PYTHON" -m venv "$WORK/venv"
"$WORK/venv/bin/pip" install --quiet "grpcio-tools==${GRPCIO_TOOLS_VERSION}"

cd "$SDK_DIR"
"$WORK/venv/bin/python" -m grpc_tools.protoc \
    --proto_path=. \
    --python_out=. \
    --pyi_out=. \
    treadle/proto/treadle_wire.proto

gencode="$(sed -n 's/^# Protobuf Python Version: //p' treadle/proto/treadle_wire_pb2.py)"
echo "generated treadle/proto/treadle_wire_pb2.py{,i} with grpcio-tools ${GRPCIO_TOOLS_VERSION};"
echo "gencode requires protobuf >= ${gencode} (keep sdk/pyproject.toml in step)"
