"""Op payloads are compressed and decompressed on many threads at once (the API's thread pool,
the engine thread) without sharing zstd objects, whose concurrent use crashes the process."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

HAMMER = """
import threading
from scheduler.ops import decode_json_payload, decode_payload, encode_json_payload, encode_proto_payload

def work(worker):
    for i in range(2000):
        body = {"worker": worker, "i": i, "text": "x" * (i % 700)}
        assert decode_json_payload(*encode_json_payload(body)) == body
        raw = bytes([worker]) * (i % 900 + 1)
        payload, codec = encode_proto_payload(raw)
        assert decode_payload(payload, codec) == raw

threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print("ok")
"""


def test_payload_codecs_are_safe_on_many_threads() -> None:
    # In a child process: a crash there (SIGSEGV) is a failure here, not the end of the suite.
    done = subprocess.run(
        [sys.executable, "-c", HAMMER], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
