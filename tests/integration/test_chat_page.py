"""The chat page (`GET /chat`) as the server sends it: static files needing no key, a strict
Content-Security-Policy, no framing, nothing loaded from another origin, no inline script or
style, and model output never parsed as HTML. tests/e2e/test_chat_browser.py drives it in a
browser."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from tests.server import AppFactory

pytestmark = pytest.mark.integration

# A URL with a scheme or a protocol-relative one (`//host/...`) in an attribute, string or url().
EXTERNAL = re.compile(r"[a-z][a-z0-9+.-]*://|[\"'(=]\s*//", re.IGNORECASE)


@pytest.fixture
def client(app_factory: AppFactory) -> Iterator[TestClient]:
    with TestClient(app_factory()) as client:
        yield client


def _directives(policy: str) -> dict[str, str]:
    return {d.split()[0]: " ".join(d.split()[1:]) for d in policy.split(";") if d.strip()}


def test_the_page_and_its_files_need_no_key_and_refer_only_to_this_server(
    client: TestClient,
) -> None:
    page = client.get("/chat")
    assert page.status_code == 200, page.text
    assert page.headers["content-type"].startswith("text/html")
    assert page.headers["x-frame-options"] == "DENY"
    assert page.headers["x-content-type-options"] == "nosniff"
    policy = _directives(page.headers["content-security-policy"])
    assert policy["default-src"] == "'self'"
    assert policy["frame-ancestors"] == "'none'"
    for directive in ("default-src", "script-src", "style-src", "connect-src"):
        assert policy.get(directive, "'self'") == "'self'", (directive, policy)
    assert "unsafe" not in page.headers["content-security-policy"]

    html = page.text
    sources = re.findall(r"""(?:src|href)\s*=\s*["']([^"']*)["']""", html)
    assert sorted(sources) == ["/chat/chat.css", "/chat/chat.js"]
    assert 'data-api="/oai/v1"' in html
    # No inline script, handler or style: the policy would refuse them.
    assert re.findall(r"<script\b[^>]*>", html) == ['<script src="/chat/chat.js" defer>']
    assert [b.strip() for b in re.findall(r"<script\b[^>]*>(.*?)</script>", html, re.S)] == [""]
    assert re.search(r"\son[a-z]+\s*=|\sstyle\s*=|<style", html, re.IGNORECASE) is None

    texts = {"page": html}
    for name, media in (("chat.js", "text/javascript"), ("chat.css", "text/css")):
        response = client.get(f"/chat/{name}")
        assert response.status_code == 200, response.text
        assert response.headers["content-type"].startswith(media)
        assert response.headers["x-content-type-options"] == "nosniff"
        texts[name] = response.text
    for name, text in texts.items():
        assert EXTERNAL.findall(text) == [], name

    script = texts["chat.js"]
    # Model and server text is shown as text only.
    assert re.search(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write", script) is None
    assert "textContent" in script
    # The key goes in the Authorization header and the tab's session storage, nowhere else.
    assert "Authorization: `Bearer ${key}`" in script
    assert "localStorage" not in script and "document.cookie" not in script


def test_other_names_under_the_page_are_not_found(client: TestClient) -> None:
    for name in ("chat.html", "routes.py", "missing.js"):
        response = client.get(f"/chat/{name}")
        assert response.status_code == 404, (name, response.text)
        assert "chat.css, chat.js" in response.json()["detail"]
    assert client.get("/chat/..%2Froutes%2Fchat.py").status_code == 404


def test_the_page_follows_the_servers_root_path(app_factory: AppFactory) -> None:
    with TestClient(app_factory(), root_path="/treadle") as client:
        html = client.get("/chat").text
    assert 'href="/treadle/chat/chat.css"' in html
    assert 'src="/treadle/chat/chat.js"' in html
    assert 'data-api="/treadle/oai/v1"' in html


def test_the_page_is_not_part_of_the_api_document(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    assert not [p for p in paths if p.startswith("/chat")]
