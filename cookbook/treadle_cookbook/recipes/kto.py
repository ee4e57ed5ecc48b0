"""KTO: chosen replies become likelier than the reference's, rejected ones less likely.

    python -m treadle_cookbook.recipes.kto --model treadle/tiny-1m --log_dir /tmp/kto

Preference pairs (prompt, chosen, rejected; a JSON-lines file or a Hugging Face dataset name)
are rendered with the served model's chat template. At the first start the reference logprob
of every reply is computed once, by a forward pass on the run's initial weights, and kept in
`log_dir/reference.json` with the model and data it belongs to (a resumed run reads it back and
refuses one computed for other pairs). Each step takes `batch_size` pairs and runs the KTO loss
through `forward_backward_custom` (computed here, in torch) and one optim_step: each chosen
reply is a desirable example and each rejected one an undesirable example, as KTO needs no
pairing (`preference.kto_loss` says how its reference point is estimated). The reward margin
(policy minus reference logprob of the chosen reply, minus the same for the rejected one) on
the training and held-out pairs is measured by a forward pass at the start, every `eval_every`
steps and at the end.

Writes config.json, metrics.jsonl (per step: kto_loss, kto_chosen_reward,
kto_rejected_reward, kto_margin; per evaluation: train_margin, held_out_margin),
checkpoints.jsonl and margin.png to `log_dir`. Interrupted, the same command continues from
the latest checkpoint. Needs torch: `pip install 'treadle-cookbook[preference]'`.
"""

from __future__ import annotations

from pydantic import Field
from rich.progress import Progress

from treadle import ServiceClient
from treadle.types import AdamParams
from treadle_cookbook import checkpoints, preference
from treadle_cookbook.metrics import MetricsLog


class Config(preference.PreferenceConfig):
    desirable_weight: float = Field(default=1.0, description="weight of chosen replies' loss")
    undesirable_weight: float = Field(default=1.0, description="weight of rejected replies' loss")


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
            task = progress.add_task("kto", total=config.steps, completed=run.start_step)
            for step in range(run.start_step, config.steps):
                datums, reference = run.batch(step, config.batch_size, config.seed)
                loss_fn = preference.kto_loss(
                    reference, config.beta, config.desirable_weight, config.undesirable_weight
                )
                backward = run.training_client.forward_backward_custom(datums, loss_fn)
                run.training_client.optim_step(
                    AdamParams(learning_rate=config.learning_rate)
                ).result()
                metrics = backward.result().metrics
                values = {
                    "kto_loss": metrics["loss:sum"],
                    "kto_chosen_reward": metrics["kto_chosen_reward"],
                    "kto_rejected_reward": metrics["kto_rejected_reward"],
                    "kto_margin": metrics["kto_margin"],
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
                    task, completed=done, description=f"kto margin {values['kto_margin']:.3f}"
                )

        log.plot(["kto_margin", "train_margin", "held_out_margin"], "margin")
        log.close()


if __name__ == "__main__":
    main()
