"""ModelInput: what a model reads, as a list of typed chunks.

Chunks are discriminated by `type`: token ids (`encoded_text`), inline images (`image`, bytes
sent as base64 in JSON), images by reference (`image_asset_pointer`, JSON only: the protobuf
forward_backward body cannot carry them) and audio frames (`dmel`, an opaque serialized
TensorContainer). Only token chunks have a length without server-side work; image chunks need
`expected_tokens`, and dmel chunks report the first dimension of their container header.
"""

from __future__ import annotations

import base64
from typing import Annotated, Any, Literal, TypeAlias

from pydantic import Field, field_serializer, field_validator

from treadle.types._base import WireRequest

ImageFormat: TypeAlias = Literal["png", "jpeg"]


def _decode_base64(value: Any) -> Any:
    # JSON carries bytes as base64 text; Python callers pass raw bytes.
    if isinstance(value, str):
        try:
            return base64.b64decode(value, validate=True)
        except ValueError as exc:
            raise ValueError("expected base64-encoded bytes") from exc
    return value


class EncodedTextChunk(WireRequest):
    tokens: list[int]
    type: Literal["encoded_text"] = "encoded_text"

    @property
    def length(self) -> int:
        return len(self.tokens)


class ImageChunk(WireRequest):
    data: bytes
    format: ImageFormat
    expected_tokens: int | None = None
    """Advisory token count; the server computes the real one and may reject a mismatch."""
    type: Literal["image"] = "image"

    @field_validator("data", mode="before")
    @classmethod
    def _decode_data(cls, value: Any) -> Any:
        return _decode_base64(value)

    @field_serializer("data", when_used="json")
    def _encode_data(self, value: bytes) -> str:
        return base64.b64encode(value).decode("ascii")

    @property
    def length(self) -> int:
        if self.expected_tokens is None:
            raise ValueError("an image chunk's length is unknown until expected_tokens is set")
        return self.expected_tokens


class ImageAssetPointerChunk(WireRequest):
    format: ImageFormat
    location: str
    expected_tokens: int | None = None
    type: Literal["image_asset_pointer"] = "image_asset_pointer"

    @property
    def length(self) -> int:
        if self.expected_tokens is None:
            raise ValueError(
                "an image_asset_pointer chunk's length is unknown until expected_tokens is set"
            )
        return self.expected_tokens


class DmelChunk(WireRequest):
    dmel: bytes
    """A serialized TensorContainer holding the audio token tensor; passed through unread."""
    type: Literal["dmel"] = "dmel"

    @field_validator("dmel", mode="before")
    @classmethod
    def _decode_dmel(cls, value: Any) -> Any:
        return _decode_base64(value)

    @field_serializer("dmel", when_used="json")
    def _encode_dmel(self, value: bytes) -> str:
        return base64.b64encode(value).decode("ascii")

    @property
    def length(self) -> int:
        return dmel_frame_count(self.dmel)


ModelInputChunk: TypeAlias = Annotated[
    EncodedTextChunk | ImageChunk | ImageAssetPointerChunk | DmelChunk,
    Field(discriminator="type"),
]


class ModelInput(WireRequest):
    """What the model reads: a sequence of chunks, usually one chunk of token ids.

    Build it with `ModelInput.from_ints(token_ids)`; `to_ints()` gives the ids back and
    `length` counts the positions.

    Attributes:
        chunks: token chunks (`EncodedTextChunk`) and, for models that take them, images.
    """

    chunks: list[ModelInputChunk]

    @classmethod
    def from_ints(cls, tokens: list[int]) -> ModelInput:
        return cls(chunks=[EncodedTextChunk(tokens=list(tokens))])

    @classmethod
    def empty(cls) -> ModelInput:
        return cls(chunks=[])

    def to_ints(self) -> list[int]:
        """All token ids in order.

        Raises:
            ValueError: when a chunk is not `encoded_text`.
        """
        tokens: list[int] = []
        for chunk in self.chunks:
            if not isinstance(chunk, EncodedTextChunk):
                raise ValueError(
                    f"to_ints needs token chunks only, but this input has a {chunk.type!r} chunk"
                )
            tokens.extend(chunk.tokens)
        return tokens

    @property
    def length(self) -> int:
        """Context length used by this input (tokens plus image and audio positions)."""
        return sum(chunk.length for chunk in self.chunks)

    def append(self, chunk: ModelInputChunk) -> ModelInput:
        """A new ModelInput with `chunk` added at the end."""
        return ModelInput(chunks=[*self.chunks, chunk])

    def append_int(self, token: int) -> ModelInput:
        return self.append(EncodedTextChunk(tokens=[token]))


_CONSTANT_TENSOR_MARKER = 254
_MAX_DTYPE_BYTE = 7


def dmel_frame_count(container: bytes) -> int:
    """First dimension of a serialized TensorContainer, read from its header only.

    Header layout: an optional constant-tensor marker byte (254), a dtype byte (0..7), a
    varint rank, then one varint per dimension.
    """
    pos = 0
    if container[:1] == bytes([_CONSTANT_TENSOR_MARKER]):
        pos = 1
    if pos >= len(container) or container[pos] > _MAX_DTYPE_BYTE:
        raise ValueError("dmel chunk does not start with a TensorContainer header")
    pos += 1
    rank, pos = _read_varint(container, pos)
    if rank < 1:
        raise ValueError("dmel TensorContainer has rank 0; it needs a frame dimension")
    frames, _ = _read_varint(container, pos)
    return frames


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("dmel TensorContainer header is truncated")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
