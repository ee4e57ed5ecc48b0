"""Unit tests of the cookbook's components: no server, each in milliseconds."""

from __future__ import annotations

import itertools
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import tokenizers
import torch
from pydantic import BaseModel, Field

from treadle.tokenizer import Tokenizer
from treadle.types import Datum, ForwardBackwardOutput, ModelInput, TensorData
from treadle_cookbook import checkpoints, data, distill, evaluation, metrics, preference
from treadle_cookbook.config import RecipeConfig
from treadle_cookbook.renderers import FALLBACK_TEMPLATE, Renderer
from treadle_cookbook.schedules import Schedule

pytestmark = pytest.mark.unit

# The tokenizer files Treadle's tiny models are served with (ChatML template, BPE 1k).
TINY_TOKENIZER = Path(__file__).resolve().parents[2] / "gpu_worker" / "assets" / "bpe-1k"


# -- config ---------------------------------------------------------------------------------


class Nested(BaseModel):
    warmup_steps: int = 0
    kind: str = "constant"


class ExampleConfig(RecipeConfig):
    model: str = "treadle/tiny-1m"
    log_dir: Path = Path("/tmp/example")
    learning_rate: float = 1e-4
    schedule: Nested = Nested()
    layers: list[int] = Field(default_factory=lambda: [1])


def test_cli_overrides_are_converted_and_nested() -> None:
    config = ExampleConfig.from_cli(
        ["--learning_rate", "0.01", "--schedule.warmup_steps=5", "--seed", "3", "--layers=[2, 3]"]
    )
    assert config.learning_rate == 0.01
    assert config.schedule == Nested(warmup_steps=5)
    assert config.seed == 3
    assert config.layers == [2, 3]


def test_base_url_and_api_key_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TREADLE_BASE_URL", "http://example:9000")
    monkeypatch.setenv("TREADLE_API_KEY", "tml-test")
    config = ExampleConfig.from_cli([])
    assert (config.base_url, config.api_key) == ("http://example:9000", "tml-test")
    monkeypatch.delenv("TREADLE_BASE_URL")
    assert ExampleConfig.from_cli([]).base_url == "http://127.0.0.1:8000"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--learning_rate", "fast"], "--learning_rate: Input should be a valid number"),
        (["--lerning_rate", "0.1"], "--lerning_rate: Extra inputs are not permitted"),
        (["--seed"], "--seed needs a value"),
        (["seed", "1"], "unexpected argument 'seed'"),
    ],
)
def test_bad_arguments_name_what_to_fix(argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as raised:
        ExampleConfig.from_cli(argv)
    assert message in str(raised.value.code)


def test_required_fields_are_reported() -> None:
    with pytest.raises(SystemExit) as raised:
        RecipeConfig.from_cli(["--model", "m"])
    assert "--log_dir: Field required" in str(raised.value.code)


def test_help_lists_the_fields(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as raised:
        ExampleConfig.from_cli(["--help"])
    assert raised.value.code == 0
    out = capsys.readouterr().out
    for field in ("--learning_rate", "--schedule", "--model", "--log_dir", "--mlflow_uri"):
        assert field in out


def test_save_writes_config_json_without_the_key(tmp_path: Path) -> None:
    config = ExampleConfig.from_cli(["--api_key", "secret", "--seed", "7"])
    path = config.save(tmp_path / "run")
    saved = json.loads(path.read_text())
    assert path.name == "config.json"
    assert saved["seed"] == 7 and saved["schedule"]["warmup_steps"] == 0
    assert "api_key" not in saved


# -- metrics --------------------------------------------------------------------------------


def test_metrics_are_appended_as_json_lines_and_read_back(tmp_path: Path) -> None:
    log = metrics.MetricsLog(tmp_path)
    log.log(0, {"loss": 2.0})
    log.log(1, {"loss": 1.5, "lr": 0.1})
    log.close()
    again = metrics.MetricsLog(tmp_path)
    again.log(2, {"loss": 1.0})
    again.close()
    assert metrics.read(tmp_path) == [
        {"step": 0, "loss": 2.0},
        {"step": 1, "loss": 1.5, "lr": 0.1},
        {"step": 2, "loss": 1.0},
    ]
    assert metrics.read(tmp_path / "missing") == []


def test_plot_writes_a_png_and_refuses_unknown_keys(tmp_path: Path) -> None:
    log = metrics.MetricsLog(tmp_path)
    for step in range(3):
        log.log(step, {"loss": 3.0 - step})
    path = log.plot(["loss", "absent"], "loss")
    assert path == tmp_path / "loss.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no values logged for \\['absent'\\]"):
        log.plot(["absent"], "nothing")
    log.close()


def test_an_mlflow_uri_sends_each_step_to_mlflow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[str, Any]] = []
    fake = SimpleNamespace(
        set_tracking_uri=lambda uri: calls.append(("uri", uri)),
        start_run=lambda run_name: calls.append(("start", run_name)),
        log_metrics=lambda values, step: calls.append(("log", (step, values))),
        end_run=lambda: calls.append(("end", None)),
    )
    monkeypatch.setitem(sys.modules, "mlflow", fake)
    log = metrics.MetricsLog(tmp_path / "run-7", mlflow_uri="file:///tmp/mlruns")
    log.log(3, {"loss": 1.5})
    log.close()
    assert calls == [
        ("uri", "file:///tmp/mlruns"),
        ("start", "run-7"),
        ("log", (3, {"loss": 1.5})),
        ("end", None),
    ]
    assert metrics.read(tmp_path / "run-7") == [{"step": 3, "loss": 1.5}]


