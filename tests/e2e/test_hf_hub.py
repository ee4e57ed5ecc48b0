"""With `HF_ENDPOINT` pointed at the server, Hugging Face tooling loads served tokenizers from it.

`huggingface_hub` reads `HF_ENDPOINT` when it is imported, so each check runs in a fresh Python
with the environment set, its cache in a fresh `HF_HOME`, and no other hub reachable.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.scenarios import MODEL
from tests.server import LiveServer

pytestmark = pytest.mark.e2e

TEXT = "the cat sat on the mat, and then it was time"

TINKER = """
import json, sys, tinker
service = tinker.ServiceClient(base_url=sys.argv[1], api_key=sys.argv[2])
trainer = service.create_lora_training_client(base_model=sys.argv[3], rank=4).result()
tokenizer = trainer.get_tokenizer()
ids = tokenizer.encode(sys.argv[4])
print(json.dumps({"ids": ids, "text": tokenizer.decode(ids)}))
service.close("success").result(timeout=60)
"""

TRANSFORMERS = """
import json, sys
from huggingface_hub import list_repo_files, model_info
from transformers import AutoTokenizer
hub = AutoTokenizer.from_pretrained(sys.argv[1])
local = AutoTokenizer.from_pretrained(sys.argv[2])
info = model_info(sys.argv[1])
print(json.dumps({
    "files": list_repo_files(sys.argv[1]),
    "siblings": [s.rfilename for s in info.siblings],
    "sha": info.sha,
    "hub_ids": hub.encode(sys.argv[3]),
    "local_ids": local.encode(sys.argv[3]),
    "hub_vocab": hub.get_vocab() == local.get_vocab(),
    "class": [type(hub).__name__, type(local).__name__],
    "special": [hub.all_special_tokens, local.all_special_tokens],
}))
"""


def _run(script: str, args: list[str], endpoint: str, home: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env |= {"HF_ENDPOINT": endpoint, "HF_HOME": str(home), "TINKER_TELEMETRY": "0"}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-5_000:]
    answer: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return answer


def _published(server: LiveServer, folder: Path) -> Path:
    """The tokenizer files as the server publishes them through its own API."""
    headers = {"X-API-Key": server.make_tenant().key}
    root = f"{server.base_url}/api/v1/models/{MODEL}/tokenizer"
    folder.mkdir()
    for name in httpx.get(root, headers=headers).raise_for_status().json()["files"]:
        content = httpx.get(f"{root}/{name}", headers=headers).raise_for_status().content
        (folder / name).write_bytes(content)
    return folder


def test_tinker_get_tokenizer_loads_from_the_server(
    live_server: LiveServer, tmp_path: Path
) -> None:
    key = live_server.make_tenant().key
    answer = _run(
        TINKER,
        [live_server.base_url, key, MODEL, TEXT],
        f"{live_server.base_url}/hf",
        tmp_path / "hf",
    )
    assert answer["text"] == TEXT
    assert isinstance(answer["ids"], list) and len(answer["ids"]) > 1


def test_auto_tokenizer_equals_the_published_files(live_server: LiveServer, tmp_path: Path) -> None:
    local = _published(live_server, tmp_path / "published")
    answer = _run(
        TRANSFORMERS,
        [MODEL, str(local), TEXT],
        f"{live_server.base_url}/hf",
        tmp_path / "hf",
    )
    published = sorted(p.name for p in local.iterdir())
    assert answer["files"] == answer["siblings"] == published
    assert isinstance(answer["sha"], str) and len(answer["sha"]) == 40
    assert answer["hub_ids"] == answer["local_ids"]
    assert answer["hub_vocab"] is True
    hub_class, local_class = answer["class"]
    assert hub_class == local_class
    hub_special, local_special = answer["special"]
    assert hub_special == local_special


def test_hub_errors_name_what_is_missing(live_server: LiveServer) -> None:
    """Without a key, as on the hub: unknown repos, revisions and files answer its 404s."""
    hf = f"{live_server.base_url}/hf"
    cases = {
        f"{hf}/nobody/nothing/resolve/main/tokenizer.json": "RepoNotFound",
        f"{hf}/{MODEL}/resolve/v9/tokenizer.json": "RevisionNotFound",
        f"{hf}/{MODEL}/resolve/main/config.json": "EntryNotFound",
    }
    for url, code in cases.items():
        for method in ("GET", "HEAD"):
            response = httpx.request(method, url)
            assert response.status_code == 404, (method, url)
            assert response.headers["X-Error-Code"] == code, (method, url)
    head = httpx.head(f"{hf}/{MODEL}/resolve/main/tokenizer.json")
    get = httpx.get(f"{hf}/{MODEL}/resolve/main/tokenizer.json")
    assert head.status_code == get.status_code == 200
    assert head.headers["Content-Length"] == str(len(get.content))
    assert head.headers["ETag"] == get.headers["ETag"]
    commit = head.headers["X-Repo-Commit"]
    assert len(commit) == 40 and get.headers["X-Repo-Commit"] == commit
    pinned = httpx.get(f"{hf}/{MODEL}/resolve/{commit}/tokenizer.json")
    assert pinned.content == get.content
