"""Identifier formats (DESIGN §3). Ids never contain `/` or `:` except where the format says."""

from __future__ import annotations

import secrets
import uuid


def new_session_id() -> str:
    return str(uuid.uuid4())


def new_tenant_id() -> str:
    return "tn_" + secrets.token_hex(8)


def new_request_id() -> str:
    return "req_" + secrets.token_hex(12)


def training_run_id(session_id: str, model_seq_id: int) -> str:
    return f"{session_id}:train:{model_seq_id}"


def sampling_session_id(session_id: str, seq: int) -> str:
    return f"{session_id}:sample:{seq}"