def test_an_mlflow_uri_without_mlflow_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(ImportError, match="needs the mlflow package: pip install mlflow"):
        metrics.MetricsLog(tmp_path, mlflow_uri="file:///tmp/mlruns")


def test_mlflow_receives_the_metrics(tmp_path: Path) -> None:
    import mlflow  # the test install carries the cookbook's mlflow extra

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    log = metrics.MetricsLog(tmp_path / "run", mlflow_uri=uri)
    log.log(0, {"loss": 2.0})
    log.log(1, {"loss": 1.0})
    log.close()
    mlflow.set_tracking_uri(uri)
    run = mlflow.search_runs(search_all_experiments=True, output_format="list")[0]
    history = mlflow.MlflowClient(uri).get_metric_history(run.info.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(0, 2.0), (1, 1.0)]


# -- checkpoints ----------------------------------------------------------------------------


class FakeTrainingClient:
    """Records save_state names and answers with the path a server would."""

    def __init__(self, run: str) -> None:
        self.run = run

    def save_state(self, name: str) -> Any:
        path = f"tinker://{self.run}/weights/{name}"
        return SimpleNamespace(result=lambda: SimpleNamespace(path=path))


class FakeServiceClient:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def create_training_client_from_state_with_optimizer(self, path: str) -> str:
        self.calls.append(("resume", path))
        return "resumed-client"

    def create_lora_training_client(self, model: str, *, rank: int, seed: int) -> str:
        self.calls.append(("new", (model, rank, seed)))
        return "new-client"

    def create_training_client_from_state(self, path: str) -> str:
        self.calls.append(("load", path))
        return "loaded-client"


def test_checkpoints_are_listed_and_the_latest_resumed(tmp_path: Path) -> None:
    config = ExampleConfig(log_dir=tmp_path, lora_rank=4, seed=2)
    service = FakeServiceClient()
    assert checkpoints.latest(tmp_path) is None
    assert checkpoints.resume(service, tmp_path, config) == ("new-client", 0)  # type: ignore[arg-type]
    assert service.calls == [("new", ("treadle/tiny-1m", 4, 2))]

    client = FakeTrainingClient("run-1")
    assert checkpoints.save(client, tmp_path, 2, name="step_2") == "tinker://run-1/weights/step_2"  # type: ignore[arg-type]
    checkpoints.save(client, tmp_path, 4, name="step_4")  # type: ignore[arg-type]
    assert [c["step"] for c in checkpoints.read(tmp_path)] == [2, 4]
    assert checkpoints.latest(tmp_path) == {
        "step": 4,
        "name": "step_4",
        "path": "tinker://run-1/weights/step_4",
    }
    assert checkpoints.resume(service, tmp_path, config) == ("resumed-client", 4)  # type: ignore[arg-type]
    assert service.calls[-1] == ("resume", "tinker://run-1/weights/step_4")


