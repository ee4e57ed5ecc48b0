"""How a TrainingClient's operations travel: seq ids, ordered POSTs, chunks, results.

`RunOps` reserves seq ids on the caller's thread (so call order is execution order), encodes
forward_backward batches there too (so bad data raises before an id is taken), then POSTs on
the background loop in seq order and polls the results concurrently.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import httpx
import zstandard
from pydantic import BaseModel

from treadle._checks import build, check_items, check_type, optional
from treadle._polling import retrieve, spawn_tallied, submit
from treadle._session import Session
from treadle.client._chunks import merge_outputs, split_batch
from treadle.client._custom_loss import CustomLossFn, custom_output, surrogate_data
from treadle.client._sequencer import Sequencer
from treadle.errors import InvalidArgumentError
from treadle.futures import APIFuture
from treadle.proto import treadle_wire_pb2 as pb
from treadle.types import Datum, ForwardBackwardOutput, ForwardBackwardRequest, UntypedAPIFuture
from treadle.wire import PROTOBUF_CONTENT_TYPE, decode_forward_backward_output
from treadle.wire import encode_forward_backward_request as _encode

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


class RunOps:
    """Submission machinery for one training run."""

    def __init__(
        self,
        session: Session,
        model_id: str,
        *,
        max_chunk_len: int,
        max_chunk_bytes: int,
        compress: bool = False,
    ) -> None:
        self._session = session
        self._conn = session.connection
        self.model_id = model_id
        self._seq = Sequencer(1)
        self.max_chunk_len = max_chunk_len
        self.max_chunk_bytes = max_chunk_bytes
        self._compress = compress

    def reserve(self, count: int) -> int:
        return self._seq.reserve(count)

    def spawn(self, coro: Coroutine[Any, Any, T]) -> APIFuture[T]:
        return spawn_tallied(self._conn.loop, coro)

    def encode(
        self,
        chunk: list[Datum],
        loss_fn: str,
        config: dict[str, float | str] | None,
        *,
        forward_only: bool,
    ) -> bytes:
        call = "forward" if forward_only else "forward_backward"
        request = build(
            call,
            ForwardBackwardRequest,
            model_id=self.model_id,
            seq_id=0,
            data=chunk,
            loss_fn=loss_fn,
            loss_fn_config=config,
            forward_only=forward_only,
        )
        try:
            return _encode(request)
        except (ValueError, TypeError) as exc:
            raise InvalidArgumentError(f"{call}: a datum cannot be encoded: {exc}") from exc

    def forward_backward(
        self,
        data: Sequence[Datum],
        loss_fn: str,
        config: dict[str, float | str] | None,
        *,
        forward_only: bool,
    ) -> APIFuture[ForwardBackwardOutput]:
        call = "forward" if forward_only else "forward_backward"
        check_items(call, "data", data, Datum)
        check_type(call, "loss_fn", loss_fn, str)
        check_type(call, "loss_fn_config", config, optional(dict))
        chunks = split_batch(data, self.max_chunk_len, self.max_chunk_bytes)
        # Encoded here, so bad data raises before a seq id is taken.
        bodies = [
            self.encode(chunk, loss_fn, config, forward_only=forward_only) for chunk in chunks
        ]
        first = self._seq.reserve(len(bodies))
        return self.spawn(self.run_chunks(first, bodies))

    async def run_chunks(self, first: int, bodies: list[bytes]) -> ForwardBackwardOutput:
        handles = []
        async with self._seq.turn(first, len(bodies)):
            await self._session.ensure()
            for i, body in enumerate(bodies):
                handles.append(await self.post_forward_backward(first + i, body))
        outputs = await asyncio.gather(
            *(
                retrieve(
                    self._conn.http,
                    h.request_id,
                    _decode_fb,
                    request_type="ForwardBackward",
                    protobuf=True,
                )
                for h in handles
            )
        )
        return merge_outputs(outputs)

    async def post_forward_backward(self, seq_id: int, body: bytes) -> UntypedAPIFuture:
        # Protobuf fields may repeat and the last wins: appending seq_id is setting it.
        body = body + pb.ForwardBackwardRequest(seq_id=seq_id).SerializeToString()
        headers = {"Content-Type": PROTOBUF_CONTENT_TYPE}
        if self._compress:
            body = zstandard.ZstdCompressor().compress(body)
            headers["Content-Encoding"] = "zstd"
        return await submit(
            self._conn.http, "/api/v1/forward_backward", content=body, headers=headers
        )

    async def run_custom(
        self,
        first: int,
        chunks: list[list[Datum]],
        bodies: list[bytes],
        data: list[Datum],
        loss_fn: CustomLossFn,
    ) -> ForwardBackwardOutput:
        n = len(chunks)
        try:
            forward = await self.run_chunks(first, bodies)
            backward_data, metrics, loss_value = await asyncio.to_thread(
                surrogate_data, data, forward, loss_fn
            )
        except BaseException:
            # Fill the reserved backward ids with harmless forward passes, so the server does
            # not wait for them and later operations of this run go ahead.
            with contextlib.suppress(Exception):
                await self.run_chunks(first + n, bodies)
            raise
        sizes = [len(c) for c in chunks]
        offsets = [sum(sizes[:i]) for i in range(n)]
        backward_bodies = await asyncio.to_thread(
            lambda: [
                self.encode(backward_data[o : o + s], "cross_entropy", None, forward_only=False)
                for o, s in zip(offsets, sizes, strict=True)
            ]
        )
        backward = await self.run_chunks(first + n, backward_bodies)
        return custom_output(backward, metrics, loss_value)

    def json_op(
        self, path: str, body: dict[str, Any], result_type: type[M], request_type: str
    ) -> APIFuture[M]:
        seq_id = self._seq.reserve()
        payload = {k: v for k, v in body.items() if v is not None}
        payload.update(model_id=self.model_id, seq_id=seq_id, type=path.rsplit("/", 1)[-1])

        async def run() -> M:
            async with self._seq.turn(seq_id):
                await self._session.ensure()
                handle = await submit(self._conn.http, path, json=payload)
            return await retrieve(
                self._conn.http,
                handle.request_id,
                lambda response: result_type.model_validate(response.json()),
                request_type=request_type,
            )

        return self.spawn(run())


def _decode_fb(response: httpx.Response) -> ForwardBackwardOutput:
    if "json" in response.headers.get("content-type", ""):
        return ForwardBackwardOutput.model_validate(response.json())
    return decode_forward_backward_output(response.content)
