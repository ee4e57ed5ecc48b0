"""Registry references (`package@alias`, `package:version`): how they are told from tinker
paths, split into their parts, and refused with a message that says what a valid one is."""

from __future__ import annotations

import pytest

from core import references
from core.errors import InvalidInput
from core.references import Reference

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("reward-model@production", Reference("reward-model", alias="production")),
        ("reward-model:3", Reference("reward-model", version=3)),
        ("reward-model@latest", Reference("reward-model", alias=references.LATEST)),
        # A run's own package is named after the run, colons and all.
        ("sess_ab12:train:0:2", Reference("sess_ab12:train:0", version=2)),
        ("sess_ab12:train:0@latest", Reference("sess_ab12:train:0", alias="latest")),
        ("sess_ab12:train:10@v1.2-rc_3", Reference("sess_ab12:train:10", alias="v1.2-rc_3")),
        ("Q.pkg_v2:12", Reference("Q.pkg_v2", version=12)),
    ],
)
def test_parse_splits_at_the_last_at_or_version_colon(text: str, expected: Reference) -> None:
    parsed = references.parse(text)
    assert parsed == expected
    assert str(parsed) == text


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("pkg@", "alias '' is invalid; use 1 to 100 letters"),
        ("pkg@1st", "alias '1st' is invalid"),
        ("pkg@prod/x", "alias 'prod/x' is invalid"),
        ("@production", "package name '' is invalid; use 1 to 200 letters"),
        ("-pkg@production", "package name '-pkg' is invalid"),
        ("a@b@production", "package name 'a@b' is invalid"),
        ("my pkg:2", "package name 'my pkg' is invalid"),
        ("x" * 201 + ":1", "is invalid; use 1 to 200"),
        ("pkg:0", "is not a checkpoint path or registry reference"),
        ("pkg:v2", "is not a checkpoint path or registry reference"),
        ("pkg:", "is not a checkpoint path or registry reference"),
        ("pkg:-1", "is not a checkpoint path or registry reference"),
        ("sess_ab12:train:0", "is not a checkpoint path or registry reference"),
    ],
)
def test_invalid_references_say_what_a_valid_one_is(text: str, message: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        references.parse(text)
    assert message in str(caught.value)
    if "not a checkpoint path" in message:
        assert "<package>@<alias> or <package>:<version number>" in str(caught.value)


@pytest.mark.parametrize(
    ("path", "is_reference"),
    [
        ("tinker://sess_ab12:train:0/weights/step-3", False),
        ("tinker://run/sampler_weights/a@b", False),
        ("reward-model@production", True),
        ("reward-model:3", True),
        ("sess_ab12:train:0", True),  # meant as one, refused by parse with its message
        ("reward-model", False),
        ("weights/step-3", False),
        ("s3://bucket/x", False),  # another scheme: refused as a path, not parsed as a reference
    ],
)
def test_is_reference_tells_references_from_tinker_paths(path: str, is_reference: bool) -> None:
    assert references.is_reference(path) is is_reference


def test_name_checks_return_valid_names() -> None:
    assert references.check_package_name("sess_ab12:train:0") == "sess_ab12:train:0"
    assert references.check_alias_name("production") == "production"
    assert references.check_package_name("p" * 200) == "p" * 200
    with pytest.raises(InvalidInput, match="is invalid; use 1 to 100 letters"):
        references.check_alias_name("a" * 101)
