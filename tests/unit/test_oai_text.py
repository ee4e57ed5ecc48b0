"""Streamed /oai/v1 text adds up to the finished text (api/oai_text.py): whatever chunks the
tokens arrive in, an incomplete character, a possible stop string's start and end-of-turn text
are held back until settled, the finished text is cut before stop strings and end-of-turn
tokens, and characters split across byte tokens are decoded whole."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from api import chat_templates
from api.oai_text import StreamedChoice, finish, settled_end
from treadle.types import SampledSequence

pytestmark = pytest.mark.unit

TOK = chat_templates.load(
    "tiny", Path(chat_templates.__file__).resolve().parents[1] / "gpu_worker/assets/bpe-1k"
)
END = TOK.tokenizer.token_to_id("<|im_end|>")
TEXTS = ["héllo wörld 日本 once upon a time", "the cat sat. the dog ran! ünïcödé", "ab ab abc"]


def _sequence(tokens: list[int], stop_reason: str = "length") -> SampledSequence:
    return SampledSequence(stop_reason=stop_reason, tokens=tokens, logprobs=[-0.5] * len(tokens))  # type: ignore[arg-type]


def _streamed(tokens: list[int], stops: list[str], rng: random.Random) -> tuple[list[str], str]:
    """The text sent while `tokens` arrive in random chunks, and what the result adds."""
    choice, sent, at = StreamedChoice(TOK, stops), [], 0
    while at < len(tokens):
        size = rng.randint(1, 4)
        sent.append(choice.add(at, tokens[at : at + size]))
        at += size
    rest = choice.rest(finish(TOK, _sequence(tokens), stops))
    assert rest is not None
    return sent, rest


def test_split_characters_decode_whole_in_the_finished_text() -> None:
    tokens = TOK.encode("héllo wörld 日本", special_tokens=False)
    done = finish(TOK, _sequence(tokens), [])
    assert done.text == "héllo wörld 日本"
    assert len(done.pieces) == len(tokens) and "\ufffd" not in "".join(done.pieces)


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_pieces_add_up_to_the_finished_text_whatever_the_chunks(text: str) -> None:
    rng = random.Random(text)
    tokens = TOK.encode(text, special_tokens=False)
    stop_sets = [[], ["ab"], [text[5:9]], [text[-3:], "zzz"], ["ö"], [text[:2]]]
    for stops in stop_sets:
        for _ in range(10):
            sent, rest = _streamed(tokens, stops, rng)
            finished = finish(TOK, _sequence(tokens), stops).text
            assert "".join(sent) + rest == finished
            assert all("\ufffd" not in piece for piece in sent)
            assert not any(s in "".join(sent) for s in stops)


def test_random_tokens_decode_as_a_whole_and_stream_the_same_text() -> None:
    """Random ids include byte tokens that make invalid or split characters, and special
    tokens: the text decoded piece by piece is the one decoded at once, and the streamed text
    adds up to it."""
    rng = random.Random(0)
    vocabulary = TOK.tokenizer.get_vocab_size()
    for _ in range(200):
        tokens = [rng.randrange(vocabulary) for _ in range(rng.randint(0, 40))]
        kept = tokens[: tokens.index(END)] if END in tokens else tokens
        assert finish(TOK, _sequence(tokens), []).text == TOK.decode(kept)
        sent, rest = _streamed(tokens, [], rng)
        assert "".join(sent) + rest == TOK.decode(kept)


def test_a_possible_stop_start_waits_and_is_sent_once_it_is_not_one() -> None:
    head = TOK.encode("once upon", special_tokens=False)
    tokens = TOK.encode("once upon the hill", special_tokens=False)
    assert tokens[: len(head)] == head
    choice = StreamedChoice(TOK, ["upon a"])
    assert choice.add(0, head) == "once "  # "upon" may still become "upon a"
    assert choice.add(len(head), tokens[len(head) :]) == "upon the hill"
    assert choice.rest(finish(TOK, _sequence(tokens), ["upon a"])) == ""


def test_nothing_after_an_end_of_turn_token_or_a_stop_string_is_sent() -> None:
    before = TOK.encode("hello there", special_tokens=False)
    after = TOK.encode(" more text", special_tokens=False)
    choice = StreamedChoice(TOK, [])
    assert choice.add(0, [*before, END]) == "hello there"
    assert choice.add(len(before) + 1, after) == ""
    done = finish(TOK, _sequence([*before, END, *after], "stop"), [])
    assert (done.text, done.finish_reason, choice.rest(done)) == ("hello there", "stop", "")

    stopped = StreamedChoice(TOK, ["the"])
    tokens = TOK.encode("hello there friend", special_tokens=False)
    assert stopped.add(0, tokens) == "hello "
    assert stopped.rest(finish(TOK, _sequence(tokens), ["the"])) == ""


def test_end_of_turn_text_written_in_plain_tokens_is_held_back() -> None:
    choice = StreamedChoice(TOK, [])
    tokens = TOK.encode("hi <|im_", special_tokens=False)
    assert END not in tokens
    assert choice.add(0, tokens) == "hi "


def test_out_of_order_progress_is_skipped_and_the_result_fills_in() -> None:
    tokens = TOK.encode("one two three four", special_tokens=False)
    choice = StreamedChoice(TOK, [])
    first = choice.add(0, tokens[:2])
    assert choice.add(3, tokens[3:]) == ""  # tokens[2] was lost
    assert choice.add(0, tokens[:2]) == ""  # a repeat
    rest = choice.rest(finish(TOK, _sequence(tokens), []))
    assert first + (rest or "") == "one two three four"


def test_a_rerun_publishing_from_the_start_again_streams_on_while_it_agrees() -> None:
    tokens = TOK.encode("one two three four", special_tokens=False)  # one| t|wo| t|h|re|e|...
    choice = StreamedChoice(TOK, [])
    assert choice.add(0, tokens[:2]) == "one t"
    assert choice.add(0, tokens[:3]) == "wo"  # the same two again, and one more
    assert choice.add(0, tokens[:3]) == ""
    assert choice.add(3, tokens[3:]) == " three four"
    assert choice.rest(finish(TOK, _sequence(tokens), [])) == ""


def test_tokens_that_disagree_with_those_received_stop_the_stream() -> None:
    tokens = TOK.encode("one two three four", special_tokens=False)
    other = TOK.encode("one zebra", special_tokens=False)  # one| ze|b|ra
    choice = StreamedChoice(TOK, [])
    assert choice.add(0, tokens[:2]) == "one t"
    assert choice.add(0, other) == ""
    assert choice.add(len(other), tokens[len(other) :]) == ""  # nothing more after that
    assert choice.rest(finish(TOK, _sequence(other), [])) is None


def test_a_result_that_does_not_continue_the_sent_text_is_refused() -> None:
    choice = StreamedChoice(TOK, [])
    choice.add(0, TOK.encode("hello there", special_tokens=False))
    other = finish(TOK, _sequence(TOK.encode("goodbye", special_tokens=False)), [])
    assert choice.rest(other) is None


def test_settled_end() -> None:
    assert settled_end("abcdef", []) == 6
    assert settled_end("abcdef", ["cd"]) == 2
    assert settled_end("abcde", ["def", "xyz"]) == 3
    assert settled_end("abcde", ["e", "cdz"]) == 4
    assert settled_end("abcd", ["x", "cdz"]) == 2
    assert settled_end("ab", ["abc"]) == 0
