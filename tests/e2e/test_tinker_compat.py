"""Code written for the tinker SDK runs with `import treadle as tinker`.

Each snippet below is written once, in the shapes of the tinker docs' quickstart (creation
methods answered with `.result()`, positional arguments, REST calls returning futures), and
takes the SDK module as an argument. It runs against one embedded server with the official
`tinker` package and with `treadle`, each under its own tenant, and both must give the same
results: losses, sampled tokens (seeded), logprobs and checkpoint listings.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
import tinker
from transformers import AutoTokenizer

import treadle
from tests.scenarios import MODEL
from tests.server import LiveServer

pytestmark = pytest.mark.e2e

Snippet = Callable[[ModuleType, str, str], Any]
PROMPT = [15, 16, 17, 18]


def _datum(sdk: ModuleType, offset: int) -> Any:
    tokens = [(7 * i + offset) % 500 + 10 for i in range(17)]
    return sdk.types.Datum(
        model_input=sdk.types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [0.0] * 4 + [1.0] * 12},
    )


def sft_steps(sdk: ModuleType, base_url: str, api_key: str) -> Any:
    service = sdk.ServiceClient(base_url=base_url, api_key=api_key)
    # tinker's positional order: base_model, rank, seed.
    trainer = service.create_lora_training_client(MODEL, 4, 7).result()
    batch = [_datum(sdk, i) for i in range(3)]
    losses = []
    for _ in range(3):
        fwd = trainer.forward_backward(batch, "cross_entropy")
        step = trainer.optim_step(sdk.types.AdamParams(learning_rate=5e-3))
        losses.append(fwd.result().metrics["loss:sum"])
        step.result()
    evaluated = trainer.forward(batch, "cross_entropy").result()
    service.close("success").result(timeout=60)
    return losses, evaluated.metrics["loss:sum"]


def save_and_resume(sdk: ModuleType, base_url: str, api_key: str) -> Any:
    service = sdk.ServiceClient(base_url=base_url, api_key=api_key)
    trainer = service.create_lora_training_client(base_model=MODEL, rank=4, seed=3).result()
    batch = [_datum(sdk, 5)]
    trainer.forward_backward(batch, "cross_entropy")
    trainer.optim_step(sdk.types.AdamParams(learning_rate=1e-2)).result()
    path = trainer.save_state("resume-here").result().path  # positional name
    trainer.forward_backward(batch, "cross_entropy")
    after_save = trainer.optim_step(sdk.types.AdamParams(learning_rate=1e-2))
    after_save.result()
    drifted = trainer.forward(batch, "cross_entropy").result().metrics["loss:sum"]
    trainer.load_state_with_optimizer(path).result()
    reloaded = trainer.forward(batch, "cross_entropy").result().metrics["loss:sum"]
    resumed = service.create_training_client_from_state_with_optimizer(path).result()
    resumed.forward_backward(batch, "cross_entropy")
    resumed.optim_step(sdk.types.AdamParams(learning_rate=1e-2)).result()
    stepped = resumed.forward(batch, "cross_entropy").result().metrics["loss:sum"]
    fresh = service.create_training_client_from_state(path, MODEL).result()
    weights_only = fresh.forward(batch, "cross_entropy").result().metrics["loss:sum"]
    service.close("success").result(timeout=60)
    return path.split("/", 3)[3], drifted, reloaded, stepped, weights_only


def sampling(sdk: ModuleType, base_url: str, api_key: str) -> Any:
    service = sdk.ServiceClient(base_url=base_url, api_key=api_key)
    trainer = service.create_lora_training_client(base_model=MODEL, rank=4, seed=5).result()
    trainer.forward_backward([_datum(sdk, 2)], "cross_entropy")
    trainer.optim_step(sdk.types.AdamParams(learning_rate=5e-2)).result()
    prompt = sdk.types.ModelInput.from_ints(PROMPT)
    params = sdk.types.SamplingParams(max_tokens=6, temperature=1.0, seed=11)

    snapshot = trainer.save_weights_and_get_sampling_client().result()
    named = trainer.save_weights_and_get_sampling_client(name="for-sampling").result()
    saved = trainer.save_weights_for_sampler("by-path").result().path
    by_path = service.create_sampling_client(model_path=saved).result()
    base = service.create_sampling_client(None, MODEL).result()  # (model_path, base_model)
    from_trainer = trainer.create_sampling_client(saved).result()

    results = []
    for sampler in (snapshot, named, by_path, base, from_trainer):
        out = sampler.sample(prompt, 2, params).result()
        results.append(
            (
                [list(s.tokens) for s in out.sequences],
                [s.stop_reason for s in out.sequences],
                sampler.compute_logprobs(prompt).result(),
                sampler.get_base_model(),
            )
        )
    service.close("success").result(timeout=60)
    return results


def rest_listing(sdk: ModuleType, base_url: str, api_key: str) -> Any:
    service = sdk.ServiceClient(base_url=base_url, api_key=api_key)
    trainer = service.create_lora_training_client(base_model=MODEL, rank=4, seed=1).result()
    state = trainer.save_state("kept").result().path
    sampler_path = trainer.save_weights_for_sampler("shared").result().path
    doomed = trainer.save_weights_for_sampler("doomed").result().path
    exported = trainer.save_weights_external("exported", 7200).result().path

    rest = sdk.RestClient(base_url=base_url, api_key=api_key)
    runs = rest.list_training_runs().result()
    run = rest.get_training_run(trainer.model_id).result()
    by_path = rest.get_training_run_by_tinker_path(state).result()
    rest.delete_checkpoint_from_tinker_path(doomed).result()
    rest.publish_checkpoint_from_tinker_path(sampler_path).result()
    rest.set_checkpoint_ttl_from_tinker_path(sampler_path, 7200).result()
    listed = rest.list_checkpoints(trainer.model_id).result().checkpoints
    mine = rest.list_user_checkpoints().result().checkpoints
    info = rest.get_weights_info_by_tinker_path(state).result()
    files = sorted(rest.get_external_weights_urls(exported).result().urls)
    service.close("success").result(timeout=60)
    return (
        [r.training_run_id == trainer.model_id for r in runs.training_runs],
        (run.base_model, run.lora_rank, run.training_run_id == by_path.training_run_id),
        sorted((c.checkpoint_id, c.checkpoint_type, c.public) for c in listed),
        sorted(c.checkpoint_id for c in mine),
        (info.base_model, info.lora_rank),
        files,
    )


def async_loop(sdk: ModuleType, base_url: str, api_key: str) -> Any:
    async def main() -> Any:
        service = sdk.ServiceClient(base_url=base_url, api_key=api_key)
        trainer = await service.create_lora_training_client(MODEL, 4, 9)  # awaiting the future
        also = await service.create_lora_training_client_async(MODEL, 4, 9)
        batch = [_datum(sdk, 4)]
        losses = []
        for client in (trainer, also, trainer):
            fwd = await client.forward_backward_async(batch, "cross_entropy")
            step = await client.optim_step_async(sdk.types.AdamParams(learning_rate=1e-2))
            losses.append((await fwd).metrics["loss:sum"])
            await step.result_async()
        sampler = await trainer.save_weights_and_get_sampling_client_async()
        params = sdk.types.SamplingParams(max_tokens=4, seed=2)
        sampled = await sampler.sample_async(sdk.types.ModelInput.from_ints(PROMPT), 1, params)
        await service.close("success")
        return losses, sampled.sequences[0].tokens

    return asyncio.run(main())


SNIPPETS: dict[str, Snippet] = {
    "sft_steps": sft_steps,
    "save_and_resume": save_and_resume,
    "sampling": sampling,
    "rest_listing": rest_listing,
    "async_loop": async_loop,
}


@pytest.mark.parametrize("name", list(SNIPPETS))
def test_snippet_gives_tinkers_results(live_server: LiveServer, name: str) -> None:
    snippet = SNIPPETS[name]
    expected = snippet(tinker, live_server.base_url, live_server.make_tenant().key)
    got = snippet(treadle, live_server.base_url, live_server.make_tenant().key)
    assert got == expected


def test_sampling_snippet_results_are_not_trivial(live_server: LiveServer) -> None:
    """The sampling comparison means something: the trained weights sample differently from
    the base model, and every sampler returns tokens and logprobs."""
    with pytest.warns(DeprecationWarning, match="has no effect"):  # name=, as in tinker
        results = sampling(treadle, live_server.base_url, live_server.make_tenant().key)
    snapshot, named, by_path, base, from_trainer = results
    assert snapshot == named == by_path == from_trainer
    assert base[2] != snapshot[2]
    assert all(len(tokens) == 6 for tokens in snapshot[0])


def test_tokenizer_has_the_transformers_interface(live_server: LiveServer, tmp_path: Path) -> None:
    """`get_tokenizer()` answers as the transformers tokenizer tinker returns, loaded from the
    same files the server publishes."""
    key = live_server.make_tenant().key
    headers = {"X-API-Key": key}
    root = f"{live_server.base_url}/api/v1/models/{MODEL}/tokenizer"
    files = httpx.get(root, headers=headers).raise_for_status().json()["files"]
    for name in files:
        content = httpx.get(f"{root}/{name}", headers=headers).raise_for_status().content
        (tmp_path / name).write_bytes(content)
    reference = AutoTokenizer.from_pretrained(tmp_path)

    service = treadle.ServiceClient(base_url=live_server.base_url, api_key=key)
    trainer = service.create_lora_training_client(MODEL, 4).result()
    tokenizer = trainer.get_tokenizer()
    text = "the cat sat on the mat, and then it was time"
    ids = tokenizer.encode(text)
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    assert ids == reference.encode(text)
    assert tokenizer.decode(ids) == reference.decode(ids)
    messages = [
        {"role": "user", "content": "name a colour"},
        {"role": "assistant", "content": "red"},
    ]
    for add_generation_prompt in (False, True):
        assert tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        ) == reference.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    rendered = tokenizer.apply_chat_template(messages)
    assert rendered == tokenizer.encode(
        str(tokenizer.apply_chat_template(messages, tokenize=False)), add_special_tokens=False
    )
    assert tokenizer.eos_token_id == reference.eos_token_id
    sampler = service.create_sampling_client(base_model=MODEL).result()
    assert sampler.get_tokenizer().encode(text) == ids
    service.close()


def test_rest_snippet_results_are_not_trivial(live_server: LiveServer) -> None:
    """The REST comparison means something: the deleted checkpoint is gone, the published one
    is public, and the export has files."""
    runs, run, listed, mine, info, files = rest_listing(
        treadle, live_server.base_url, live_server.make_tenant().key
    )
    assert runs == [True] and run == (MODEL, 4, True)
    assert ("sampler_weights/doomed", "sampler", False) not in listed
    assert ("sampler_weights/shared", "sampler", True) in listed
    assert ("weights/kept", "training", False) in listed
    assert "sampler_weights/doomed" not in mine and info == (MODEL, 4)
    assert any(name.endswith(".safetensors") for name in files), files
