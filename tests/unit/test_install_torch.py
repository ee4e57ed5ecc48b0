"""scripts/install_torch.py: which torch build the install picks, given the machine and the
index settings. The probes (nvidia-smi, the index) are stubbed; nothing is installed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.unit

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "install_torch.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("install_torch", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


install_torch = _load()
CPU_INDEX = install_torch.CPU_INDEX


class Probe:
    """A stub `reachable` that records the indexes it was asked about."""

    def __init__(self, answers: bool) -> None:
        self.answers = answers
        self.asked: list[str] = []

    def __call__(self, index_url: str) -> bool:
        self.asked.append(index_url)
        return self.answers


def test_without_a_gpu_the_cpu_index_is_added_to_pips_own() -> None:
    probe = Probe(answers=True)
    choice = install_torch.choose("2.13.0", gpu=False, index_url=None, reachable=probe)
    assert choice.pip_args == ("--extra-index-url", CPU_INDEX)
    assert probe.asked == [CPU_INDEX]
    assert "CPU build" in choice.reason and "no NVIDIA GPU" in choice.reason
    assert "\n" not in choice.reason


def test_an_unreachable_cpu_index_falls_back_to_pips_configuration() -> None:
    choice = install_torch.choose("2.13.0", gpu=False, index_url=None, reachable=Probe(False))
    assert choice.pip_args == ()
    assert "does not answer" in choice.reason and "TREADLE_TORCH_INDEX_URL=" in choice.reason


def test_with_a_gpu_pips_default_build_without_probing() -> None:
    probe = Probe(answers=True)
    choice = install_torch.choose("2.13.0", gpu=True, index_url=None, reachable=probe)
    assert choice.pip_args == ()
    assert "NVIDIA GPU found" in choice.reason
    assert probe.asked == []


@pytest.mark.parametrize("gpu", [False, True])
def test_an_empty_index_means_pips_configuration(gpu: bool) -> None:
    probe = Probe(answers=True)
    choice = install_torch.choose("2.13.0", gpu=gpu, index_url="", reachable=probe)
    assert choice.pip_args == ()
    assert probe.asked == []


@pytest.mark.parametrize("gpu", [False, True])
def test_an_explicit_index_wins_on_any_machine(gpu: bool) -> None:
    cu124 = "https://download.pytorch.org/whl/cu124"
    choice = install_torch.choose("2.6.0", gpu=gpu, index_url=cu124, reachable=Probe(True))
    assert choice.pip_args == ("--extra-index-url", cu124)
    assert choice.reason.startswith("torch 2.6.0: from " + cu124)


def test_an_explicit_index_that_does_not_answer_stops_the_install() -> None:
    with pytest.raises(install_torch.UnreachableIndex, match="set it empty"):
        install_torch.choose(
            "2.13.0", gpu=False, index_url="http://nowhere", reachable=Probe(False)
        )


def test_the_probe_gives_up_quickly_on_a_bad_address() -> None:
    assert install_torch.index_answers("http://127.0.0.1:9/simple") is False
    assert install_torch.index_answers("not a url") is False


def test_nothing_is_installed_when_torch_is_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("pip ran although torch is importable")

    monkeypatch.setattr(install_torch.subprocess, "run", refuse)
    assert install_torch.main() == 0
