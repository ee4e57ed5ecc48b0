"""An embedded server whose artifacts live in an S3 bucket (a moto server; real s3fs and boto3):
the tinker SDK's whole loop — train, save for sampling and sample, save, resume from the
checkpoint with its optimizer — gives the same losses as on a local folder, and the treadle SDK
downloads the checkpoint straight from the bucket through presigned URLs."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from sqlalchemy import select

import treadle
from core.tables import ModelVersion, VersionStatus
from tests.fakes.s3 import S3Server
from tests.scenarios import scenario
from tests.server import start_server

pytestmark = pytest.mark.e2e


def test_the_whole_loop_and_downloads_on_an_s3_bucket(
    s3_artifact_url: str, s3_server: S3Server, tmp_path: Path
) -> None:
    local = start_server(tmp_path / "folder")
    reference = next(local)
    try:
        expected = scenario(reference.base_url, reference.make_tenant().key, 2)
    finally:
        local.close()

    server = start_server(tmp_path / "s3", artifact_url=s3_artifact_url)
    live = next(server)
    try:
        tenant = live.make_tenant()
        assert scenario(live.base_url, tenant.key, 2) == pytest.approx(expected, rel=1e-6)
        with live.database.reader() as db:
            versions = list(
                db.scalars(select(ModelVersion).where(ModelVersion.tenant_id == tenant.tenant_id))
            )
        assert versions and all(v.status == VersionStatus.READY for v in versions)
        assert all((v.artifact_uri or "").startswith(s3_artifact_url) for v in versions)
        (saved,) = [v for v in versions if v.tinker_path and v.tinker_path.endswith("/done")]
        assert saved.tinker_path is not None and saved.files

        with treadle.RestClient(base_url=live.base_url, api_key=tenant.key) as rest:
            urls = rest.get_download_urls(saved.tinker_path).result(timeout=60)
            assert [f.path for f in urls.files] == [f["path"] for f in saved.files]
            # The bucket serves the files itself: the URLs are presigned by the S3 client.
            assert all(f.url.startswith(s3_server.endpoint) for f in urls.files)
            assert all("X-Amz-Signature=" in f.url for f in urls.files)
            folder = rest.download_checkpoint(saved.tinker_path, tmp_path / "download").result(
                timeout=120
            )
        for recorded in saved.files:
            data = (folder / recorded["path"]).read_bytes()
            assert hashlib.sha256(data).hexdigest() == recorded["sha256"]
            assert len(data) == recorded["size_bytes"]
    finally:
        server.close()
