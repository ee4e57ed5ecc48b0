"""Served models' tokenizers on the API tier: chat templates, encoding and decoding, torch-free.

A base model's tokenizer files are the ones its worker published in the artifact store
(`scheduler.served.tokenizer_key`): `tokenizer.json` (read by `tokenizers`),
`tokenizer_config.json` and `special_tokens_map.json` (special tokens), and the chat template,
either `chat_template.jinja` or the config's `chat_template`. Templates are rendered in a
sandboxed Jinja environment set up as Hugging Face's `apply_chat_template` sets up its own
(`trim_blocks`, `lstrip_blocks`, `raise_exception`, `tojson`), so a model's own template gives
the prompt it was trained on. This module knows nothing of HTTP or sampling.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from core.errors import ErrorCode, InvalidInput


class TemplateRefused(Exception):
    """The template itself refused the conversation (its `raise_exception`)."""


def _raise_exception(message: str) -> None:
    raise TemplateRefused(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


_ENVIRONMENT = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
_ENVIRONMENT.globals["raise_exception"] = _raise_exception
_ENVIRONMENT.filters["tojson"] = _tojson


def _token_text(value: Any) -> str | None:
    """A special token as the config files write it: a string or `{"content": ...}`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


@dataclasses.dataclass(frozen=True)
class ServedTokenizer:
    model: str
    tokenizer: Tokenizer
    chat_template: str | None
    special: dict[str, str]
    """`bos_token`, `eos_token`, ... as the template reads them."""
    end_texts: tuple[str, ...]
    """The texts of the tokens that end a generation (EOS, and the end of a chat turn)."""

    def render(self, messages: list[dict[str, Any]]) -> str:
        """The prompt text of a conversation, ending where the assistant's answer starts."""
        if self.chat_template is None:
            raise InvalidInput(
                f"model {self.model!r} has no chat template, so chat messages cannot be turned "
                "into a prompt; use /oai/v1/completions with a prompt text instead",
                code=ErrorCode.UNSUPPORTED,
            )
        try:
            template = _ENVIRONMENT.from_string(self.chat_template)
            return template.render(messages=messages, add_generation_prompt=True, **self.special)
        except TemplateRefused as exc:
            raise InvalidInput(
                f"the chat template of {self.model!r} refused these messages: {str(exc)[:300]}"
            ) from exc
        except TemplateError as exc:
            raise InvalidInput(
                f"the chat template of {self.model!r} could not render these messages "
                f"({str(exc)[:200]}); send messages with a role and text content"
            ) from exc

    def encode(self, text: str, *, special_tokens: bool) -> list[int]:
        """Token ids; `special_tokens` adds what the tokenizer adds around a text (not around a
        rendered chat, whose template already wrote them)."""
        return list(self.tokenizer.encode(text, add_special_tokens=special_tokens).ids)

    def decode(self, tokens: list[int]) -> str:
        return str(self.tokenizer.decode(tokens, skip_special_tokens=True))

    def piece(self, token: int) -> str:
        """One token as OpenAI's logprobs name it (its text, special tokens included)."""
        return str(self.tokenizer.decode([token], skip_special_tokens=False))


def load(model: str, folder: Path) -> ServedTokenizer:
    """The tokenizer published in `folder` (cached while the files stay unchanged)."""
    stamp = tuple((p.name, p.stat().st_mtime_ns) for p in sorted(folder.iterdir()) if p.is_file())
    return _load(model, str(folder), stamp)


@functools.lru_cache(maxsize=16)
def _load(model: str, folder_text: str, _stamp: tuple[tuple[str, int], ...]) -> ServedTokenizer:
    folder = Path(folder_text)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    config: dict[str, Any] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        path = folder / name
        if path.is_file():
            config.update(json.loads(path.read_text(encoding="utf-8")))
    template_file = folder / "chat_template.jinja"
    template: Any = (
        template_file.read_text(encoding="utf-8")
        if template_file.is_file()
        else config.get("chat_template")
    )
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    special = {
        key: text
        for key in ("bos_token", "eos_token", "pad_token", "unk_token")
        if (text := _token_text(config.get(key))) is not None
    }
    ends = [special["eos_token"]] if "eos_token" in special else []
    # Chat models end a turn with a token of their own, which a template writes after each
    # message (`<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`).
    for candidate in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>"):
        if candidate not in ends and tokenizer.token_to_id(candidate) is not None:
            ends.append(candidate)
    return ServedTokenizer(
        model=model,
        tokenizer=tokenizer,
        chat_template=template if isinstance(template, str) else None,
        special=special,
        end_texts=tuple(ends),
    )
