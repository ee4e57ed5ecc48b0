"""How rows look on the wire, for the routes that show them (routes never import each other)."""

from __future__ import annotations

import json
from typing import cast

from core import checkpoints
from core.tables import ModelVersion
from treadle.types import Checkpoint, CheckpointType


def string_metadata(metadata: dict[str, object] | None) -> dict[str, str] | None:
    """The wire types carry `{str: str}`; other JSON values are sent as their JSON text."""
    if metadata is None:
        return None
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()}


def checkpoint_view(version: ModelVersion) -> Checkpoint:
    assert version.tinker_path is not None
    _, kind, name = checkpoints.parse_tinker_path(version.tinker_path)
    return Checkpoint(
        checkpoint_id=f"{checkpoints.SEGMENT_BY_KIND[kind]}/{name}",
        checkpoint_type=cast(CheckpointType, kind),
        time=version.created_at,
        tinker_path=version.tinker_path,
        size_bytes=version.size_bytes,
        public=version.public,
        user_metadata=string_metadata(version.user_metadata),
        expires_at=version.expires_at,
    )
