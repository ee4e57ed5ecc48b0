"""How rows look on the wire, for the routes that show them (routes never import each other)."""

from __future__ import annotations

import json
from typing import cast

from core import checkpoints
from core.tables import ModelPackage, ModelVersion
from treadle.types import Checkpoint, CheckpointType, RegistryFile, RegistryPackage, RegistryVersion
from treadle.types.registry import VersionStatus as RegistryVersionStatus


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


def package_view(package: ModelPackage, counts: tuple[int, int | None]) -> RegistryPackage:
    """`counts`: (versions not deleted, newest ready version), from `registry.version_counts`."""
    return RegistryPackage(
        name=package.name,
        description=package.description,
        tags=list(package.tags or []),
        base_model=package.base_model,
        training_run_id=package.training_run_id,
        version_count=counts[0],
        latest_version=counts[1],
        created_at=package.created_at,
        updated_at=package.updated_at,
    )


def version_view(
    version: ModelVersion, package: str, refs: dict[str, str], aliases: list[str]
) -> RegistryVersion:
    """`refs`: `<package>:<number>` of its parent and source versions (`registry.version_refs`)."""
    return RegistryVersion(
        package=package,
        version=version.version,
        kind=version.kind,
        status=cast(RegistryVersionStatus, str(version.status)),
        tinker_path=version.tinker_path,
        training_run_id=version.training_run_id,
        session_id=version.session_id,
        step=version.step,
        seq_id=version.seq_id,
        parent_version=refs.get(version.parent_version_id or ""),
        source_version=refs.get(version.source_version_id or ""),
        base_model=version.base_model,
        base_revision=version.base_revision,
        lora_config=version.lora_config,
        tokens_trained=version.tokens_trained,
        files=[RegistryFile.model_validate(f) for f in version.files or []] or None,
        size_bytes=version.size_bytes,
        sha256=version.sha256,
        created_by_key_id=version.created_by_key_id,
        user_metadata=version.user_metadata,
        expires_at=version.expires_at,
        created_at=version.created_at,
        aliases=aliases,
    )
