"""Tokenizers downloaded from the Treadle server itself (never the Hugging Face hub).

The server publishes each base model's tokenizer files at
`/api/v1/models/{base_model}/tokenizer`; this module fetches `tokenizer.json` (and
`tokenizer_config.json` for the chat template and special tokens) and wraps a
`tokenizers.Tokenizer` (install `treadle[tokenizer]`) in `Tokenizer`, which has the part of
the transformers tokenizer interface that tinker code uses: `encode(str) -> list[int]`,
`decode(list[int]) -> str`, `apply_chat_template`. transformers is never imported.
Tokenizers are cached per process by (server, base model).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from treadle._http import HttpClient
from treadle.errors import InvalidArgumentError, MissingDependencyError, RequestFailedError
from treadle.types.tokenizer_files import CONFIG_FILE, TEMPLATE_FILE, TOKENIZER_FILE

_cache: dict[tuple[str, str], Tokenizer] = {}
_cache_lock = threading.Lock()


def _import_tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError as exc:
        raise MissingDependencyError(
            "get_tokenizer builds a `tokenizers.Tokenizer`; install it with "
            "`pip install 'treadle[tokenizer]'`"
        ) from exc
    return tokenizers


def _special(config: Mapping[str, Any], name: str) -> str | None:
    value = config.get(name)
    if isinstance(value, dict):  # {"content": "<|im_end|>", ...} in older files
        value = value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """A base model's tokenizer, with the transformers methods tinker code calls.

    `encode` and `decode` work on plain lists of token ids, as transformers' do;
    `apply_chat_template` renders the model's chat template (needs `jinja2`, which
    `treadle[tokenizer]` installs). The underlying `tokenizers.Tokenizer` is `backend`.
    """

    def __init__(
        self,
        backend: Any,
        config: Mapping[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        config = dict(config or {})
        self.chat_template: str | None = chat_template or config.get("chat_template")
        self.bos_token = _special(config, "bos_token")
        self.eos_token = _special(config, "eos_token")
        self.pad_token = _special(config, "pad_token")

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size})"

    @property
    def vocab_size(self) -> int:
        """The number of tokens, added tokens included."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    @property
    def bos_token_id(self) -> int | None:
        return self.convert_tokens_to_ids(self.bos_token) if self.bos_token else None

    @property
    def eos_token_id(self) -> int | None:
        return self.convert_tokens_to_ids(self.eos_token) if self.eos_token else None

    @property
    def pad_token_id(self) -> int | None:
        return self.convert_tokens_to_ids(self.pad_token) if self.pad_token else None

    def convert_tokens_to_ids(self, token: str) -> int | None:
        """The id of one token string, or None when the vocabulary lacks it."""
        found = self.backend.token_to_id(token)
        return None if found is None else int(found)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The token ids of `text`.

        Args:
            text: the string to tokenize.
            add_special_tokens: apply the tokenizer's post-processor (e.g. a BOS token).

        Raises:
            InvalidArgumentError: `text` is not a string (also a `TypeError`).
        """
        if not isinstance(text, str):
            raise InvalidArgumentError(f"encode: text expected str, got {type(text).__name__}")
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of `token_ids` (a list of ints, as `encode` returns)."""
        return str(self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self,
        conversation: Sequence[Mapping[str, Any]],
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        **kwargs: Any,
    ) -> list[int] | str:
        """Render `conversation` (`[{"role": ..., "content": ...}, ...]`) with the chat template.

        Args:
            conversation: the messages.
            tokenize: return token ids (the default, as in transformers) instead of the text.
            add_generation_prompt: end with the template's opening of an assistant turn.
            kwargs: further variables for the template.

        Returns:
            The token ids (encoded without special tokens added), or the text.

        Raises:
            InvalidArgumentError: the model has no chat template, or the template refuses the
                conversation (e.g. roles that do not alternate); also a `ValueError`.
            MissingDependencyError: `jinja2` is not installed (also an `ImportError`).
        """
        if not self.chat_template:
            raise InvalidArgumentError(
                "this model's tokenizer has no chat template; build the prompt"
            )
        try:
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError as exc:
            raise MissingDependencyError(
                "apply_chat_template renders a jinja2 template; install it with "
                "`pip install 'treadle[tokenizer]'`"
            ) from exc

        def raise_exception(message: str) -> None:
            raise InvalidArgumentError(f"apply_chat_template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        text = env.from_string(self.chat_template).render(
            messages=list(conversation),
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            pad_token=self.pad_token or "",
            **kwargs,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


async def load_tokenizer(http: HttpClient, base_model: str) -> Tokenizer:
    """The `Tokenizer` of `base_model`, downloaded once per process.

    Raises:
        MissingDependencyError: the `tokenizers` package is missing (also an `ImportError`).
        NotFoundError: the server publishes no tokenizer for this model.
        RequestFailedError: the server's files contain no tokenizer.json (category `server`).
    """
    tokenizers = _import_tokenizers()
    key = (http.base_url, base_model)
    with _cache_lock:
        if key in _cache:
            return _cache[key]
    root = f"/api/v1/models/{base_model}/tokenizer"
    files = (await http.request("GET", root)).json().get("files", [])
    if TOKENIZER_FILE not in files:
        raise RequestFailedError(
            f"the server publishes no {TOKENIZER_FILE} for {base_model!r} (files: "
            f"{files}); ask the operator to add a fast tokenizer",
            category="server",
        )
    backend = tokenizers.Tokenizer.from_str(
        (await http.request("GET", f"{root}/{TOKENIZER_FILE}")).text
    )
    config: dict[str, Any] = {}
    if CONFIG_FILE in files:
        config = json.loads((await http.request("GET", f"{root}/{CONFIG_FILE}")).text)
    template = None
    if TEMPLATE_FILE in files and not config.get("chat_template"):
        template = (await http.request("GET", f"{root}/{TEMPLATE_FILE}")).text
    tokenizer = Tokenizer(backend, config, template)
    with _cache_lock:
        _cache.setdefault(key, tokenizer)
        return _cache[key]
