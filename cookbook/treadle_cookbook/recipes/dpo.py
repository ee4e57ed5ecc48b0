"""Direct preference optimisation: the chosen reply's reward margin over the rejected rises.

    python -m treadle_cookbook.recipes.dpo --model treadle/tiny-1m --log_dir /tmp/dpo

Preference pairs (prompt, chosen, rejected; a JSON-lines file or a Hugging Face dataset name)
are rendered with the served model's chat template. At the first start the reference logprob
of every reply is computed once, by a forward pass on the run's initial weights, and kept in
`log_dir/reference.json` with the model and data it belongs to (a resumed run reads it back and
refuses one computed for other pairs). Each step takes `batch_size` pairs and runs the DPO loss
through `forward_backward_custom` (computed here, in torch) and one optim_step. The reward
margin (policy minus reference logprob of the chosen reply, minus the same for the rejected
one) on the training and held-out pairs is measured by a forward pass at the start, every
`eval_every` steps and at the end.

Writes config.json, metrics.jsonl (per step: dpo_loss, dpo_margin, dpo_accuracy; per
evaluation: train_margin, held_out_margin), checkpoints.jsonl and margin.png to `log_dir`.
Interrupted, the same command continues from the latest checkpoint. Needs torch:
`pip install 'treadle-cookbook[preference]'`.
"""

from __future__ import annotations

from rich.progress import Progress

from treadle import ServiceClient
from treadle.types import AdamParams
from treadle_cookbook import checkpoints, preference
from treadle_cookbook.metrics import MetricsLog


class Config(preference.PreferenceConfig):
    """The shared preference settings; DPO's beta is the only knob of its loss."""


def main(argv: list[str] | None = None) -> None:
    config = Config.from_cli(argv)
    config.save(config.log_dir)
    # The session finishes on the way out, marked errored when the recipe stops on an error.
    with ServiceClient(base_url=config.base_url, api_key=config.api_key) as service:
        run = preference.start(service, config)

        log = MetricsLog(config.log_dir, config.mlflow_uri)
        if run.start_step == 0:
            log.log(0, run.evaluate())
        with Progress() as progress:
            task = progress.add_task("dpo", total=config.steps, completed=run.start_step)
            for step in range(run.start_step, config.steps):
                datums, reference = run.batch(step, config.batch_size, config.seed)
                backward = run.training_client.forward_backward_custom(
                    datums, preference.dpo_loss(reference, config.beta)
                )
                run.training_client.optim_step(
                    AdamParams(learning_rate=config.learning_rate)
                ).result()
                metrics = backward.result().metrics
                values = {
                    "dpo_loss": metrics["loss:sum"],
                    "dpo_margin": metrics["dpo_margin"],
                    "dpo_accuracy": metrics["dpo_accuracy"],
                }

                done = step + 1
                if done % config.eval_every == 0 or done == config.steps:
                    values.update(run.evaluate())
                log.log(done, values)
                if done % config.save_every == 0 or done == config.steps:
                    checkpoints.save(
                        run.training_client, config.log_dir, done, name=f"step-{done:06d}"
                    )
                progress.update(
                    task, completed=done, description=f"dpo margin {values['dpo_margin']:.3f}"
                )

        log.plot(["dpo_margin", "train_margin", "held_out_margin"], "margin")
        log.close()


if __name__ == "__main__":
    main()
