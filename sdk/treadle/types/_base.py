"""Base classes for wire types.

Requests forbid unknown fields so a typo in a client surfaces as a clear 422 instead of being
silently ignored; responses ignore unknown fields so older clients keep working against newer
servers.

JSON has no NaN or infinities: both kinds write them as the strings "NaN", "Infinity" and
"-Infinity", which pydantic (the tinker SDK's models and these alike) reads back as floats.
"""

from pydantic import BaseModel, ConfigDict


class WireRequest(BaseModel):
    # protected_namespaces=(): the protocol has many `model_*` fields (model_id, model_input...).
    model_config = ConfigDict(
        extra="forbid",
        populate_by_name=True,
        protected_namespaces=(),
        ser_json_inf_nan="strings",
    )


class WireResponse(BaseModel):
    model_config = ConfigDict(
        extra="ignore",
        populate_by_name=True,
        protected_namespaces=(),
        ser_json_inf_nan="strings",
    )