def test_a_new_run_starts_from_load_checkpoint_path_until_it_has_checkpoints(
    tmp_path: Path,
) -> None:
    sft = "tinker://sft-run/weights/step-000015"
    config = ExampleConfig(log_dir=tmp_path, load_checkpoint_path=sft)
    service = FakeServiceClient()
    assert checkpoints.resume(service, tmp_path, config) == ("loaded-client", 0)  # type: ignore[arg-type]
    assert service.calls == [("load", sft)]  # the weights, with a fresh optimizer
    checkpoints.save(FakeTrainingClient("rl-run"), tmp_path, 3, name="step_3")  # type: ignore[arg-type]
    assert checkpoints.resume(service, tmp_path, config) == ("resumed-client", 3)  # type: ignore[arg-type]
    assert service.calls[-1] == ("resume", "tinker://rl-run/weights/step_3")


# -- data -----------------------------------------------------------------------------------


def test_the_sample_files_load() -> None:
    conversations = data.load_conversations(data.SAMPLE_DIR / "chat_sample.jsonl")
    assert len(conversations) >= 30
    assert all(any(m["role"] == "assistant" for m in c) for c in conversations)
    pairs = data.load_preferences(data.SAMPLE_DIR / "preference_sample.jsonl", limit=5)
    assert len(pairs) == 5
    assert pairs[0].prompt == [{"role": "user", "content": "What is 2 plus 3?"}]
    assert pairs[0].chosen != pairs[0].rejected


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"text": "hi"}, "record 0: expected a non-empty list"),
        ({"messages": [{"role": "bot", "content": "x"}]}, "needs a role in"),
        ({"messages": [{"role": "user", "content": "x"}]}, "no assistant message"),
    ],
)
def test_bad_conversations_name_the_record(
    tmp_path: Path, record: dict[str, Any], message: str
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(ValueError, match=message):
        data.load_conversations(path)


def test_a_dataset_name_needs_the_datasets_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match="needs the `datasets` package"):
        data.load_conversations("allenai/tulu-3-sft-mixture")


def test_held_out_split_is_seeded_and_disjoint() -> None:
    items = list(range(20))
    train, held_out = data.split_held_out(items, 0.25, seed=1)
    assert len(held_out) == 5 and sorted(train + held_out) == items
    assert data.split_held_out(items, 0.25, seed=1) == (train, held_out)
    assert data.split_held_out(items, 0.25, seed=2) != (train, held_out)
    with pytest.raises(ValueError, match="leaves none to train on"):
        data.split_held_out([1], 0.5, seed=0)


def test_batches_cover_each_epoch_once_and_depend_only_on_seed_and_step() -> None:
    items = list(range(10))
    epoch = [x for step in range(5) for x in data.batch(items, 2, step, seed=3)]
    assert sorted(epoch) == items and epoch != items
    assert data.batch(items, 2, 4, seed=3) == epoch[8:10]
    second_epoch = [x for step in range(5, 10) for x in data.batch(items, 2, step, seed=3)]
    assert sorted(second_epoch) == items and second_epoch != epoch
    # A batch across the end of an epoch continues into the next one.
    assert data.batch(items, 4, 2, seed=3) == epoch[8:10] + second_epoch[:2]


# -- renderers ------------------------------------------------------------------------------

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 plus 3?"},
    {"role": "assistant", "content": "2 plus 3 is 5."},
    {"role": "user", "content": "And 1 plus 1?"},
    {"role": "assistant", "content": "2."},
]


@pytest.fixture(scope="module")
def tiny_tokenizer() -> Tokenizer:
    backend = tokenizers.Tokenizer.from_file(str(TINY_TOKENIZER / "tokenizer.json"))
    config = json.loads((TINY_TOKENIZER / "tokenizer_config.json").read_text())
    return Tokenizer(backend, config)


def _trained_text(tokenizer: Tokenizer, tokens: list[int], weights: list[float]) -> str:
    return tokenizer.decode([t for t, w in zip(tokens, weights, strict=True) if w == 1.0])


def test_render_matches_the_template_and_trains_on_replies_only(tiny_tokenizer: Tokenizer) -> None:
    rendered = Renderer(tiny_tokenizer).render(CHAT)
    assert rendered.tokens == tiny_tokenizer.apply_chat_template(CHAT)
    assert set(rendered.weights) == {0.0, 1.0}
    trained = _trained_text(tiny_tokenizer, rendered.tokens, rendered.weights)
    assert trained == "2 plus 3 is 5.<|im_end|>\n2.<|im_end|>\n"
    last = Renderer(tiny_tokenizer).render(CHAT, last_only=True)
    assert last.tokens == rendered.tokens
    assert _trained_text(tiny_tokenizer, last.tokens, last.weights) == "2.<|im_end|>\n"


