"""A process that opens sessions on fake servers and ends without `close()`, for
tests/sdk_client/test_exit_handling.py.

Usage: `python -m tests.sdk_client._exit_worker MODE CLIENTS`. Once the interpreter has shut
down, it prints one JSON line, `finish: [...]`, with the finish requests the servers received
(`{"session": ..., "reason": ..., "detail": ...}`). MODE:

* `exit` - return normally;
* `raise` - end on an uncaught exception;
* `unreachable` - every finish request is refused (the server went away);
* `own-sigterm` - a SIGTERM handler of the program's own, installed first, is sent SIGTERM; it
  prints `handled` and exits with status 3.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
from typing import Any

import httpx

import treadle
from tests.sdk_client.fake_server import FakeServer
from treadle._http import RetryPolicy

finishes: list[dict[str, Any]] = []
# Registered before any client exists: atexit hooks run after the SDK's exit hook.
atexit.register(lambda: print("finish:", json.dumps(finishes), flush=True))


def open_session(mode: str) -> treadle.ServiceClient:
    server = FakeServer()

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/finish"):
            if mode == "unreachable":
                raise httpx.ConnectError("connection refused", request=request)
            body = json.loads(request.content)
            finishes.append(
                {
                    "session": request.url.path.split("/")[-2],
                    "reason": body["reason"]["type"],
                    "detail": body["detail"],
                }
            )
        return server.handle(request)

    service = treadle.ServiceClient(
        base_url="http://fake",
        api_key="tml-test",
        transport=httpx.MockTransport(handle),
        retry=RetryPolicy(initial_backoff_seconds=0.05, max_backoff_seconds=0.2),
    )
    service.create_lora_training_client("tiny", rank=4)
    return service


def main(mode: str, clients: int) -> None:
    if mode == "own-sigterm":

        def own(signum: int, frame: object) -> None:
            print("handled", flush=True)
            sys.exit(3)

        signal.signal(signal.SIGTERM, own)
    services = [open_session(mode) for _ in range(clients)]
    print("ready", len(services), flush=True)
    if mode == "raise":
        raise RuntimeError("the training script failed")
    if mode == "own-sigterm":
        os.kill(os.getpid(), signal.SIGTERM)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
