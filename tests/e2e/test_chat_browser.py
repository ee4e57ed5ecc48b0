"""The chat page in a real browser (the system's chromium, driven by Playwright) against an
embedded server: a wrong key shows the server's refusal; a tenant's key lists its live training
run first; a message to the run streams its answer into the page chunk by chunk, with a finish
reason and usage; an error event after the answer started shows it cut off; the key travels
only in the Authorization header and survives a reload of the tab."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from typing import Any

import pytest
import tinker

from tests.builders import TenantKey
from tests.scenarios import MODEL
from tests.server import LiveServer

pytestmark = pytest.mark.e2e

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    pytest.skip(
        "no chromium binary on PATH (chromium or chromium-browser)", allow_module_level=True
    )

from playwright.sync_api import Page, Request, expect, sync_playwright  # noqa: E402

# Counts the text appended to the newest answer, one record per appended chunk.
WATCH_APPENDS = """() => {
  window.appends = 0;
  new MutationObserver((records) => {
    for (const r of records) {
      if (r.target.classList && r.target.classList.contains("assistant")) {
        window.appends += r.addedNodes.length;
      }
    }
  }).observe(document.getElementById("transcript"), { childList: true, subtree: true });
}"""


@pytest.fixture(scope="module")
def tenant(live_server: LiveServer) -> TenantKey:
    return live_server.make_tenant()


@pytest.fixture(scope="module")
def live_run(live_server: LiveServer, tenant: TenantKey) -> Iterator[str]:
    """A training run of the tenant's, active while the module runs: `live:<run id>`."""
    service = tinker.ServiceClient(base_url=live_server.base_url, api_key=tenant.key)
    trainer = service.create_lora_training_client(base_model=MODEL, rank=2, seed=5).result()
    trainer.save_weights_for_sampler("chat").result()  # a checkpoint too, listed after the run
    yield f"live:{trainer.model_id}"
    service.close("success").result(timeout=60)


@pytest.fixture
def page() -> Iterator[Page]:
    assert CHROMIUM is not None
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield browser.new_page()
        finally:
            browser.close()


def test_chat_with_a_live_run_streams_its_answer(
    live_server: LiveServer, tenant: TenantKey, live_run: str, page: Page
) -> None:
    requests: list[Request] = []
    page.on("request", lambda r: requests.append(r))
    problems: list[str] = []
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.goto(f"{live_server.base_url}/chat")

    page.fill("#key", "tml-000000000000-wrong")
    page.click("#login-button")
    expect(page.locator("#login-error")).to_contain_text("401")
    expect(page.locator("#chat-panel")).to_be_hidden()
    problems.clear()  # the browser logs the refused fetch itself

    page.fill("#key", tenant.key)
    page.click("#login-button")
    expect(page.locator("#chat-panel")).to_be_visible()
    options: list[dict[str, Any]] = page.eval_on_selector_all(
        "#models option", "os => os.map(o => ({id: o.value, group: o.parentElement.label}))"
    )
    ids = [o["id"] for o in options]
    assert ids[0] == live_run and page.input_value("#models") == live_run, ids
    groups = [o["group"] for o in options]
    assert groups == sorted(
        groups, key=["Live training runs", "Checkpoints and sessions", "Base models"].index
    )
    assert "Checkpoints and sessions" in groups and MODEL in ids

    page.fill("#temperature", "0")  # greedy: the same answer every run
    page.fill("#max-tokens", "12")
    page.evaluate(WATCH_APPENDS)
    page.fill("#message", "hello there")
    with page.expect_response(lambda r: r.url.endswith("/chat/completions")) as streamed:
        page.press("#message", "Enter")
    expect(page.locator("#finish")).to_contain_text("finish: ", timeout=120_000)
    assert page.text_content("#finish") in ("finish: stop", "finish: length")
    expect(page.locator("#usage")).to_contain_text("completion")
    assert page.text_content("#transcript li.user") == "hello there"
    answer = page.locator("#transcript li.assistant")
    expect(answer).to_have_count(1)
    expect(answer).not_to_have_class("assistant streaming")
    text = answer.text_content() or ""
    appended = page.evaluate("window.appends")
    assert text, "the greedy answer is empty: pick a prompt the tiny model answers"
    # One append per chunk the server sent with content, in the order sent.
    lines = streamed.value.text().splitlines()
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    pieces = [
        c["delta"]["content"] for e in events for c in e["choices"] if c["delta"].get("content")
    ]
    assert appended == len(pieces) and "".join(pieces) == text
    assert page.input_value("#message") == ""
    assert not problems, problems

    # The key went in the Authorization header of every API call and in no URL.
    api_calls = [r for r in requests if "/oai/v1/" in r.url]
    assert {r.url.split("/oai/v1/")[1] for r in api_calls} == {"models", "chat/completions"}
    assert all(tenant.key not in r.url for r in requests)
    sent = [r for r in api_calls if r.headers.get("authorization") == f"Bearer {tenant.key}"]
    assert len(sent) == len(api_calls) - 1  # all but the wrong key's attempt

    # The tab keeps the key: a reload is logged in; logging out forgets it.
    page.reload()
    expect(page.locator("#chat-panel")).to_be_visible()
    page.click("#logout")
    expect(page.locator("#login-panel")).to_be_visible()
    assert page.evaluate("sessionStorage.length") == 0


def test_an_error_after_the_answer_started_shows_it_cut_off(
    live_server: LiveServer,
    tenant: TenantKey,
    live_run: str,
    page: Page,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Progress published by hand that the result does not continue (as after a worker failure
    re-chose the tokens) makes the server end the stream with an error event."""
    notifier = live_server.app.state.treadle.notifier
    watch_progress = notifier.watch_progress

    def watch_with_false_start(op_id: str) -> Any:
        watch = watch_progress(op_id)
        notifier.publish_progress(op_id, {0: (0, list(range(300, 340)))})
        return watch

    monkeypatch.setattr(notifier, "watch_progress", watch_with_false_start)
    page.goto(f"{live_server.base_url}/chat")
    page.fill("#key", tenant.key)
    page.click("#login-button")
    expect(page.locator("#chat-panel")).to_be_visible()
    page.fill("#max-tokens", "12")
    page.fill("#message", "hello there")
    page.press("#message", "Enter")
    expect(page.locator("#chat-error")).to_contain_text("The answer was cut off", timeout=120_000)
    expect(page.locator("#chat-error")).to_contain_text("chose other tokens")
    answer = page.locator("#transcript li.assistant")
    expect(answer).not_to_have_class("assistant streaming")
    assert page.text_content("#finish") == ""