def test_prompt_ends_with_the_assistant_header(tiny_tokenizer: Tokenizer) -> None:
    renderer = Renderer(tiny_tokenizer)
    prompt = renderer.prompt(CHAT[:2]).to_ints()
    assert prompt == tiny_tokenizer.apply_chat_template(CHAT[:2], add_generation_prompt=True)
    assert renderer.end_of_turn == tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    reply = renderer.reply(CHAT[:2], "5.")
    assert reply.tokens[: len(prompt)] == prompt
    assert _trained_text(tiny_tokenizer, reply.tokens, reply.weights) == "5.<|im_end|>\n"


def test_a_tokenizer_without_template_gets_the_fallback(tiny_tokenizer: Tokenizer) -> None:
    bare = Tokenizer(tiny_tokenizer.backend, {"eos_token": "<|im_end|>"})
    renderer = Renderer(bare)
    assert renderer.uses_fallback and not Renderer(tiny_tokenizer).uses_fallback
    rendered = renderer.render(CHAT[1:3])
    assert bare.decode(rendered.tokens) == (
        "### user\nWhat is 2 plus 3?<|im_end|>\n### assistant\n2 plus 3 is 5.<|im_end|>\n"
    )
    assert _trained_text(bare, rendered.tokens, rendered.weights) == "2 plus 3 is 5.<|im_end|>\n"
    assert "eos_token" in FALLBACK_TEMPLATE


def test_datum_shifts_tokens_and_weights(tiny_tokenizer: Tokenizer) -> None:
    rendered = Renderer(tiny_tokenizer).render(CHAT[1:3])
    datum = rendered.to_datum()
    assert datum.model_input.to_ints() == rendered.tokens[:-1]
    assert datum.loss_fn_inputs["target_tokens"].tolist() == rendered.tokens[1:]
    assert datum.loss_fn_inputs["weights"].tolist() == rendered.weights[1:]


def test_a_template_that_rewrites_earlier_turns_is_refused(tiny_tokenizer: Tokenizer) -> None:
    changing = "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    renderer = Renderer(Tokenizer(tiny_tokenizer.backend, {}, changing))
    with pytest.raises(ValueError, match="renders message 0 \\(user\\) so that"):
        renderer.render(CHAT[1:3])


# -- schedules and evaluation ---------------------------------------------------------------


def test_schedules_warm_up_then_hold_or_decay() -> None:
    constant = Schedule(warmup_steps=3)
    assert [constant.learning_rate(1.0, s, 10) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    linear = Schedule(kind="linear", min_ratio=0.1)
    assert linear.learning_rate(1.0, 0, 10) == 1.0
    assert linear.learning_rate(1.0, 5, 10) == pytest.approx(0.55)
    assert linear.learning_rate(1.0, 10, 10) == pytest.approx(0.1)
    cosine = Schedule(kind="cosine", warmup_steps=2)
    rates = [cosine.learning_rate(2.0, s, 12) for s in range(12)]
    assert rates[2] == 2.0 and rates[7] == pytest.approx(1.0)
    assert all(a >= b for a, b in itertools.pairwise(rates[2:]))


def test_mean_token_loss_weights_each_token() -> None:
    data = [
        Datum(
            model_input=ModelInput.from_ints([1, 2, 3]),
            loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [0.0, 1.0, 1.0]},
        )
    ]
    output = ForwardBackwardOutput(
        loss_fn_outputs=[{"logprobs": TensorData.from_list([-9.0, -1.0, -3.0], "float32")}]
    )
    assert evaluation.mean_token_loss(data, output) == pytest.approx(2.0)
    unweighted = [
        Datum(
            model_input=ModelInput.from_ints([1, 2, 3]),
            loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [0.0, 0.0, 0.0]},
        )
    ]
    with pytest.raises(ValueError, match="no trained tokens"):
        evaluation.mean_token_loss(unweighted, output)


# -- preference losses ----------------------------------------------------------------------


def _pair_batch() -> tuple[list[Datum], list[torch.Tensor], list[float]]:
    """Two pairs; 3 target positions each, the last two the reply's."""
    mask = [0.0, 1.0, 1.0]
    data = [
        Datum(
            model_input=ModelInput.from_ints([1, 2, 3]),
            loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": mask},
        )
        for _ in range(4)
    ]
    logprobs = [
        torch.tensor(values, requires_grad=True)
        for values in (
            [-5.0, -1.0, -1.0],
            [-5.0, -2.0, -1.0],
            [-5.0, -3.0, -1.0],
            [-5.0, -1.0, -1.0],
        )
    ]
    reference = [-2.5, -2.5, -3.0, -3.0]
    return data, logprobs, reference


