"""A model folder's own chat template makes the prompt (api/chat_templates.py): the template a
Hugging Face folder carries, in `chat_template.jinja` or in `tokenizer_config.json`, is the one
rendered, with the folder's own special tokens, and nothing of the built-in one leaks in."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from api import chat_templates
from core.errors import InvalidInput

pytestmark = pytest.mark.unit

BUILT_IN = Path(chat_templates.__file__).resolve().parents[1] / "gpu_worker/assets/bpe-1k"
# A template unlike the built-in ChatML one, in the style of Llama's: the BOS token first, a
# header per turn, a turn ended by a token of the folder's own.
OWN_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "[{{ message['role'] | upper }}] {{ message['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}[ASSISTANT] {% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi"},
]


def _folder(tmp_path: Path, *, template_file: str | None, in_config: object = None) -> Path:
    """The built-in tiny tokenizer's files, with the chat template replaced as asked."""
    folder = tmp_path / "model"
    shutil.copytree(BUILT_IN, folder)
    (folder / "chat_template.jinja").unlink()
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    if in_config is not None:
        config["chat_template"] = in_config
    config["bos_token"] = "<s>"  # a folder's own special tokens reach its template
    config_path.write_text(json.dumps(config))
    (folder / "special_tokens_map.json").unlink()
    if template_file is not None:
        (folder / "chat_template.jinja").write_text(template_file)
    return folder


def test_the_built_in_folder_renders_chatml() -> None:
    served = chat_templates.load("treadle/tiny-1m", BUILT_IN)
    assert served.render(MESSAGES) == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_the_template_in_tokenizer_config_is_used(tmp_path: Path) -> None:
    served = chat_templates.load(
        "acme/own", _folder(tmp_path, template_file=None, in_config=OWN_TEMPLATE)
    )
    prompt = served.render(MESSAGES)
    assert prompt == "<s>[SYSTEM] be brief<|im_end|>[USER] hi<|im_end|>[ASSISTANT] "
    assert "<|im_start|>" not in prompt
    # The rendered prompt is encoded as it stands: its special tokens are the tokenizer's own.
    assert served.tokenizer.token_to_id("<|im_end|>") in served.encode(prompt, special_tokens=False)


def test_chat_template_jinja_wins_over_the_config(tmp_path: Path) -> None:
    folder = _folder(tmp_path, template_file=OWN_TEMPLATE, in_config="{{ 'from the config' }}")
    served = chat_templates.load("acme/own", folder)
    assert served.render(MESSAGES).startswith("<s>[SYSTEM] be brief")


def test_named_templates_use_the_default_one(tmp_path: Path) -> None:
    named = [
        {"name": "tool_use", "template": "{{ 'tools' }}"},
        {"name": "default", "template": OWN_TEMPLATE},
    ]
    served = chat_templates.load("acme/own", _folder(tmp_path, template_file=None, in_config=named))
    assert served.render(MESSAGES).endswith("[ASSISTANT] ")


def test_a_changed_template_file_is_read_again(tmp_path: Path) -> None:
    folder = _folder(tmp_path, template_file=OWN_TEMPLATE)
    assert chat_templates.load("acme/own", folder).render(MESSAGES).startswith("<s>[SYSTEM]")
    template = folder / "chat_template.jinja"
    template.write_text("{{ 'changed: ' + messages[-1]['content'] }}")
    stat = template.stat()
    # The cache is keyed on modification times; make the change visible even within one tick.
    os.utime(template, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert chat_templates.load("acme/own", folder).render(MESSAGES) == "changed: hi"


def test_a_folder_without_a_template_refuses_chat(tmp_path: Path) -> None:
    served = chat_templates.load("acme/plain", _folder(tmp_path, template_file=None))
    with pytest.raises(InvalidInput, match=r"no chat template.*/oai/v1/completions"):
        served.render(MESSAGES)


def test_a_template_that_refuses_the_messages_says_so(tmp_path: Path) -> None:
    strict = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    served = chat_templates.load("acme/strict", _folder(tmp_path, template_file=strict))
    with pytest.raises(InvalidInput, match="refused these messages: user first"):
        served.render(MESSAGES)
