"""Recipe settings: one pydantic model per recipe, filled from `--field value` arguments.

Every recipe subclasses `RecipeConfig`, gives its own fields defaults, and starts with
`Config.from_cli()`. Overrides name fields as they are spelled (`--lora_rank 8`,
`--schedule.warmup_steps=10` for a nested model); pydantic converts and checks the strings,
so a typo or a wrong type stops the recipe before it contacts the server. The configuration
does not know about the server: recipes build their clients from `base_url` and `api_key`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
CONFIG_FILE = "config.json"


def _env_base_url() -> str:
    return os.environ.get("TREADLE_BASE_URL") or DEFAULT_BASE_URL


def _env_api_key() -> str | None:
    return os.environ.get("TREADLE_API_KEY")


class RecipeConfig(BaseModel):
    """What every recipe needs: where the server is, which model, where to write."""

    model_config = ConfigDict(extra="forbid", validate_default=True)

    base_url: str | None = Field(
        default_factory=_env_base_url,
        description="the Treadle server (default: $TREADLE_BASE_URL, else http://127.0.0.1:8000)",
    )
    api_key: str | None = Field(
        default_factory=_env_api_key, description="API key (default: $TREADLE_API_KEY)"
    )
    model: str = Field(description="base model to train, one the server offers")
    log_dir: Path = Field(
        description="where config.json, metrics.jsonl, checkpoints.jsonl and plots go"
    )
    seed: int = Field(default=0, description="seed of data order and adapter initialisation")
    lora_rank: int = Field(default=32, description="LoRA rank of a new training run")
    load_checkpoint_path: str | None = Field(
        default=None,
        description="start a new run from these weights (a tinker:// path, e.g. an SFT run's "
        "checkpoint) instead of the base model; ignored once log_dir holds checkpoints",
    )
    mlflow_uri: str | None = Field(
        default=None,
        description="MLflow tracking URI (a server, or sqlite:///mlflow.db for a local file); "
        "metrics are logged there too when set",
    )

    @classmethod
    def from_cli(cls, argv: list[str] | None = None) -> Self:
        """Build the config from `--field value` / `--field=value` arguments.

        Args:
            argv: the arguments, without the program name (default: `sys.argv[1:]`).

        Raises:
            SystemExit: after printing the fields for `--help` (status 0), or with a message
                naming the argument to fix when one is malformed, unknown or invalid.
        """
        args = sys.argv[1:] if argv is None else argv
        if "--help" in args or "-h" in args:
            print(cls.help_text())
            raise SystemExit(0)
        overrides = parse_overrides(args)
        try:
            return cls.model_validate(overrides)
        except ValidationError as exc:
            problems = "; ".join(
                f"--{'.'.join(str(part) for part in error['loc'])}: {error['msg']}"
                for error in exc.errors()
            )
            raise SystemExit(f"{problems} (see --help for the fields)") from None

    @classmethod
    def help_text(cls) -> str:
        """One line per field: its name, type, default and description."""
        lines = [f"{cls.__name__}: pass --field value or --field=value", ""]
        for name, field in cls.model_fields.items():
            if field.is_required():
                default = "required"
            elif field.default_factory is not None:
                default = "from the environment"
            else:
                default = f"default {field.default!r}"
            annotation = getattr(field.annotation, "__name__", str(field.annotation))
            lines.append(f"  --{name} ({annotation}, {default}): {field.description or ''}")
        return "\n".join(lines)

    def save(self, log_dir: Path) -> Path:
        """Write the config as `config.json` in `log_dir` (the API key left out)."""
        log_dir.mkdir(parents=True, exist_ok=True)
        path = log_dir / CONFIG_FILE
        path.write_text(self.model_dump_json(indent=2, exclude={"api_key"}) + "\n")
        return path


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """`["--a.b", "1", "--c=x"]` -> `{"a": {"b": "1"}, "c": "x"}`; values stay strings
    (pydantic converts them) except JSON lists and objects, for list and dict fields."""
    overrides: dict[str, Any] = {}
    position = 0
    while position < len(args):
        arg = args[position]
        if not arg.startswith("--") or len(arg) == 2:
            raise SystemExit(f"unexpected argument {arg!r}: pass --field value or --field=value")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            position += 1
        elif position + 1 < len(args):
            key, value = arg[2:], args[position + 1]
            position += 2
        else:
            raise SystemExit(f"{arg} needs a value: pass {arg} VALUE or {arg}=VALUE")
        _set_nested(overrides, key.split("."), _parse_value(value))
    return overrides


def _parse_value(value: str) -> Any:
    if value[:1] in "[{":
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def _set_nested(target: dict[str, Any], keys: list[str], value: Any) -> None:
    for key in keys[:-1]:
        child = target.setdefault(key, {})
        if not isinstance(child, dict):
            raise SystemExit(f"--{key} is given both as a value and as a group of fields")
        target = child
    target[keys[-1]] = value
