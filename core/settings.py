"""Settings for every Treadle process, read from `TREADLE_*` environment variables.

With no settings at all Treadle runs in *embedded mode*: a SQLite file and an artifact folder
under the per-user data directory, an in-process dispatcher, one engine thread. Setting
`TREADLE_REDIS_URL` switches to *distributed mode* (separate api, worker and beat processes),
which also requires a PostgreSQL `TREADLE_DATABASE_URL` and an explicit `TREADLE_SERVER_SECRET`.
"""

from __future__ import annotations

import enum
import os
import secrets
from pathlib import Path
from typing import Annotated, Literal

import platformdirs
from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from core.errors import ConfigurationError

# Built-in models served when the operator configures none (tiny, CPU-friendly).
DEFAULT_MODELS = ("treadle/tiny-1m", "treadle/tiny-10m")
# Request payloads stay at least this long after their op finished, for operators to inspect.
MIN_OPLOG_RETENTION_SECONDS = 3600.0
LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class Mode(enum.StrEnum):
    EMBEDDED = "embedded"
    DISTRIBUTED = "distributed"


def default_data_dir() -> Path:
    return Path(platformdirs.user_data_dir("treadle", appauthor=False))


class Settings(BaseSettings):
    """One settings class for all process kinds; each process reads the fields it needs."""

    model_config = SettingsConfigDict(env_prefix="TREADLE_", extra="ignore")

    data_dir: Path = Field(default_factory=default_data_dir)
    database_url: str | None = None
    redis_url: str | None = None
    artifact_url: str | None = None
    server_secret: SecretStr | None = None

    host: str = "127.0.0.1"
    port: int = 8000
    public_url: str | None = None
    # Host names the API answers for (`Host` header, without port): exact names, `*.domain`
    # or `*`. None answers any host. Comma-separated in the environment.
    allowed_hosts: Annotated[list[str] | None, NoDecode] = None

    # Prometheus metrics. On the API's own port `/metrics` needs this bearer token (unset: it
    # answers 404); a metrics port serves them without one, bound to `metrics_host`: workers
    # and beat serve theirs only there (unset: none).
    metrics_token: SecretStr | None = None
    metrics_port: int | None = Field(default=None, ge=1, le=65535)
    metrics_host: str = "127.0.0.1"

    # When the admin dashboard's session cookie is `Secure`: `auto` when the request came over
    # https, `always` for a server behind a proxy that terminates TLS and forwards plain http.
    admin_secure_cookie: Literal["auto", "always"] = "auto"

    # How every process logs (`core.logs`): `text` lines for people, `json` lines for collectors.
    log_format: Literal["text", "json"] = "text"
    log_level: str = "INFO"

    session_ttl_seconds: float = 300.0
    expiry_sweep_seconds: float = 15.0
    # How often the API checks its database and Redis for `/readyz`, which answers from the
    # last check: load balancers may probe it as often as they like.
    readiness_check_seconds: float = Field(default=1.0, gt=0)
    long_poll_seconds: float = 25.0
    max_request_bytes: int = 64 * 1024 * 1024
    # Datums per forward_backward request the tinker SDK sends (it splits larger batches);
    # None keeps the SDK's default.
    fwdbwd_max_chunk_len: int | None = None
    telemetry_max_bytes: int = 1024 * 1024
    telemetry_per_minute: int = 120

    models: list[str] = Field(default_factory=lambda: list(DEFAULT_MODELS))
    # Extra names clients may use for a served model, e.g. {"Qwen/Qwen3-8B": "treadle/tiny-1m"}.
    model_aliases: dict[str, str] = Field(default_factory=dict)
    # Hugging Face model folders on the workers' disks, by the name they are served under,
    # e.g. {"Qwen/Qwen3-8B": "/models/Qwen3-8B"}; list those names in `models` too.
    model_folders: dict[str, str] = Field(default_factory=dict)
    # Ranks of a worker group that must serve a model folder together, by served name, e.g.
    # {"Qwen/Qwen3-8B": 2} (others: 1): a worker with fewer ranks refuses to start with it, and
    # placement gives its runs to workers with at least that many while any lives.
    model_devices: dict[str, int] = Field(default_factory=dict)
    default_max_concurrent_sessions: int = 4
    default_max_lora_rank: int = 64

    # The engine (embedded mode and worker processes).
    device: str = "auto"
    precision: str = "auto"
    torch_threads: int = 1
    engine_max_lora_rank: int = 128
    gap_timeout_seconds: float = 120.0
    # A worker whose lease is not renewed for this long is dead; its runs move elsewhere.
    worker_lease_seconds: float = 15.0
    # Ranks (processes, one device each) of a worker group serving one base model together
    # (`treadle-server worker --group-size`); 1 is a plain worker.
    worker_group_size: int = Field(default=1, ge=1)
    # How long one collective of a worker group may take, and one command of its rank 0 run
    # (longer than the longest op): past it the group exits and its runs move elsewhere.
    group_timeout_seconds: float = Field(default=600.0, gt=0)
    # Touched by a worker after each lease renewal and by beat after each tick, for exec
    # probes (`treadle-server probe`, `core.liveness`); None touches nothing.
    liveness_file: Path | None = None
    # Save each run's full state every this many optimizer steps; recovery replays the rest.
    snapshot_every_steps: int = 10
    # An op interrupted this many times (failed engine steps, worker crashes) fails for good.
    max_op_attempts: int = Field(default=3, ge=1)
    max_queued_samples: int = 2048
    # How long the tinker SDK waits out 402s (a spend limit reached) before it gives up: sent
    # as `billing_exception_max_pause_duration_sec` by /client/config.
    spend_limit_pause_seconds: int = Field(default=3600, ge=0)
    # A new price version takes effect no sooner than this after it is set (`billing.pricebook`),
    # so every process's price cache has read it before it applies: keep it well above the
    # clock skew between machines.
    price_delay_seconds: float = Field(default=60.0, ge=5)
    # Checkpoint storage is metered per whole hour (`billing.storage`); this often, at most.
    storage_meter_seconds: float = Field(default=300.0, gt=0)
    # Finished ops' request payloads are emptied this long after they finished, once replay can
    # no longer need them (`scheduler.retention`); results are kept.
    oplog_retention_seconds: float = 7 * 86400.0
    # A save's version is pending while its artifact uploads; one pending this long lost its
    # uploader and is marked failed, its objects removed (`scheduler.artifact_gc`).
    artifact_pending_grace_seconds: float = Field(default=3600.0, gt=0)

    # Stripe Billing meters (`billing.stripe_push`): pushing is off while no key is set.
    stripe_api_key: SecretStr | None = None
    stripe_api_base: str = "https://api.stripe.com"
    # Meter event names are `<prefix>_<usage kind>`, e.g. `treadle_training`.
    stripe_meter_prefix: str = "treadle"
    # An hour is pushed once it has ended and this long has passed, so its usage is in.
    stripe_settle_seconds: float = Field(default=600.0, ge=0)
    stripe_push_seconds: float = Field(default=300.0, gt=0)

    @property
    def offered_models(self) -> list[str]:
        """Every base-model name a client may ask for: served models and their aliases."""
        return [*self.models, *(a for a in self.model_aliases if a not in self.models)]

    @field_validator("allowed_hosts", mode="before")
    @classmethod
    def _host_list(cls, value: object) -> object:
        if isinstance(value, str):
            names = [name.strip() for name in value.split(",") if name.strip()]
            return names or None
        return value

    @field_validator("metrics_token", mode="before")
    @classmethod
    def _usable_token(cls, value: object) -> object:
        if isinstance(value, SecretStr):
            value = value.get_secret_value()
        if isinstance(value, str) and not value.strip():
            return None  # set empty (an env file's placeholder): metrics stay off
        if isinstance(value, str) and len(value) < 16:
            raise ValueError(
                "TREADLE_METRICS_TOKEN is too short; set it to at least 16 random characters, "
                "e.g. the output of `python -c 'import secrets; print(secrets.token_hex(32))'`"
            )
        return value

    @field_validator("model_devices")
    @classmethod
    def _positive_devices(cls, devices: dict[str, int]) -> dict[str, int]:
        for name, count in devices.items():
            if count < 1:
                raise ValueError(
                    f"TREADLE_MODEL_DEVICES gives {name!r} {count} devices; give each model "
                    "at least 1 (or leave it out for 1)"
                )
        return devices

    @field_validator("log_format", mode="before")
    @classmethod
    def _known_format(cls, value: object) -> object:
        if isinstance(value, str) and value.strip().lower() not in LOG_FORMATS:
            raise ValueError(
                f"TREADLE_LOG_FORMAT {value[:40]!r} is not a log format; set it to one of "
                f"{', '.join(LOG_FORMATS)} (or leave it unset for text)"
            )
        return value.strip().lower() if isinstance(value, str) else value

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, level: str) -> str:
        if level.strip().upper() not in LOG_LEVELS:
            raise ValueError(
                f"TREADLE_LOG_LEVEL {level[:40]!r} is not a log level; set it to one of "
                f"{', '.join(LOG_LEVELS)} (or leave it unset for INFO)"
            )
        return level.strip().upper()

    @field_validator("oplog_retention_seconds")
    @classmethod
    def _retention_bound(cls, seconds: float) -> float:
        if seconds < MIN_OPLOG_RETENTION_SECONDS:
            raise ValueError(
                f"TREADLE_OPLOG_RETENTION_SECONDS {seconds:g} is below the minimum "
                f"{MIN_OPLOG_RETENTION_SECONDS:g} (one hour); set it to at least "
                f"{MIN_OPLOG_RETENTION_SECONDS:g}, or leave it unset for 7 days"
            )
        return seconds

    @field_validator("database_url")
    @classmethod
    def _supported_database(cls, url: str | None) -> str | None:
        if url is None:
            return None
        if not (url.startswith("postgresql+psycopg://") or url.startswith("sqlite")):
            raise ValueError(
                f"TREADLE_DATABASE_URL {url.split('@')[-1]!r} is not supported; use "
                "postgresql+psycopg://user@host/db (or leave it unset for embedded SQLite)"
            )
        return url

    @property
    def mode(self) -> Mode:
        return Mode.DISTRIBUTED if self.redis_url else Mode.EMBEDDED

    @property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{self.data_dir / 'treadle.db'}"

    @property
    def resolved_artifact_url(self) -> str:
        return self.artifact_url or str(self.data_dir / "artifacts")

    def ensure_data_dir(self) -> Path:
        self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        return self.data_dir

    def secret_bytes(self) -> bytes:
        """The key for hashing API keys and signing URLs.

        Embedded mode keeps a generated secret in the data directory; distributed mode refuses
        to run without an explicit one, so replicas cannot disagree.
        """
        if self.server_secret is not None:
            value = self.server_secret.get_secret_value()
            if len(value) < 16 or value.lower() in {"changeme", "secret", "treadle"}:
                raise ConfigurationError(
                    "TREADLE_SERVER_SECRET is too weak; set it to at least 16 random characters, "
                    "e.g. the output of `python -c 'import secrets; print(secrets.token_hex(32))'`"
                )
            return value.encode()
        if self.mode is Mode.DISTRIBUTED:
            raise ConfigurationError(
                "distributed mode needs TREADLE_SERVER_SECRET, shared by every api, worker and "
                "beat process; set it to a long random string"
            )
        path = self.ensure_data_dir() / "server-secret"
        if not path.exists():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
        return path.read_text().strip().encode()
