"""Direct preference optimisation: the chosen reply's reward margin over the rejected rises.

    python -m treadle_cookbook.recipes.dpo --model treadle/tiny-1m --log_dir /tmp/dpo

Preference pairs (prompt, chosen, rejected; a JSON-lines file or a Hugging Face dataset name)
are rendered with the served model's chat template. At the first start the reference logprob
of every reply is computed once, from a sampling client of the run's initial weights, and kept
in `log_dir/reference.json` (a resumed run reads it back). Each step takes `batch_size` pairs
and runs the DPO loss through `forward_backward_custom` (computed here, in torch) and one
optim_step. The reward margin (policy minus reference logprob of the chosen reply, minus the
same for the rejected one) on the training and held-out pairs is measured by a forward pass at
the start, every `eval_every` steps and at the end.

Writes config.json, metrics.jsonl (per step: dpo_loss, dpo_margin, dpo_accuracy; per
evaluation: train_margin, held_out_margin), checkpoints.jsonl and margin.png to `log_dir`.
Interrupted, the same command continues from the latest checkpoint.
"""

from __future__ import annotations

import json
import statistics

from pydantic import Field
from rich.progress import Progress

from treadle import ServiceClient
from treadle.types import AdamParams
from treadle_cookbook import checkpoints, data, preference
from treadle_cookbook.config import RecipeConfig
from treadle_cookbook.metrics import MetricsLog
from treadle_cookbook.renderers import Renderer


class Config(RecipeConfig):
    model: str = Field(default="treadle/tiny-1m", description="the served base model")
    data: str = Field(
        default=str(data.SAMPLE_DIR / "preference_sample.jsonl"),
        description="a JSON-lines file of {prompt, chosen, rejected} or a dataset name",
    )
    held_out_fraction: float = Field(default=0.2, description="share of pairs held out")
    steps: int = Field(default=10, description="optimizer steps in all (a resumed run included)")
    batch_size: int = Field(default=4, description="pairs per step")
    learning_rate: float = Field(default=2e-3, description="learning rate")
    beta: float = Field(default=0.1, description="DPO's beta: how far from the reference")
    eval_every: int = Field(default=5, description="steps between margin evaluations")
    save_every: int = Field(default=5, description="steps between state checkpoints")


def main(argv: list[str] | None = None) -> None:
    config = Config.from_cli(argv)
    config.save(config.log_dir)
    service = ServiceClient(base_url=config.base_url, api_key=config.api_key)
    training_client, start_step = checkpoints.resume(service, config.log_dir, config)
    renderer = Renderer(training_client.get_tokenizer())

    pairs = data.load_preferences(config.data)
    train, held_out = data.split_held_out(pairs, config.held_out_fraction, config.seed)
    train_data = preference.pair_datums(renderer, train)
    held_out_data = preference.pair_datums(renderer, held_out)

    reference_file = config.log_dir / "reference.json"
    if start_step > 0 and not reference_file.exists():
        raise SystemExit(
            f"{reference_file} is missing and cannot be recomputed: it holds the initial "
            "weights' logprobs, and this run has trained past them; pass a new --log_dir"
        )
    if start_step == 0:
        reference_client = training_client.save_weights_and_get_sampling_client().result()
        reference_file.write_text(
            json.dumps(
                {
                    "train": preference.reference_logprobs(reference_client, train_data),
                    "held_out": preference.reference_logprobs(reference_client, held_out_data),
                }
            )
        )
    reference = json.loads(reference_file.read_text())

    def evaluate() -> dict[str, float]:
        values = {}
        for split, datums in (("train", train_data), ("held_out", held_out_data)):
            policy = preference.policy_logprobs(training_client, datums)
            values[f"{split}_margin"] = statistics.fmean(
                preference.margins(policy, reference[split])
            )
        return values

    # Each step's pairs, as indices so a batch's reference values come with its datums.
    pair_indices = list(range(len(train)))
    log = MetricsLog(config.log_dir, config.mlflow_uri)
    if start_step == 0:
        log.log(0, evaluate())
    with Progress() as progress:
        task = progress.add_task("dpo", total=config.steps, completed=start_step)
        for step in range(start_step, config.steps):
            chosen = data.batch(pair_indices, config.batch_size, step, config.seed)
            rows = [row for pair in chosen for row in (2 * pair, 2 * pair + 1)]
            loss_fn = preference.dpo_loss([reference["train"][row] for row in rows], config.beta)
            backward = training_client.forward_backward_custom(
                [train_data[row] for row in rows], loss_fn
            )
            training_client.optim_step(AdamParams(learning_rate=config.learning_rate)).result()
            metrics = backward.result().metrics
            values = {
                "dpo_loss": metrics["loss:sum"],
                "dpo_margin": metrics["dpo_margin"],
                "dpo_accuracy": metrics["dpo_accuracy"],
            }

            done = step + 1
            if done % config.eval_every == 0 or done == config.steps:
                values.update(evaluate())
            log.log(done, values)
            if done % config.save_every == 0 or done == config.steps:
                checkpoints.save(training_client, config.log_dir, done, name=f"step-{done:06d}")
            progress.update(
                task, completed=done, description=f"dpo margin {values['dpo_margin']:.3f}"
            )

    log.plot(["dpo_margin", "train_margin", "held_out_margin"], "margin")
    log.close()
    service.close()


if __name__ == "__main__":
    main()