def test_dpo_loss_matches_its_formula_and_favours_the_chosen_reply() -> None:
    data, logprobs, reference = _pair_batch()
    loss, metrics = preference.dpo_loss(reference, beta=0.5)(data, logprobs)
    # Rewards: 0.5, -0.5, -1.0, 1.0 -> margins 1.0 and -2.0.
    expected = (
        -torch.nn.functional.logsigmoid(torch.tensor(0.5))
        - torch.nn.functional.logsigmoid(torch.tensor(-1.0))
    ) / 2
    assert loss.item() == pytest.approx(expected.item())
    assert metrics == {"dpo_margin": pytest.approx(-0.5), "dpo_accuracy": 0.5}
    loss.backward()
    for chosen, rejected in ((logprobs[0], logprobs[1]), (logprobs[2], logprobs[3])):
        assert chosen.grad is not None and rejected.grad is not None
        assert chosen.grad[0] == 0 and rejected.grad[0] == 0  # the prompt is masked
        assert (chosen.grad[1:] < 0).all() and (rejected.grad[1:] > 0).all()


def test_kto_loss_matches_its_formula() -> None:
    data, logprobs, reference = _pair_batch()
    loss, metrics = preference.kto_loss(reference, beta=2.0, undesirable_weight=0.5)(data, logprobs)
    rewards = torch.tensor([0.5, -0.5, -1.0, 1.0])
    z = 0.0  # the mean reward (0) clamped at 0
    desirable = 1 - torch.sigmoid(2.0 * (rewards[[0, 2]] - z))
    undesirable = 0.5 * (1 - torch.sigmoid(2.0 * (z - rewards[[1, 3]])))
    assert loss.item() == pytest.approx(torch.cat([desirable, undesirable]).mean().item())
    assert metrics["kto_margin"] == pytest.approx(-0.5)
    assert metrics["kto_chosen_reward"] == pytest.approx(-0.25)
    loss.backward()
    assert logprobs[0].grad is not None and (logprobs[0].grad[1:] < 0).all()
    assert logprobs[1].grad is not None and (logprobs[1].grad[1:] > 0).all()


def test_a_preference_batch_must_be_pairs_with_references() -> None:
    data, logprobs, reference = _pair_batch()
    with pytest.raises(ValueError, match="got 3 datums and 4 reference values"):
        preference.dpo_loss(reference, beta=0.1)(data[:3], logprobs[:3])


def test_margins_pair_up_interleaved_rewards() -> None:
    assert preference.margins([-1.0, -3.0, -2.0, -2.0], [-2.0, -2.0, -2.0, -1.0]) == [2.0, 1.0]


def test_a_batch_brings_its_pairs_reference_values_in_order() -> None:
    # Six datums (three pairs); datum i's token and reference value are both i.
    datums = [
        Datum(
            model_input=ModelInput.from_ints([i]),
            loss_fn_inputs={"target_tokens": [i], "weights": [1.0]},
        )
        for i in range(6)
    ]
    run = preference.PreferenceRun(
        training_client=None,  # type: ignore[arg-type]  # batch() needs no server
        start_step=0,
        train_data=datums,
        held_out_data=[],
        reference={"train": [float(i) for i in range(6)], "held_out": []},
    )
    first_rows = []
    for step in range(3):
        batch, values = run.batch(step, batch_size=1, seed=0)
        rows = [datum.model_input.to_ints()[0] for datum in batch]
        assert rows[0] % 2 == 0 and rows[1] == rows[0] + 1  # chosen, then its rejected
        assert values == [float(row) for row in rows]
        first_rows.append(rows[0])
    assert sorted(first_rows) == [0, 2, 4]  # one epoch sees every pair once


_OPTIONS = {"model": "treadle/tiny-1m", "data": "pairs.jsonl", "seed": 0, "held_out_fraction": 0.2}


