"""Supervised fine-tuning on chat conversations: the loss on assistant replies falls.

    python -m treadle_cookbook.recipes.sft_chat --model treadle/tiny-1m --log_dir /tmp/sft

Conversations (`messages` lists, a JSON-lines file or a Hugging Face dataset name) are rendered
with the served model's chat template; only the assistant's tokens are trained. Each step
takes `batch_size` conversations, runs one cross-entropy forward_backward and one optim_step
at the schedule's learning rate. The held-out conversations' loss (a forward pass, no update)
is measured at the start, every `eval_every` steps and at the end. A state checkpoint is saved
every `save_every` steps and at the end.

Writes config.json, metrics.jsonl (per step: train_loss, learning_rate; per evaluation:
held_out_loss), checkpoints.jsonl and loss.png to `log_dir`. Interrupted, the same command
continues from the latest checkpoint, on the same batches.
"""

from __future__ import annotations

from pydantic import Field
from rich.progress import Progress

from treadle import ServiceClient
from treadle.types import AdamParams
from treadle_cookbook import checkpoints, data, evaluation
from treadle_cookbook.config import RecipeConfig
from treadle_cookbook.metrics import MetricsLog
from treadle_cookbook.renderers import Renderer
from treadle_cookbook.schedules import Schedule


class Config(RecipeConfig):
    model: str = Field(default="treadle/tiny-1m", description="the served base model")
    data: str = Field(
        default=str(data.SAMPLE_DIR / "chat_sample.jsonl"),
        description="a JSON-lines file of {messages: [...]} or a Hugging Face dataset name",
    )
    limit: int | None = Field(default=None, description="use only the first N conversations")
    held_out_fraction: float = Field(default=0.1, description="share kept out for held-out loss")
    steps: int = Field(default=20, description="optimizer steps in all (a resumed run included)")
    batch_size: int = Field(default=8, description="conversations per step")
    learning_rate: float = Field(default=5e-3, description="peak learning rate")
    schedule: Schedule = Field(default_factory=Schedule, description="learning-rate schedule")
    eval_every: int = Field(default=5, description="steps between held-out evaluations")
    save_every: int = Field(default=10, description="steps between state checkpoints")


def main(argv: list[str] | None = None) -> None:
    config = Config.from_cli(argv)
    config.save(config.log_dir)
    service = ServiceClient(base_url=config.base_url, api_key=config.api_key)
    training_client, start_step = checkpoints.resume(service, config.log_dir, config)
    renderer = Renderer(training_client.get_tokenizer())

    conversations = data.load_conversations(config.data, limit=config.limit)
    train, held_out = data.split_held_out(conversations, config.held_out_fraction, config.seed)
    train_data = [renderer.render(conversation).to_datum() for conversation in train]
    held_out_data = [renderer.render(conversation).to_datum() for conversation in held_out]

    log = MetricsLog(config.log_dir, config.mlflow_uri)
    if start_step == 0 and held_out_data:
        log.log(0, {"held_out_loss": evaluation.held_out_loss(training_client, held_out_data)})
    with Progress() as progress:
        task = progress.add_task("sft_chat", total=config.steps, completed=start_step)
        for step in range(start_step, config.steps):
            batch = data.batch(train_data, config.batch_size, step, config.seed)
            learning_rate = config.schedule.learning_rate(config.learning_rate, step, config.steps)
            backward = training_client.forward_backward(batch, "cross_entropy")
            training_client.optim_step(AdamParams(learning_rate=learning_rate)).result()
            train_loss = evaluation.mean_token_loss(batch, backward.result())
            values = {"train_loss": train_loss, "learning_rate": learning_rate}

            done = step + 1
            if held_out_data and (done % config.eval_every == 0 or done == config.steps):
                values["held_out_loss"] = evaluation.held_out_loss(training_client, held_out_data)
            log.log(done, values)
            if done % config.save_every == 0 or done == config.steps:
                checkpoints.save(training_client, config.log_dir, done, name=f"step-{done:06d}")
            progress.update(task, completed=done, description=f"sft_chat loss {train_loss:.3f}")

    log.plot(["train_loss", "held_out_loss"], "loss")
    log.close()
    service.close()


if __name__ == "__main__":
    main()
