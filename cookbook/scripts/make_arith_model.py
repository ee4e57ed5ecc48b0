"""Pretrain a ~1M-parameter Llama on 3-digit addition and save it as a model folder to serve.

    pip install -e './cookbook[pretrain]'   # torch and transformers, which no recipe needs
    python cookbook/scripts/make_arith_model.py --out /tmp/arith-1m

The model learns "042+007=0049<eos>" from scratch with plain torch and transformers, for a
fixed number of steps. Accuracy jumps abruptly once carrying is learned: with seed 0 and
batches of 128 fresh problems, held-out exact match was 1.4 % after 1,050 steps, 5.9 % after
1,100, 39.7 % after 1,150, 67.3 % after 1,200 and 92 % after 1,300. The default, 1,150 steps,
stops inside that transition, so GRPO (`treadle_cookbook.recipes.math_grpo`) has room to
raise it. One thread, a fixed seed and deterministic kernels make the run
reproducible on the same machine; the step count, not the wall time, decides the result.

The folder holds config.json, model.safetensors and a character-level fast tokenizer
(tokenizer.json with its tokenizer_config.json, end-of-sequence `<eos>`), which is all
Treadle needs to serve it through TREADLE_MODEL_FOLDERS. The script ends by printing the
held-out greedy accuracy and the environment lines to serve the folder.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from treadle_cookbook import arith

PROMPT_LEN = 2 * arith.DIGITS + 2


def build_model(seed: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=arith.MODEL_VOCAB_SIZE,
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=512,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=arith.VOCAB.index(arith.EOS),
        pad_token_id=arith.VOCAB.index(arith.PAD),
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def batch_tokens(problems: list[arith.Problem]) -> torch.Tensor:
    """`[B, 13]`: prompt, answer digits, end-of-sequence."""
    eos = arith.VOCAB.index(arith.EOS)
    return torch.tensor([[*arith.encode(p.prompt + p.answer), eos] for p in problems])


def answer_loss(model: LlamaForCausalLM, tokens_BT: torch.Tensor) -> torch.Tensor:
    """Cross-entropy on the answer and end-of-sequence tokens only."""
    logits_BTV = model(input_ids=tokens_BT[:, :-1]).logits
    answer_logits = logits_BTV[:, PROMPT_LEN - 1 :].reshape(-1, logits_BTV.shape[-1])
    return F.cross_entropy(answer_logits, tokens_BT[:, PROMPT_LEN:].reshape(-1))


@torch.no_grad()
def greedy_accuracy(model: LlamaForCausalLM, problems: list[arith.Problem]) -> float:
    """Exact match of all answer tokens (digits and end-of-sequence) under greedy decoding."""
    model.eval()
    tokens_BT = torch.tensor([arith.encode(p.prompt) for p in problems])
    for _ in range(arith.ANSWER_TOKENS):
        next_B = model(input_ids=tokens_BT).logits[:, -1].argmax(-1)
        tokens_BT = torch.cat([tokens_BT, next_B[:, None]], dim=1)
    model.train()
    correct = (tokens_BT[:, PROMPT_LEN:] == batch_tokens(problems)[:, PROMPT_LEN:]).all(dim=1)
    return float(correct.float().mean())


def save_tokenizer(out: Path) -> None:
    """A character-level WordLevel tokenizer over `arith.VOCAB`, no BOS, `<eos>` special."""
    vocab = {token: i for i, token in enumerate(arith.VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=arith.PAD))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([arith.EOS, arith.PAD])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=arith.EOS, pad_token=arith.PAD
    )
    fast.save_pretrained(out)


def train(steps: int, batch_size: int, seed: int, eval_every: int) -> LlamaForCausalLM:
    model = build_model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.98), weight_decay=0.01)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 100))
    problems = arith.training_problems(seed)
    held_out = arith.held_out()
    started = time.monotonic()
    for step in range(1, steps + 1):
        loss = answer_loss(model, batch_tokens([next(problems) for _ in range(batch_size)]))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        warmup.step()
        if eval_every and step % eval_every == 0:
            accuracy = greedy_accuracy(model, held_out)
            elapsed = time.monotonic() - started
            print(f"step {step}: loss {loss.item():.3f}, held-out {accuracy:.1%} ({elapsed:.0f} s)")
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the model folder to write")
    parser.add_argument("--steps", type=int, default=1150, help="optimizer steps (default 1150)")
    parser.add_argument("--batch_size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval_every", type=int, default=0, help="print accuracy every N steps")
    parser.add_argument("--name", default="cookbook/arith-1m", help="the name to serve it as")
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    model = train(args.steps, args.batch_size, args.seed, args.eval_every)
    accuracy = greedy_accuracy(model, arith.held_out())
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    save_tokenizer(args.out)
    if math.isnan(accuracy):
        raise SystemExit("training diverged (NaN accuracy); use another --seed")
    folder = str(args.out.resolve())
    print(f"held-out exact match (greedy, {arith.HELD_OUT_SIZE} problems): {accuracy:.1%}")
    print("serve it with:")
    print(f"export TREADLE_MODEL_FOLDERS='{json.dumps({args.name: folder})}'")
    print(f"export TREADLE_MODELS='{json.dumps([args.name])}'")
    print("./scripts/serve.sh")


if __name__ == "__main__":
    main()
