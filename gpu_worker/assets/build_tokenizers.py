"""Build the byte-level BPE tokenizers the built-in tiny models ship with.

Run once, commit the output: `python -m gpu_worker.assets.build_tokenizers`. The corpus is
generated from a fixed seed (pseudo-words, English-ish sentences, arithmetic, small code
snippets, chat transcripts), so rerunning reproduces the committed files byte for byte.
Each folder gets tokenizer.json, tokenizer_config.json (with a ChatML chat template) and
special_tokens_map.json, loadable offline with `AutoTokenizer.from_pretrained(folder)`.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

ASSETS = Path(__file__).resolve().parent
VOCABS = {"bpe-1k": 1024, "bpe-4k": 4096}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

log = logging.getLogger(__name__)

_WORDS = [
    "the",
    "a",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "it",
    "for",
    "on",
    "with",
    "as",
    "at",
    "by",
    "from",
    "this",
    "that",
    "be",
    "are",
    "have",
    "not",
    "you",
    "he",
    "she",
    "they",
    "we",
    "one",
    "all",
    "can",
    "will",
    "what",
    "when",
    "which",
    "there",
    "their",
    "time",
    "model",
    "train",
    "data",
    "loss",
    "token",
    "learn",
    "sample",
    "answer",
    "question",
    "number",
    "value",
    "list",
    "return",
    "function",
    "print",
    "true",
    "false",
    "none",
    "self",
    "class",
    "import",
    "paris",
    "france",
    "capital",
    "city",
    "water",
    "light",
    "house",
    "river",
    "small",
    "large",
    "good",
    "new",
    "old",
]


def _pseudo_word(rng: random.Random) -> str:
    consonants, vowels = "bcdfghjklmnprstvwz", "aeiou"
    return "".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(rng.randint(1, 4)))


def generate_corpus(seed: int = 0, lines: int = 40_000) -> list[str]:
    """Deterministic training text: prose, arithmetic, code and chat-formatted lines."""
    rng = random.Random(seed)
    vocab = _WORDS + [_pseudo_word(rng) for _ in range(3000)]
    weights = [1.0 / (i + 1) for i in range(len(vocab))]
    out: list[str] = []
    for _ in range(lines):
        kind = rng.random()
        if kind < 0.5:
            words = rng.choices(vocab, weights, k=rng.randint(4, 16))
            out.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ","]))
        elif kind < 0.7:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            out.append(f"Question: what is {a} + {b}? Answer: {a + b}")
        elif kind < 0.85:
            name, arg = rng.choice(vocab), rng.choice(vocab)
            out.append(f"def {name}({arg}):\n    return {arg} * {rng.randint(1, 9)}\n")
        else:
            ask = " ".join(rng.choices(vocab, weights, k=rng.randint(3, 8)))
            reply = " ".join(rng.choices(vocab, weights, k=rng.randint(3, 8)))
            out.append(
                f"<|im_start|>user\n{ask}?<|im_end|>\n<|im_start|>assistant\n{reply}.<|im_end|>\n"
            )
    out.append("Ünïcödé ✓ 東京 🙂 — “quotes” and tabs\tand\nnewlines")
    return out


def build(name: str, vocab_size: int, corpus: list[str]) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>", "<|endoftext|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    folder = ASSETS / name
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(folder))
    # Older transformers releases read the template and special tokens from these two files,
    # and do not know transformers 5's "TokenizersBackend" class name.
    config_path = folder / "tokenizer_config.json"
    config: dict[str, object] = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["chat_template"] = CHAT_TEMPLATE
    config["model_max_length"] = 2048
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    special = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "pad_token": "<|pad|>"}
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return folder


def main() -> None:
    logging.basicConfig(level=logging.INFO)
    corpus = generate_corpus()
    for name, size in VOCABS.items():
        folder = build(name, size, corpus)
        log.info("wrote %s (vocab %d)", folder, size)


if __name__ == "__main__":
    main()
