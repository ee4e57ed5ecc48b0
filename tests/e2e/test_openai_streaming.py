"""`/oai/v1` streams text while the model generates, through the official `openai` client: per
choice the streamed deltas add up to exactly the unstreamed answer of the same seeded request
(stop strings and end-of-turn held back), deltas arrive while the op still runs, and a result
that does not continue the text already sent ends the stream with an error, never wrong text."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from sqlalchemy import select

from core.tables import Operation, OpStatus
from scheduler.notify import ProgressWatch
from tests.builders import TenantKey
from tests.scenarios import MODEL
from tests.server import LiveServer

pytestmark = pytest.mark.e2e

HELLO = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def tenant(live_server: LiveServer) -> TenantKey:
    return live_server.make_tenant()


@pytest.fixture(scope="module")
def client(live_server: LiveServer, tenant: TenantKey) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{live_server.base_url}/oai/v1", api_key=tenant.key, max_retries=0
    )


def _gathered(stream: Any, n: int) -> tuple[list[str], list[str | None], Any, int]:
    """Each choice's concatenated content and finish reason, the usage, and how many chunks
    carried content."""
    texts, reasons, usage, deltas = [""] * n, [None] * n, None, 0
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            if piece:
                texts[choice.index] += piece
                deltas += 1
            if choice.finish_reason is not None:
                assert reasons[choice.index] is None, "a choice finished twice"
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, usage, deltas


def _a_stop_string(client: openai.OpenAI) -> str:
    """Two characters the seeded answer below writes after its start, so one choice stops."""
    free = client.completions.create(model=MODEL, prompt="once upon", max_tokens=40, seed=11, n=2)
    text = max((c.text for c in free.choices), key=len).strip()
    if len(text) < 4:
        pytest.skip("the tiny model wrote no text to stop on")
    return text[2:4]


def test_streamed_completions_equal_the_unstreamed_ones(client: openai.OpenAI) -> None:
    stop = _a_stop_string(client)
    asked: dict[str, Any] = {
        "model": MODEL,
        "prompt": "once upon",
        "max_tokens": 40,
        "seed": 11,
        "n": 2,
        "stop": [stop],
    }
    whole = client.completions.create(**asked)
    streamed = client.completions.create(
        **asked, stream=True, stream_options={"include_usage": True}
    )
    texts, reasons, usage, _ = _gathered(streamed, 2)
    assert texts == [c.text for c in whole.choices]
    assert reasons == [c.finish_reason for c in whole.choices]
    assert "stop" in reasons and not any(stop in t for t in texts)
    assert usage == whole.usage


def test_streamed_chat_equals_the_unstreamed_one(client: openai.OpenAI) -> None:
    asked: dict[str, Any] = {"model": MODEL, "messages": HELLO, "max_tokens": 40, "seed": 5, "n": 2}
    whole = client.chat.completions.create(**asked)
    text = max((c.message.content or "" for c in whole.choices), key=len).strip()
    if len(text) >= 4:  # a stop string that cuts one of the answers
        asked["stop"] = [text[2:4]]
        whole = client.chat.completions.create(**asked)
    streamed = client.chat.completions.create(
        **asked, stream=True, stream_options={"include_usage": True}
    )
    texts, reasons, usage, _ = _gathered(streamed, 2)
    assert texts == [c.message.content for c in whole.choices]
    assert reasons == [c.finish_reason for c in whole.choices]
    assert usage == whole.usage


def test_text_arrives_while_the_op_still_runs(
    live_server: LiveServer, client: openai.OpenAI, tenant: TenantKey
) -> None:
    stream = client.completions.create(
        model=MODEL, prompt="once upon", max_tokens=400, seed=2, n=4, stream=True
    )
    status, deltas = None, 0
    for chunk in stream:
        if any(c.text for c in chunk.choices) and status is None:
            with live_server.database.reader() as db:
                status = db.scalar(
                    select(Operation.status)
                    .where(Operation.tenant_id == tenant.tenant_id, Operation.kind == "sample")
                    .order_by(Operation.created_at.desc())
                    .limit(1)
                )
        deltas += sum(1 for c in chunk.choices if c.text)
    # Four choices of up to 400 tokens take many decode steps: the first text came with the
    # first progress, long before the result.
    assert status in (OpStatus.QUEUED, OpStatus.RUNNING)
    assert deltas > 4


def test_a_result_that_does_not_continue_the_streamed_text_ends_the_stream_with_an_error(
    live_server: LiveServer, client: openai.OpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As if the op were re-run after a worker failure and chose other tokens: progress that
    the result does not continue is published by hand before the real one."""
    notifier = live_server.app.state.treadle.notifier
    watch_progress = notifier.watch_progress

    def watch_with_false_start(op_id: str) -> ProgressWatch:
        watch = watch_progress(op_id)
        # Token ids of plain text no seeded answer of this test starts with.
        notifier.publish_progress(op_id, {0: (0, list(range(300, 340)))})
        return watch

    monkeypatch.setattr(notifier, "watch_progress", watch_with_false_start)
    stream = client.completions.create(
        model=MODEL, prompt="once upon", max_tokens=20, seed=3, stream=True
    )
    with pytest.raises(openai.APIError, match="chose other tokens"):
        for _ in stream:
            pass
