"""Distillation: a student LoRA learns a teacher's next-token distributions on chat replies.

    python -m treadle_cookbook.recipes.distill --model treadle/tiny-1m \
        --teacher_model treadle/tiny-qwen-1m --log_dir /tmp/distill

The teacher is a sampling client on `teacher_model` (a base model the server offers; the
default, treadle/tiny-qwen-1m, shares tiny-1m's tokenizer and is served when listed in
TREADLE_MODELS, e.g. `TREADLE_MODELS='["treadle/tiny-1m", "treadle/tiny-qwen-1m"]'
./scripts/serve.sh`) or on
`teacher_path` (sampler weights, `tinker://.../sampler_weights/...`); it must use the
student's tokenizer. At the start it is asked once for its top-`topk` logprobs at every
position of every conversation (`topk_prompt_logprobs`; the server offers top-K on given
tokens, so the sequences are the data's, not the student's samples). Renormalised over those
K tokens they are 2-D cross-entropy targets weighted by the teacher's probabilities on the
assistant's tokens (`treadle_cookbook.distill`). Each step trains on `batch_size`
conversations with one forward_backward and one optim_step. The student's top-K KL to the
teacher is reported per step (on the step's batch, before its update) and on the held-out
conversations at the start, every `eval_every` steps and at the end; it falls as the student
learns.

Writes config.json, metrics.jsonl (per step: kl; per evaluation: held_out_kl),
checkpoints.jsonl and kl.png to `log_dir`. Interrupted, the same command continues from the
latest checkpoint.
"""

from __future__ import annotations

from pydantic import Field
from rich.progress import Progress

from treadle import ServiceClient
from treadle.types import AdamParams
from treadle_cookbook import checkpoints, data, distill
from treadle_cookbook.config import RecipeConfig
from treadle_cookbook.metrics import MetricsLog
from treadle_cookbook.renderers import Renderer


class Config(RecipeConfig):
    model: str = Field(default="treadle/tiny-1m", description="the student's base model")
    teacher_model: str = Field(
        default="treadle/tiny-qwen-1m", description="the teacher: a base model the server offers"
    )
    teacher_path: str | None = Field(
        default=None, description="the teacher's sampler weights instead (tinker://...)"
    )
    data: str = Field(
        default=str(data.SAMPLE_DIR / "chat_sample.jsonl"),
        description="a JSON-lines file of {messages: [...]} or a Hugging Face dataset name",
    )
    held_out_fraction: float = Field(default=0.1, description="share kept out for held-out KL")
    topk: int = Field(default=16, description="teacher tokens per position (at most 128)")
    steps: int = Field(default=15, description="optimizer steps in all (a resumed run included)")
    batch_size: int = Field(default=8, description="conversations per step")
    learning_rate: float = Field(default=2e-3, description="learning rate")
    eval_every: int = Field(default=5, description="steps between held-out evaluations")
    save_every: int = Field(default=5, description="steps between state checkpoints")


def main(argv: list[str] | None = None) -> None:
    config = Config.from_cli(argv)
    config.save(config.log_dir)
    service = ServiceClient(base_url=config.base_url, api_key=config.api_key)
    training_client, start_step = checkpoints.resume(service, config.log_dir, config)
    if config.teacher_path is not None:
        teacher = service.create_sampling_client(model_path=config.teacher_path)
    else:
        teacher = service.create_sampling_client(base_model=config.teacher_model)
    tokenizer = training_client.get_tokenizer()
    if teacher.get_tokenizer().vocab_size != tokenizer.vocab_size:
        raise SystemExit(
            f"the teacher's vocabulary ({teacher.get_tokenizer().vocab_size} tokens) is not the "
            f"student's ({tokenizer.vocab_size}); pick a teacher with the student's tokenizer"
        )
    renderer = Renderer(tokenizer)

    conversations = data.load_conversations(config.data)
    train, held_out = data.split_held_out(conversations, config.held_out_fraction, config.seed)
    splits = {}
    for name, part in (("train", train), ("held_out", held_out)):
        plain = [renderer.render(conversation).to_datum() for conversation in part]
        targets = distill.teacher_targets(teacher, plain, config.topk)
        datums = [distill.distill_datum(d, t) for d, t in zip(plain, targets, strict=True)]
        splits[name] = (datums, targets)

    def held_out_kl() -> float:
        datums, targets = splits["held_out"]
        output = training_client.forward(datums, "cross_entropy").result()
        return distill.kl_to_teacher(datums, targets, output)

    examples = list(zip(*splits["train"], strict=True))
    log = MetricsLog(config.log_dir, config.mlflow_uri)
    if start_step == 0:
        log.log(0, {"held_out_kl": held_out_kl()})
    with Progress() as progress:
        task = progress.add_task("distill", total=config.steps, completed=start_step)
        for step in range(start_step, config.steps):
            batch = data.batch(examples, config.batch_size, step, config.seed)
            datums = [datum for datum, _ in batch]
            backward = training_client.forward_backward(datums, "cross_entropy")
            training_client.optim_step(AdamParams(learning_rate=config.learning_rate)).result()
            kl = distill.kl_to_teacher(datums, [t for _, t in batch], backward.result())
            values = {"kl": kl}

            done = step + 1
            if done % config.eval_every == 0 or done == config.steps:
                values["held_out_kl"] = held_out_kl()
            log.log(done, values)
            if done % config.save_every == 0 or done == config.steps:
                checkpoints.save(training_client, config.log_dir, done, name=f"step-{done:06d}")
            progress.update(task, completed=done, description=f"distill kl {kl:.3f}")

    log.plot(["kl", "held_out_kl"], "kl")
    log.close()
    service.close()


if __name__ == "__main__":
    main()
