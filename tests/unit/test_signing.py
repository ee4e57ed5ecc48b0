"""Signed download tokens: they grant one file of one checkpoint until they expire."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from core.signing import (
    DownloadTokenExpired,
    InvalidDownloadToken,
    sign_download,
    verify_download,
)

pytestmark = pytest.mark.unit

SECRET = b"unit-test-secret-0123456789"
NOW = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)
LATER = NOW + timedelta(hours=1)


def test_a_genuine_token_names_its_version() -> None:
    token = sign_download(SECRET, "mv_abc", "adapter_model.safetensors", LATER)
    assert verify_download(SECRET, token, "adapter_model.safetensors", NOW) == "mv_abc"


def test_token_is_url_safe() -> None:
    token = sign_download(SECRET, "mv_abc", "sub/dir/file.json", LATER)
    assert all(c.isalnum() or c in "-_." for c in token)


def test_expired_token_is_refused_with_advice() -> None:
    token = sign_download(SECRET, "mv_abc", "f", LATER)
    with pytest.raises(DownloadTokenExpired, match="request new URLs"):
        verify_download(SECRET, token, "f", LATER)
    with pytest.raises(DownloadTokenExpired):
        verify_download(SECRET, token, "f", LATER + timedelta(days=1))


def test_token_for_another_file_is_refused() -> None:
    token = sign_download(SECRET, "mv_abc", "adapter_config.json", LATER)
    with pytest.raises(InvalidDownloadToken, match="request new URLs"):
        verify_download(SECRET, token, "adapter_model.safetensors", NOW)
    with pytest.raises(InvalidDownloadToken):
        verify_download(SECRET, token, "../adapter_config.json", NOW)


def test_token_under_another_secret_is_refused() -> None:
    token = sign_download(b"another-secret-abcdefghijk", "mv_abc", "f", LATER)
    with pytest.raises(InvalidDownloadToken):
        verify_download(SECRET, token, "f", NOW)


@pytest.mark.parametrize("where", ["payload", "signature"])
def test_tampered_token_is_refused(where: str) -> None:
    token = sign_download(SECRET, "mv_abc", "f", LATER)
    payload, signature = token.split(".")
    if where == "payload":
        # Point the token at another version, or push its expiry out.
        forged = sign_download(SECRET, "mv_xyz", "f", LATER + timedelta(days=365))
        token = f"{forged.split('.')[0]}.{signature}"
    else:
        flipped = "A" if signature[0] != "A" else "B"
        token = f"{payload}.{flipped}{signature[1:]}"
    with pytest.raises(InvalidDownloadToken):
        verify_download(SECRET, token, "f", NOW)


@pytest.mark.parametrize("token", ["", "nodot", "a.b.c", "!!!.???", "bm9uZXdsaW5l.AAAA"])
def test_malformed_token_is_refused(token: str) -> None:
    with pytest.raises(InvalidDownloadToken):
        verify_download(SECRET, token, "f", NOW)


def test_a_file_token_and_an_archive_token_never_pass_for_each_other() -> None:
    archive = sign_download(SECRET, "mv_abc", "step-5.tar", LATER, archive=True)
    assert verify_download(SECRET, archive, "step-5.tar", NOW, archive=True) == "mv_abc"
    with pytest.raises(InvalidDownloadToken):
        verify_download(SECRET, archive, "step-5.tar", NOW)
    single = sign_download(SECRET, "mv_abc", "step-5.tar", LATER)
    with pytest.raises(InvalidDownloadToken):
        verify_download(SECRET, single, "step-5.tar", NOW, archive=True)
