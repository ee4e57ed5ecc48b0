"""Base classes for wire types.

Requests forbid unknown fields so a typo in a client surfaces as a clear 422 instead of being
silently ignored; responses ignore unknown fields so older clients keep working against newer
servers.
"""

from pydantic import BaseModel, ConfigDict


class WireRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class WireResponse(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
