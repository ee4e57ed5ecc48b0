"""What the tinker SDK costs by itself: its tiny-op round trip against a server that does nothing.

`python bench/_sdk_floor.py PORT` serves the few routes a training client needs (client config,
session, heartbeat, create_model, get_info, optim_step, retrieve_future), each answered at once
from memory by a bare ASGI app: no framework, no database, no engine. An optim_step awaited
through the SDK against it costs the SDK's own work (its event-loop thread, request building,
response parsing) plus two minimal HTTP round trips. The benchmarks measure it in the same run as
Treadle's round trip: no server can answer the SDK faster than this on the same machine.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx

_MODEL_ID = "floor:train:0"
_ids = itertools.count()
_results: dict[str, dict[str, Any]] = {}


def _answer(path: str, request: dict[str, Any]) -> dict[str, Any]:
    route = path.rsplit("/", 1)[-1]
    if route in ("config", "dynamic_config"):
        return {"use_pyqwest_transport": False} if route == "config" else {}
    if route == "create_session":
        return {"session_id": "floor"}
    if route == "get_info":
        return {"model_id": _MODEL_ID, "model_data": {"arch": "floor", "model_name": "floor"}}
    if route in ("create_model", "optim_step"):
        request_id = f"floor-{next(_ids)}"
        _results[request_id] = {"model_id": _MODEL_ID} if route == "create_model" else {}
        return {"request_id": request_id, "model_id": _MODEL_ID}
    if route == "retrieve_future":
        return _results.pop(request["request_id"])
    return {}  # healthz, session_heartbeat


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    data = json.dumps(_answer(scope["path"], json.loads(body) if body else {})).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": data})


@contextlib.contextmanager
def floor_server(port: int) -> Iterator[str]:
    """The do-nothing server in its own process (so it never shares the client's interpreter
    lock), on 127.0.0.1:port; yields its URL."""
    proc = subprocess.Popen([sys.executable, __file__, str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"{url}/api/v1/healthz").raise_for_status()
                break
            except httpx.TransportError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the SDK floor server did not start") from None
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
