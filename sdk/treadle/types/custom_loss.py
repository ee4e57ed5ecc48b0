"""Server-side custom losses (`/create_custom_loss`): a torch.fx trace shipped as plain data.

Only used when the server's client config enables `custom_loss_server_side`. The graph is
data, never code: a server rebuilds it from its own list of allowed operations. Node
arguments use a small JSON encoding (`{"ref": name}` for a node, `{"tuple": [...]}`,
`{"float": "inf"}`, ...) documented by the tinker SDK; they are kept as opaque JSON here.
"""

from __future__ import annotations

from typing import Any, Literal, TypeAlias

from pydantic import Field

from treadle.types._base import WireRequest, WireResponse
from treadle.types.bounds import ServerId, SessionCounter

CustomLossNodeOp: TypeAlias = Literal[
    "placeholder", "get_attr", "call_function", "call_method", "call_module", "output"
]


class CustomLossInput(WireRequest):
    name: str
    """`logprobs`, or the loss_fn_inputs key the loss reads."""
    rank: Literal[0, 1, 2]
    """0: scalar, 1: `[T]`, 2: `[T, K]`."""


class CustomLossNode(WireRequest):
    op: CustomLossNodeOp
    name: str
    target: str
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)


class CustomLossGraph(WireRequest):
    format: Literal[1] = 1
    nodes: list[CustomLossNode]


class CreateCustomLossRequest(WireRequest):
    session_id: ServerId
    custom_loss_seq_id: SessionCounter
    name: str
    inputs: list[CustomLossInput]
    graph: CustomLossGraph
    type: Literal["create_custom_loss"] = "create_custom_loss"


class CreateCustomLossResponse(WireResponse):
    loss_id: str
    """Passed back as `loss_fn_config["loss_id"]` with `loss_fn="custom"`."""
    type: Literal["create_custom_loss"] = "create_custom_loss"