def test_the_reference_reads_back_for_the_same_options_and_tokens(tmp_path: Path) -> None:
    data_, _, reference = _pair_batch()
    splits = {"train": data_, "held_out": data_[:2]}
    values = {"train": reference, "held_out": reference[:2]}
    path = tmp_path / preference.REFERENCE_FILE
    preference.save_reference(path, values, _OPTIONS, splits)
    assert preference.load_reference(path, dict(_OPTIONS), splits) == values


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"seed": 1}, "with --seed 0 \\(this run: 1\\); rerun with those values"),
        ({"held_out_fraction": 0.5}, "--held_out_fraction 0.2 \\(this run: 0.5\\)"),
        (
            {"data": "other.jsonl", "model": "m"},
            "--model 'treadle/tiny-1m' \\(this run: 'm'\\), --data",
        ),
    ],
)
def test_the_reference_refuses_other_options(
    tmp_path: Path, changes: dict[str, Any], message: str
) -> None:
    data_, _, reference = _pair_batch()
    splits = {"train": data_, "held_out": []}
    path = tmp_path / preference.REFERENCE_FILE
    preference.save_reference(path, {"train": reference, "held_out": []}, _OPTIONS, splits)
    with pytest.raises(SystemExit, match=message):
        preference.load_reference(path, {**_OPTIONS, **changes}, splits)


def test_the_reference_refuses_other_tokens_and_a_missing_file(tmp_path: Path) -> None:
    data_, _, reference = _pair_batch()
    path = tmp_path / preference.REFERENCE_FILE
    preference.save_reference(
        path, {"train": reference, "held_out": []}, _OPTIONS, {"train": data_, "held_out": []}
    )
    edited = data_[0].model_copy(update={"model_input": ModelInput.from_ints([1, 2, 9])})
    with pytest.raises(SystemExit, match=r"other tokens than this run's.*pass a new --log_dir"):
        preference.load_reference(path, _OPTIONS, {"train": [edited, *data_[1:]], "held_out": []})
    # The same datums split differently are other data too.
    with pytest.raises(SystemExit, match="other tokens"):
        preference.load_reference(path, _OPTIONS, {"train": data_[:2], "held_out": data_[2:]})
    with pytest.raises(SystemExit, match="is missing and cannot be recomputed"):
        preference.load_reference(tmp_path / "none.json", _OPTIONS, {"train": data_})


def test_the_losses_name_the_extra_that_installs_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'treadle-cookbook\[preference\]'"):
        preference.dpo_loss([0.0, 0.0], beta=0.1)


# -- distillation ---------------------------------------------------------------------------


class FakeTeacher:
    """Answers top-k prompt logprobs: position j's entries favour token j, k = 2."""

    def __init__(self) -> None:
        self.asked: list[tuple[list[int], int]] = []

    def sample(self, prompt: ModelInput, num_samples: int, params: Any, **kwargs: int) -> Any:
        tokens = prompt.to_ints()
        self.asked.append((tokens, kwargs["topk_prompt_logprobs"]))
        topk = [None] + [[(j, math.log(0.6)), (99, math.log(0.2))] for j in range(1, len(tokens))]
        response = SimpleNamespace(topk_prompt_logprobs=topk)
        return SimpleNamespace(result=lambda: response)


def test_teacher_top_k_becomes_weighted_2d_targets_and_a_kl() -> None:
    datum = Datum(
        model_input=ModelInput.from_ints([5, 6, 7]),
        loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [0.0, 1.0, 1.0]},
    )
    teacher = FakeTeacher()
    (targets,) = distill.teacher_targets(teacher, [datum], k=2)  # type: ignore[arg-type]
    assert teacher.asked == [([5, 6, 7, 8], 2)]
    assert targets.tokens_NK == [[1, 99], [2, 99], [3, 99]]
    assert targets.probs_NK[0] == pytest.approx([0.75, 0.25])

    soft = distill.distill_datum(datum, targets)
    assert soft.loss_fn_inputs["target_tokens"].dense_shape == [3, 2]
    weights = [w for row in soft.loss_fn_inputs["weights"].tolist() for w in row]
    assert weights == pytest.approx([0.0, 0.0, 0.75, 0.25, 0.75, 0.25])
    # A student matching the teacher's renormalised top-2 has KL 0; a uniform one does not.
    exact = [[math.log(0.75), math.log(0.25)]] * 3
    uniform = [[math.log(0.5), math.log(0.5)]] * 3
    for student, want in ((exact, 0.0), (uniform, 0.75 * math.log(1.5) + 0.25 * math.log(0.5))):
        output = ForwardBackwardOutput(
            loss_fn_outputs=[{"logprobs": TensorData.from_list(student, "float32")}]
        )
        assert distill.kl_to_teacher([soft], [targets], output) == pytest.approx(want, abs=1e-6)
