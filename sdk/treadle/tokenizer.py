"""Tokenizers downloaded from the Treadle server itself (never the Hugging Face hub).

The server publishes each base model's tokenizer files at
`/api/v1/models/{base_model}/tokenizer`; this module fetches `tokenizer.json` and builds a
`tokenizers.Tokenizer` (install `treadle[tokenizer]`). transformers is never imported.
Tokenizers are cached per process by (server, base model).
"""

from __future__ import annotations

import threading
from typing import Any

from treadle._http import HttpClient

_cache: dict[tuple[str, str], Any] = {}
_cache_lock = threading.Lock()
TOKENIZER_FILE = "tokenizer.json"


def _import_tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError as exc:
        raise ImportError(
            "get_tokenizer builds a `tokenizers.Tokenizer`; install it with "
            "`pip install 'treadle[tokenizer]'`"
        ) from exc
    return tokenizers


async def load_tokenizer(http: HttpClient, base_model: str) -> Any:
    """A `tokenizers.Tokenizer` for `base_model`, downloaded once per process.

    Raises:
        ImportError: the `tokenizers` package is missing.
        NotFoundError: the server publishes no tokenizer for this model.
        ValueError: the server's files contain no tokenizer.json.
    """
    tokenizers = _import_tokenizers()
    key = (http.base_url, base_model)
    with _cache_lock:
        if key in _cache:
            return _cache[key]
    listing = (await http.request("GET", f"/api/v1/models/{base_model}/tokenizer")).json()
    if TOKENIZER_FILE not in listing.get("files", []):
        raise ValueError(
            f"the server publishes no {TOKENIZER_FILE} for {base_model!r} (files: "
            f"{listing.get('files')}); ask the operator to add a fast tokenizer"
        )
    response = await http.request("GET", f"/api/v1/models/{base_model}/tokenizer/{TOKENIZER_FILE}")
    tokenizer = tokenizers.Tokenizer.from_str(response.text)
    with _cache_lock:
        _cache.setdefault(key, tokenizer)
        return _cache[key]
