"""Conversations to tokens with a loss mask, through the base model's own chat template.

The template comes with the tokenizer the server publishes (`get_tokenizer()`); Treadle's
built-in tiny models carry a ChatML template (`<|im_start|>role\\n...<|im_end|>`). A tokenizer
without one gets `FALLBACK_TEMPLATE`, plain role tags ending each turn with the EOS token, so
the same code trains such a model, but its output then follows that format, not the model's.

The mask is found by rendering growing prefixes of the conversation: each message's tokens are
what its addition appends, and an assistant message's header (what `add_generation_prompt`
appends) is told apart from its reply. Only reply tokens, the end-of-turn token included, get
weight 1; system and user tokens and the headers get 0. Each piece is tokenized on its own, in
training and in sampling alike, so a prompt is the same tokens in both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from treadle.tokenizer import Tokenizer
from treadle.types import Datum, ModelInput, TensorData
from treadle_cookbook.data import Conversation

FALLBACK_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '### ' + message['role'] + '\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '### assistant\n' }}{% endif %}"
)
"""Used when the tokenizer has no chat template: `### role`, the content, EOS."""


@dataclass(frozen=True)
class RenderedChat:
    """A conversation's tokens and one loss weight per token."""

    tokens: list[int]
    weights: list[float]

    def to_datum(self) -> Datum:
        """The cross-entropy datum: predict each token from those before it, weighted."""
        if len(self.tokens) < 2:
            raise ValueError("a datum needs at least 2 tokens; the conversation rendered fewer")
        return Datum(
            model_input=ModelInput.from_ints(self.tokens[:-1]),
            loss_fn_inputs={
                "target_tokens": TensorData.from_list(self.tokens[1:], "int64"),
                "weights": TensorData.from_list(self.weights[1:], "float32"),
            },
        )


class Renderer:
    """Renders conversations with `tokenizer`'s chat template (or `FALLBACK_TEMPLATE`)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        if tokenizer.chat_template:
            self.tokenizer = tokenizer
        else:
            specials = {"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token}
            self.tokenizer = Tokenizer(tokenizer.backend, specials, FALLBACK_TEMPLATE)
        self.uses_fallback = not tokenizer.chat_template

    def render(self, conversation: Conversation, *, last_only: bool = False) -> RenderedChat:
        """Tokens of `conversation` with weight 1 on assistant replies (only the last one's
        with `last_only`, as preference losses compare final replies).

        Raises:
            ValueError: the template renders a prefix of the conversation differently from the
                whole (the mask would be wrong); the message names the message.
        """
        last_assistant = max(
            (i for i, m in enumerate(conversation) if m["role"] == "assistant"), default=-1
        )
        tokens: list[int] = []
        weights: list[float] = []
        for text, trained in self._pieces(conversation, last_assistant if last_only else None):
            piece = self.tokenizer.encode(text, add_special_tokens=False)
            tokens += piece
            weights += [1.0 if trained else 0.0] * len(piece)
        return RenderedChat(tokens, weights)

    def prompt(self, conversation: Conversation) -> ModelInput:
        """The tokens that ask for the next assistant reply: the conversation and the
        assistant header."""
        tokens: list[int] = []
        for text, _ in self._pieces(conversation, None):
            tokens += self.tokenizer.encode(text, add_special_tokens=False)
        header = self._text(conversation, True)[len(self._text(conversation, False)) :]
        tokens += self.tokenizer.encode(header, add_special_tokens=False)
        return ModelInput.from_ints(tokens)

    def reply(self, prompt: Conversation, reply: str) -> RenderedChat:
        """`prompt` followed by the assistant's `reply`, weight 1 on the reply alone."""
        return self.render([*prompt, {"role": "assistant", "content": reply}], last_only=True)

    def between_turns(
        self, conversation: Conversation, reply_tokens: Sequence[int], messages: Conversation
    ) -> list[int]:
        """The tokens that follow a sampled assistant reply to `conversation` and ask for the
        next reply after `messages` (a tool's answer): the end of the reply where the sampler
        stopped before it, `messages`, and the assistant header. `prompt(conversation)`, the
        reply's tokens and these are the next turn's context, so the sampled tokens stay as
        sampled instead of being re-tokenized from their text.

        Raises:
            ValueError: the template does not render the reply's text as it was sampled.
        """
        reply = self.decode(reply_tokens)
        before = self._text(conversation, True) + reply
        after = self._text(
            [*conversation, {"role": "assistant", "content": reply}, *messages], True
        )
        if not after.startswith(before):
            raise ValueError(
                "the chat template changes an assistant reply's text when rendering it, so the "
                "next turn cannot follow the sampled tokens; use a template that renders "
                "replies verbatim"
            )
        rest = after[len(before) :]
        eos = self.tokenizer.eos_token
        if reply_tokens and reply_tokens[-1] == self.end_of_turn and eos and rest.startswith(eos):
            rest = rest[len(eos) :]  # the sampler's own end-of-turn token closed the reply
        return self.tokenizer.encode(rest, add_special_tokens=False)

    def decode(self, tokens: Sequence[int]) -> str:
        """The text of sampled tokens, special tokens (end of turn) left out."""
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    @property
    def end_of_turn(self) -> int | None:
        """The token that ends an assistant turn (the EOS token), where there is one."""
        return self.tokenizer.eos_token_id

    def _pieces(self, conversation: Conversation, only: int | None) -> list[tuple[str, bool]]:
        """(text, trained) pieces whose concatenation is the rendered conversation."""
        pieces: list[tuple[str, bool]] = []
        before = self._text([], False)
        if before:
            pieces.append((before, False))
        for i, message in enumerate(conversation):
            text = self._text(conversation[: i + 1], False)
            if not text.startswith(before):
                raise ValueError(
                    f"the chat template renders message {i} ({message['role']}) so that the "
                    "conversation before it changes; the loss mask cannot be found by prefixes"
                )
            if message["role"] == "assistant":
                opened = self._text(conversation[:i], True)
                trained = only is None or only == i
                if opened.startswith(before) and text.startswith(opened):
                    pieces += [(opened[len(before) :], False), (text[len(opened) :], trained)]
                else:
                    pieces.append((text[len(before) :], trained))
            else:
                pieces.append((text[len(before) :], False))
            before = text
        return [(text, trained) for text, trained in pieces if text]

    def _text(self, messages: Conversation, add_generation_prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert isinstance(text, str)
        return text
