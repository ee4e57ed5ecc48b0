"""The tar archive of a version (`core.archives`): what tarfile reads back, its announced size,
and any byte range of it equal to the same slice of the whole."""

from __future__ import annotations

import io
import random
import tarfile
from pathlib import Path

import pytest

from core.archives import Archive
from core.objectstore import LocalArtifactStore

pytestmark = pytest.mark.unit

FILES = {
    "config.json": b'{"model_type": "llama"}',
    "model.safetensors": bytes(range(256)) * 7,  # 1792 bytes: not a whole block
    "empty.txt": b"",
    "exactly-one-block.bin": b"b" * 512,
    # Longer than the 100 characters a plain tar header holds: a pax header carries it.
    "nested/" + "deep/" * 30 + "tokenizer.json": b'{"version": "1.0"}',
}


@pytest.fixture
def archive(tmp_path: Path) -> Archive:
    store = LocalArtifactStore(tmp_path / "artifacts")
    folder = store.local_dir("t/run/merged/m")
    for relpath, data in FILES.items():
        (folder / relpath).parent.mkdir(parents=True, exist_ok=True)
        (folder / relpath).write_bytes(data)
    uri = store.publish("t/run/merged/m")
    return Archive(store, uri, store.files(uri), mtime=1_700_000_000)


def test_the_archive_holds_exactly_the_files_at_its_announced_size(archive: Archive) -> None:
    whole = b"".join(archive.stream())
    assert len(whole) == archive.size and archive.size % 512 == 0
    with tarfile.open(fileobj=io.BytesIO(whole), mode="r:") as tar:
        members = tar.getmembers()
        assert [m.name for m in members] == sorted(FILES)
        assert all(m.isfile() and m.mode == 0o644 and m.mtime == 1_700_000_000 for m in members)
        assert {m.name: tar.extractfile(m).read() for m in members} == FILES  # type: ignore[union-attr]


def test_every_range_is_the_same_slice_of_the_whole(archive: Archive) -> None:
    whole = b"".join(archive.stream())
    rng = random.Random(7)
    cuts = [(0, 1), (511, 513), (archive.size - 1024, archive.size), (5, 5)]
    for _ in range(200):
        first, second = sorted(rng.sample(range(archive.size + 1), 2))
        cuts.append((first, second))
    for start, end in cuts:
        assert b"".join(archive.stream(start, end)) == whole[start:end], (start, end)
    assert b"".join(archive.stream(archive.size)) == b""
    assert b"".join(archive.stream(100, archive.size + 50)) == whole[100:]
