"""The model registry's wire types (a Treadle extension under `/api/v1/registry/`).

A package is a named family of versions; a version is one immutable saved artifact (a save of a
training run, or a promotion of another version); an alias is a movable name for one version
of a package (`latest`, the newest ready and unexpired version with its files, is kept by the
registry). References `<package>@<alias>` and `<package>:<version>` name versions wherever a
tinker path is accepted.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal, TypeAlias

from pydantic import Field

from treadle.types._base import WireRequest, WireResponse
from treadle.types.bounds import BaseModelName, ServerId
from treadle.types.checkpoints import Cursor

PackageName: TypeAlias = Annotated[
    str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,199}$", min_length=1, max_length=200)
]
"""1 to 200 letters, digits, `.`, `_`, `-` or `:`, starting with a letter or digit."""
Tag: TypeAlias = Annotated[
    str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$", min_length=1, max_length=64)
]
Description: TypeAlias = Annotated[str, Field(max_length=4000)]
VersionStatus: TypeAlias = Literal["pending", "ready", "failed", "deleted"]
LineageRelation: TypeAlias = Literal["saved", "loaded", "promoted"]


class RegistryPackage(WireResponse):
    name: str
    description: str | None = None
    tags: list[str] = Field(default_factory=list)
    base_model: str
    training_run_id: str | None = None
    """The run whose saves register here, if any."""
    version_count: int = 0
    """Versions not deleted."""
    latest_version: int | None = None
    """The number of the newest ready, unexpired version with its files (`<name>@latest`)."""
    created_at: datetime
    updated_at: datetime | None = None


class RegistryPackagesResponse(WireResponse):
    packages: list[RegistryPackage]
    cursor: Cursor


class CreatePackageRequest(WireRequest):
    name: PackageName
    description: Description | None = None
    tags: list[Tag] = Field(default_factory=list, max_length=32)
    base_model: BaseModelName | None = None
    """Needed unless `training_run_id` is given (the package then takes the run's)."""
    training_run_id: ServerId | None = None
    """Make this the package the run's future saves register in (the run must have none)."""


class UpdatePackageRequest(WireRequest):
    """Fields left out stay as they are; `description: null` clears the description."""

    name: PackageName | None = None
    description: Description | None = None
    tags: list[Tag] | None = Field(default=None, max_length=32)


class RegistryFile(WireResponse):
    path: str
    size_bytes: int
    sha256: str


class RegistryVersion(WireResponse):
    package: str
    version: int
    kind: str
    """training | sampler | adapter | merged (exports made before adapters and merges were
    told apart read `external`)."""
    status: VersionStatus
    tinker_path: str | None = None
    """None for promoted versions and sampler snapshots: name them by reference."""
    training_run_id: str | None = None
    session_id: str | None = None
    step: int | None = None
    seq_id: int | None = None
    parent_version: str | None = None
    """`<package>:<version>` the run was loaded from before this save."""
    source_version: str | None = None
    """`<package>:<version>` this version was promoted from."""
    base_model: str | None = None
    base_revision: str | None = None
    lora_config: dict[str, Any] | None = None
    tokens_trained: int | None = None
    files: list[RegistryFile] | None = None
    size_bytes: int | None = None
    sha256: str | None = None
    created_by_key_id: str | None = None
    user_metadata: dict[str, Any] | None = None
    expires_at: datetime | None = None
    created_at: datetime
    aliases: list[str] = Field(default_factory=list)
    """Aliases pointing at this version, `latest` included."""


class RegistryVersionsResponse(WireResponse):
    versions: list[RegistryVersion]
    cursor: Cursor


class PromoteVersionRequest(WireRequest):
    target_package: PackageName
    """The package (of the same base model) that receives the new version."""


class SetAliasRequest(WireRequest):
    version: int = Field(ge=1, le=2**31 - 1)


class RegistryAlias(WireResponse):
    name: str
    version: int
    virtual: bool = False
    """True for `latest`, which follows the newest ready, unexpired version with its files and
    cannot be set."""
    updated_at: datetime | None = None


class RegistryAliasesResponse(WireResponse):
    aliases: list[RegistryAlias]


class LineageNode(WireResponse):
    id: str
    """`run:<training run id>` or `version:<version id>`."""
    kind: Literal["run", "version"]
    label: str
    """A run's id, or a version's `<package>:<version>`."""
    status: str
    created_at: datetime
    package: str | None = None
    version: int | None = None


class LineageEdge(WireResponse):
    source: str
    target: str
    relation: LineageRelation
    """saved: run → version; loaded: version → run loaded from it; promoted: source → copy."""


class LineageResponse(WireResponse):
    package: str
    nodes: list[LineageNode]
    edges: list[LineageEdge]
    truncated: bool = False
    """The walk stopped at the node bound; the graph is partial."""
