"""Sampled tokens as `/oai/v1` answers them in text: a finished choice, and a streamed one.

A choice's text is its tokens decoded, cut before an end-of-turn token and before the first
stop string (neither is part of the text). A streamed choice sends only text that later tokens
cannot change: an incomplete character waits for its last byte, and a tail that could be the
start of a stop string (or of end-of-turn text) waits until the next tokens or the result
settle it, so the streamed pieces always add up to the finished text. This module knows nothing
of HTTP or of how tokens arrive.
"""

from __future__ import annotations

import dataclasses

from api.chat_templates import ServedTokenizer
from api.oai_types import FinishReason
from treadle.types import SampledSequence

_INCOMPLETE = "\ufffd"
"""What the tokenizer decodes an unfinished UTF-8 character to."""


@dataclasses.dataclass(frozen=True)
class Finished:
    pieces: list[str]
    """The text of each kept token, in order; together the choice's text."""
    tokens: list[int]
    logprobs: list[float]
    finish_reason: FinishReason

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def _end_ids(tok: ServedTokenizer) -> set[int]:
    return {i for t in tok.end_texts if (i := tok.tokenizer.token_to_id(t)) is not None}


class _Detokenizer:
    """A growing token list's text, decoded over a short window rather than from the start
    each time: the tokens since the last settled text, and those before them for context
    (a tokenizer decodes a token's leading space by what precedes it)."""

    def __init__(self, tok: ServedTokenizer) -> None:
        self._tok = tok
        self._tokens: list[int] = []
        self._start = 0  # the window's first token
        self._read = 0  # the text of the tokens before this one is settled
        self.text = ""

    def push(self, tokens: list[int]) -> str:
        """The text that `tokens` settle: none while the last character is incomplete."""
        self._tokens += tokens
        new = self._unsettled()
        if not new or new.endswith(_INCOMPLETE):
            return ""
        self.text += new
        self._start, self._read = self._read, len(self._tokens)
        return new

    def flush(self) -> str:
        """The rest of the text, an incomplete last character included: the tokens are all in."""
        new = self._unsettled()
        self.text += new
        self._start = self._read = len(self._tokens)
        return new

    def _unsettled(self) -> str:
        before = self._tok.decode(self._tokens[self._start : self._read])
        return self._tok.decode(self._tokens[self._start :])[len(before) :]


def _pieces(tok: ServedTokenizer, tokens: list[int]) -> list[str]:
    """Each token's share of the text: what it settled, the last one taking the rest."""
    text = _Detokenizer(tok)
    pieces = [text.push([token]) for token in tokens]
    if pieces:
        pieces[-1] += text.flush()
    return pieces


def finish(tok: ServedTokenizer, seq: SampledSequence, stops: list[str]) -> Finished:
    """A sampled sequence as OpenAI returns it: cut before an end-of-turn token or the first
    stop string (neither is part of the text)."""
    end_ids = _end_ids(tok)
    tokens = list(seq.tokens)
    logprobs = list(seq.logprobs or [0.0] * len(tokens))
    reason: FinishReason = "stop" if seq.stop_reason == "stop" else "length"
    for i, token in enumerate(tokens):
        if token in end_ids:
            tokens, logprobs, reason = tokens[:i], logprobs[:i], "stop"
            break
    pieces = _pieces(tok, tokens)
    full = "".join(pieces)
    cuts = [c for s in stops if (c := full.find(s)) >= 0]
    if cuts:
        cut, kept, length = min(cuts), [], 0
        for piece in pieces:
            if length + len(piece) > cut:
                if cut > length:
                    kept.append(piece[: cut - length])
                break
            kept.append(piece)
            length += len(piece)
        pieces, reason = kept, "stop"
        tokens, logprobs = tokens[: len(kept)], logprobs[: len(kept)]
    elif stops and seq.stop_reason == "stop" and not any(t in end_ids for t in seq.tokens):
        reason = "stop"
    return Finished(pieces, tokens, logprobs, reason)


def engine_stop(stops: list[str], tok: ServedTokenizer) -> list[str] | None:
    """The engine's `stop`: None ends at EOS; stop strings replace EOS there, so the end-of-turn
    texts are added to them."""
    if not stops:
        return None
    return [*stops, *(t for t in tok.end_texts if t not in stops)]


def settled_end(text: str, held: list[str]) -> int:
    """How much of `text` no stop string in `held` can cut: up to the first one found, or to a
    tail that could be the start of one."""
    end = len(text)
    for s in held:
        found = text.find(s)
        if found >= 0:
            end = min(end, found)
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                end = min(end, len(text) - k)
                break
    return end


class StreamedChoice:
    """One choice's text as it streams: its tokens in order as progress brings them, and the
    text sent so far, always a prefix of the finished text."""

    def __init__(self, tok: ServedTokenizer, stops: list[str]) -> None:
        self._end_ids = _end_ids(tok)
        # End-of-turn text written as plain tokens is held back too: it costs a short delay.
        self._held = [*stops, *tok.end_texts]
        self._text = _Detokenizer(tok)
        self._tokens: list[int] = []  # received in order so far
        self._diverged = False
        self._ended = False
        self.sent = ""

    def add(self, offset: int, tokens: list[int]) -> str:
        """The text to send now that `tokens` arrived at `offset` of the choice's tokens.

        Tokens already received are skipped when they agree (a repeat, or a re-run after a
        worker failure publishing from the start again). Nothing more is sent after a gap (a
        lost message) or after tokens that disagree with those received (a re-run choosing
        differently): the recorded result then fills in, or ends the stream."""
        if self._diverged or offset > len(self._tokens):
            return ""
        overlap = self._tokens[offset : offset + len(tokens)]
        if tokens[: len(overlap)] != overlap:
            self._diverged = True
            return ""
        tokens = tokens[len(overlap) :]
        self._tokens += tokens
        if self._ended or not tokens:
            return ""
        for i, token in enumerate(tokens):
            if token in self._end_ids:
                tokens, self._ended = tokens[:i], True
                break
        self._text.push(tokens)
        text = self._text.text
        end = settled_end(text, self._held)
        if end <= len(self.sent):
            return ""
        new = text[len(self.sent) : end]
        self.sent += new
        return new

    def rest(self, done: Finished) -> str | None:
        """What of the finished text is still to send; None when it does not start with what
        was sent (tokens re-chosen after a worker failure)."""
        final = done.text
        return final[len(self.sent) :] if final.startswith(self.sent) else None
