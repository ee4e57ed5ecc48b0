"""Deployment files, checked statically: Dockerfiles, .dockerignore, the compose file and the Helm
chart. No Docker engine, Kubernetes or helm is needed; `docker compose config` (or the older
`docker-compose config`) and `helm template` run only where those tools are installed."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tomllib
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from sqlalchemy import String

from api.cli import app as cli_app
from core.settings import Settings
from core.tables import Worker

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
DOCKERFILES = {
    "api": INFRA / "docker" / "api.Dockerfile",
    "worker": INFRA / "docker" / "worker.Dockerfile",
}
COMPOSE = INFRA / "compose.yaml"
CHART = INFRA / "helm" / "treadle"
SERVICE_SUBCOMMANDS = {"api", "worker", "beat", "migrate"}
# Good enough for `docker compose config`, never used for anything else.
TEST_ENV = {
    "POSTGRES_PASSWORD": "test0123",
    "TREADLE_SERVER_SECRET": "compose-config-check-0123456789",
    "TREADLE_METRICS_TOKEN": "compose-metrics-check-0123456789",
    "GRAFANA_ADMIN_PASSWORD": "grafana-check",
}
PROMETHEUS_CONFIG = INFRA / "prometheus" / "prometheus.yml"
GRAFANA = INFRA / "grafana"


# --- the CLI the deployment files call -----------------------------------------------------


@cache
def cli_commands() -> dict[str, Any]:
    """Subcommand name → its click command (typer may bring its own click, so duck-typed)."""
    return dict(typer.main.get_command(cli_app).commands)  # type: ignore[attr-defined]


def check_invocation(
    args: list[str], where: str, subcommands: set[str] = SERVICE_SUBCOMMANDS
) -> None:
    """`treadle-server ARGS` names a real subcommand (of `subcommands`) with options it has."""
    assert args, f"{where}: no command"
    assert args[0] in subcommands, f"{where}: {args[0]!r} is not one of {sorted(subcommands)}"
    command = cli_commands().get(args[0])
    assert command is not None, f"{where}: `treadle-server {args[0]}` does not exist"
    known = {opt for param in command.params for opt in param.opts}
    for token in args[1:]:
        if token.startswith("--"):
            assert token.split("=")[0] in known, f"{where}: {args[0]} has no option {token}"


def test_service_subcommands_exist_in_the_cli() -> None:
    assert set(cli_commands()) >= SERVICE_SUBCOMMANDS
    with pytest.raises(AssertionError):
        check_invocation(["worker", "--gpu", "0"], "self-check")


def option(args: list[str], name: str) -> str:
    assert name in args, f"{name} missing from {args}"
    return args[args.index(name) + 1]


def check_probe(command: list[str], liveness_file: str, where: str) -> float:
    """`treadle-server probe --file F --max-age S` with F the process's liveness file (under
    /tmp, writable with a read-only root); returns S."""
    assert command[0] == "treadle-server", f"{where}: the probe must be treadle-server's"
    check_invocation(command[1:], where, subcommands={"probe"})
    assert option(command, "--file") == liveness_file, f"{where}: probes another file"
    assert liveness_file.startswith("/tmp/"), where
    return float(option(command, "--max-age"))


# What the deployment files must outlast: a long poll (the API) and a drain (a worker hands its
# runs over, about a minute), and the rates at which the liveness files are touched.
LONG_POLL_SECONDS = Settings.model_fields["long_poll_seconds"].default
DRAIN_SECONDS = 60.0
BEAT_TICK_SECONDS = 2.0


# --- Dockerfiles ---------------------------------------------------------------------------


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, f"{path.name}: dangling line continuation"
    return out


def final_stage(
    instructions: list[tuple[str, str]],
) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """ARG defaults (of every stage, first one wins) and the instructions of the last stage."""
    args: dict[str, str] = {}
    start = 0
    for i, (word, rest) in enumerate(instructions):
        if word == "FROM":
            start = i
        if word == "ARG" and "=" in rest:
            name, _, default = rest.partition("=")
            args.setdefault(name.strip(), default.strip().strip('"'))
    return args, instructions[start:]


def substitute(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m[1] or m[2], m[0]), text)


def copy_sources(instructions: list[tuple[str, str]]) -> list[str]:
    sources: list[str] = []
    for word, rest in instructions:
        if word not in ("COPY", "ADD"):
            continue
        tokens = rest.split()
        if any(t.startswith("--from") for t in tokens):
            continue
        tokens = [t for t in tokens if not t.startswith("--")]
        assert len(tokens) >= 2, f"COPY needs a source and a destination: {rest}"
        sources += tokens[:-1]
    return sources


def dockerignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    pattern = pattern.strip("/")
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out, i = out + pattern[i : end + 1], end + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: a path is left out when it, or a folder above it, matches (last match wins)."""
    parts = Path(path.strip("/")).parts
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        regex = _pattern_regex(pattern.lstrip("!"))
        if any(regex.match(c) for c in candidates):
            excluded = not negated
    return excluded


def test_dockerignore_rules_behave_like_dockers() -> None:
    patterns = [".venv", "**/__pycache__", "tests", "!tests/keep"]
    assert dockerignored(".venv/bin/python", patterns)
    assert dockerignored("api/routes/__pycache__/x.pyc", patterns)
    assert dockerignored("tests/data/a.jsonl", patterns)
    assert not dockerignored("tests/keep", patterns)
    assert not dockerignored("api/app.py", patterns)
    assert not dockerignored("sdk/tests", patterns)


def test_dockerignore_leaves_out_the_venv_caches_tests_and_secrets() -> None:
    patterns = dockerignore_patterns()
    for path in [
        ".venv/bin/python",
        ".git/HEAD",
        "api/__pycache__/app.cpython-311.pyc",
        ".mypy_cache/x",
        ".pytest_cache/x",
        "tests/data/cookbook_chat.jsonl",
        "infra/.env",
        "treadle_server.egg-info/PKG-INFO",
    ]:
        assert dockerignored(path, patterns), f".dockerignore lets {path} into the build context"


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_dockerfile_copies_only_what_exists_and_is_in_the_context(image: str) -> None:
    sources = copy_sources(dockerfile_instructions(DOCKERFILES[image]))
    assert sources, "no COPY at all"
    patterns = dockerignore_patterns()
    for source in sources:
        assert (ROOT / source).exists(), f"{image}: COPY source {source} is not in the repository"
        assert not dockerignored(source, patterns), f"{image}: {source} is in .dockerignore"


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_dockerfile_copies_every_server_package(image: str) -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    top_level = {p.split(".")[0] for p in pyproject["tool"]["setuptools"]["packages"]}
    copied = {
        s.strip("/").split("/")[0]
        for s in copy_sources(dockerfile_instructions(DOCKERFILES[image]))
    }
    needed = top_level | {"sdk", "pyproject.toml", "README.md"}
    assert needed <= copied, f"{image}: {sorted(needed - copied)} are not copied into the image"


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_dockerfile_runs_treadle_server_as_a_non_root_user(image: str) -> None:
    _, stage = final_stage(dockerfile_instructions(DOCKERFILES[image]))
    entrypoints = [rest for word, rest in stage if word == "ENTRYPOINT"]
    assert entrypoints and json.loads(entrypoints[-1]) == ["treadle-server"]
    users = [rest for word, rest in stage if word == "USER"]
    assert users, f"{image}: the final stage runs as root"
    assert users[-1].split(":")[0] not in ("root", "0")
    cmds = [rest for word, rest in stage if word == "CMD"]
    if cmds:
        check_invocation(json.loads(cmds[-1]), f"{image} CMD")


def test_images_share_one_uid_for_the_artifact_volume() -> None:
    users = {
        image: [r for w, r in final_stage(dockerfile_instructions(path))[1] if w == "USER"][-1]
        for image, path in DOCKERFILES.items()
    }
    assert len(set(users.values())) == 1, users


def test_api_image_is_python_slim_without_the_engine() -> None:
    instructions = dockerfile_instructions(DOCKERFILES["api"])
    args, stage = final_stage(instructions)
    assert substitute(stage[0][1], args).startswith("python:3.11-slim")
    pip_installs = [
        part
        for word, rest in instructions
        if word == "RUN"
        for part in substitute(rest, args).split("&&")
        if "pip install" in part
    ]
    assert pip_installs
    for part in pip_installs:
        assert not re.search(r"\[[^\]]*worker|\btorch\b|transformers", part), part


def test_worker_image_is_cuda_with_the_worker_extra() -> None:
    instructions = dockerfile_instructions(DOCKERFILES["worker"])
    args, stage = final_stage(instructions)
    base = substitute(stage[0][1], args)
    stages = {
        rest.split()[-1]: rest.split()[0]
        for w, rest in instructions
        if w == "FROM" and " AS " in rest
    }
    base = substitute(stages.get(base, base), args)
    assert re.match(r"nvidia/cuda:[\d.]+-(cudnn-)?runtime-", base), base
    installs = [substitute(r, args) for w, r in instructions if w == "RUN" and "pip install" in r]
    assert any(re.search(r"""['"]?\.\[[^\]]*\bworker\b""", r) for r in installs), installs
    assert any("download.pytorch.org/whl/cu" in r for r in installs), "torch must be a CUDA build"


# --- compose -------------------------------------------------------------------------------


@cache
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict) and "services" in data
    return data


def treadle_services() -> dict[str, dict[str, Any]]:
    """Services running one of our images (built from infra/docker/*.Dockerfile)."""
    out = {}
    for name, service in compose()["services"].items():
        build = service.get("build")
        if isinstance(build, dict) and "infra/docker/" in build.get("dockerfile", ""):
            out[name] = service
    return out


def by_subcommand(name: str) -> dict[str, dict[str, Any]]:
    return {k: v for k, v in treadle_services().items() if v["command"][0] == name}


def test_compose_builds_from_real_dockerfiles() -> None:
    assert treadle_services()
    for name, service in treadle_services().items():
        context = (COMPOSE.parent / service["build"]["context"]).resolve()
        assert context == ROOT, f"{name}: build context must be the repository root"
        assert (context / service["build"]["dockerfile"]).is_file(), name


def test_compose_service_commands_are_real_treadle_server_invocations() -> None:
    for name, service in treadle_services().items():
        assert isinstance(service.get("command"), list), f"{name}: command must be a list"
        check_invocation([str(a) for a in service["command"]], f"compose service {name}")


def test_compose_has_every_process_kind() -> None:
    services = compose()["services"]
    images = {n: str(s.get("image", "")) for n, s in services.items()}
    assert any(i.startswith("postgres:16") for i in images.values())
    assert any(i.startswith("redis:7") for i in images.values())
    assert len(by_subcommand("migrate")) == 1
    assert len(by_subcommand("beat")) == 1, "exactly one beat"
    assert len(by_subcommand("api")) >= 2
    assert len(by_subcommand("worker")) == 2


def test_compose_starts_servers_only_after_a_successful_migration() -> None:
    (migrate_name,) = by_subcommand("migrate")
    for name, service in treadle_services().items():
        depends = service.get("depends_on", {})
        if name == migrate_name:
            assert any(
                compose()["services"][d]["image"].startswith("postgres")
                and c.get("condition") == "service_healthy"
                for d, c in depends.items()
            ), "migrate must wait for a healthy PostgreSQL"
            continue
        assert depends.get(migrate_name, {}).get("condition") == "service_completed_successfully", (
            name
        )


def test_compose_healthchecks() -> None:
    services = compose()["services"]
    for name, service in services.items():
        if str(service.get("image", "")).startswith(("postgres", "redis")):
            assert "healthcheck" in service, name
    for name, service in by_subcommand("api").items():
        assert "/api/v1/readyz" in " ".join(service["healthcheck"]["test"]), name


def test_compose_workers_own_one_distinct_gpu_each() -> None:
    ids, gpus = set(), set()
    for name, service in by_subcommand("worker").items():
        command = [str(a) for a in service["command"]]
        ids.add(command[command.index("--worker-id") + 1])
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"], name
        (gpu,) = device["device_ids"]
        gpus.add(gpu)
    assert len(ids) == len(gpus) == 2, (ids, gpus)


def test_compose_shares_the_artifact_volume_at_the_artifact_url() -> None:
    for name, service in {**by_subcommand("api"), **by_subcommand("worker")}.items():
        artifact_dir = service["environment"]["TREADLE_ARTIFACT_URL"]
        mounts = {m.split(":")[1]: m.split(":")[0] for m in service.get("volumes", [])}
        assert mounts.get(artifact_dir) == "artifacts", f"{name} does not mount the shared volume"
    assert "artifacts" in compose()["volumes"]


def test_compose_bakes_in_no_secret() -> None:
    for name, service in treadle_services().items():
        env = service["environment"]
        for key in ("TREADLE_SERVER_SECRET", "TREADLE_DATABASE_URL"):
            assert re.search(r"\$\{\w+:\?[^}]*\}", env[key]), f"{name}: {key} must be required"
    example = (INFRA / ".env.example").read_text()
    values = dict(
        line.split("=", 1) for line in example.splitlines() if line and not line.startswith("#")
    )
    assert values.get("TREADLE_SERVER_SECRET") == "" and values.get("POSTGRES_PASSWORD") == ""
    assert values.get("TREADLE_METRICS_TOKEN") == "" and values.get("GRAFANA_ADMIN_PASSWORD") == ""
    grafana_env = compose()["services"]["grafana"]["environment"]
    assert re.fullmatch(
        r"\$\{GRAFANA_ADMIN_PASSWORD:\?[^}]*\}", grafana_env["GF_SECURITY_ADMIN_PASSWORD"]
    )


def duration_seconds(text: str) -> float:
    """A compose duration ("40s", "2m", "1m30s") in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"not a duration: {text}"
    return sum(float(n) * units[u] for n, u in parts)


def compose_default(value: str) -> str:
    """The default of `${NAME:-default}`, or the value itself."""
    match = re.fullmatch(r"\$\{\w+:-(.*)\}", value)
    return match[1] if match else value


def test_compose_durations_parse() -> None:
    assert duration_seconds("1m30s") == 90 and duration_seconds("40s") == 40
    with pytest.raises(AssertionError):
        duration_seconds("2 minutes")


def test_compose_stop_grace_periods_outlast_a_long_poll_and_a_drain() -> None:
    for name, service in by_subcommand("api").items():
        assert duration_seconds(service["stop_grace_period"]) >= LONG_POLL_SECONDS + 10, name
    for name, service in by_subcommand("worker").items():
        assert duration_seconds(service["stop_grace_period"]) >= DRAIN_SECONDS + 30, name


def test_compose_workers_and_beat_are_healthy_while_their_loops_run() -> None:
    for name, service in {**by_subcommand("worker"), **by_subcommand("beat")}.items():
        health = service["healthcheck"]
        assert health["test"][0] == "CMD", name
        max_age = check_probe(
            health["test"][1:], service["environment"]["TREADLE_LIVENESS_FILE"], name
        )
        # The probe starts a Python interpreter: a second or more on a busy machine.
        assert duration_seconds(health["timeout"]) >= 5, name
        if service["command"][0] == "worker":
            lease = float(compose_default(service["environment"]["TREADLE_WORKER_LEASE_SECONDS"]))
            # Renewed every third of the lease: a renewal or two may fail without a verdict.
            assert max_age >= lease, name
            # Loading the models comes before the first renewal.
            assert duration_seconds(health["start_period"]) >= 300, name
        else:
            assert max_age >= 30 * BEAT_TICK_SECONDS, name
    for name, service in by_subcommand("api").items():
        assert "TREADLE_LIVENESS_FILE" not in service["environment"], f"{name} serves probes"


def test_compose_bounds_the_logs_of_every_service() -> None:
    for name, service in compose()["services"].items():
        logging = service.get("logging")
        assert logging and logging["driver"] == "json-file", f"{name}: no log limits"
        assert re.fullmatch(r"\d+[km]", logging["options"]["max-size"]), name
        assert int(logging["options"]["max-file"]) >= 1, name


def test_compose_workers_read_model_folders_from_a_read_only_volume() -> None:
    for name, service in by_subcommand("worker").items():
        mounts = {m.rsplit(":", 2)[1]: m.rsplit(":", 2) for m in service["volumes"]}
        assert "/models" in mounts and mounts["/models"][2] == "ro", name
        folders = json.loads(service["environment"]["TREADLE_MODEL_FOLDERS"])
        assert isinstance(folders, dict), name
        assert all(path.startswith("/models/") for path in folders.values()), name


@cache
def prometheus_jobs() -> dict[str, dict[str, Any]]:
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    return {job["job_name"]: job for job in config["scrape_configs"]}


def job_targets(job: dict[str, Any]) -> set[str]:
    return {target for group in job["static_configs"] for target in group["targets"]}


def test_prometheus_scrapes_every_treadle_process() -> None:
    jobs = prometheus_jobs()
    api = jobs["treadle-api"]
    assert api["metrics_path"] == "/metrics"
    assert job_targets(api) == {f"{name}:8000" for name in by_subcommand("api")}
    for kind in ("worker", "beat"):
        expected = set()
        for name, service in by_subcommand(kind).items():
            env = service["environment"]
            # Served on the compose network: bound to every interface of the container.
            assert env["TREADLE_METRICS_HOST"] == "0.0.0.0", name
            expected.add(f"{name}:{env['TREADLE_METRICS_PORT']}")
        assert job_targets(jobs[f"treadle-{kind}"]) == expected, kind
    for name, service in by_subcommand("api").items():
        assert "TREADLE_METRICS_PORT" not in service["environment"], f"{name}: token, not port"
        assert "TREADLE_METRICS_TOKEN" in service["environment"], name


def test_compose_prometheus_sends_the_metrics_token_from_the_env_file() -> None:
    service = compose()["services"]["prometheus"]
    token_file = prometheus_jobs()["treadle-api"]["authorization"]["credentials_file"]
    (script,) = service["command"]
    # `$$` is compose's escape: the shell reads the container's variable, set from infra/.env.
    assert f'"$$TREADLE_METRICS_TOKEN" > {token_file}' in script
    assert re.search(
        r"\$\{TREADLE_METRICS_TOKEN:\?[^}]*\}", service["environment"]["TREADLE_METRICS_TOKEN"]
    )
    mounts = {m.split(":")[1]: m.split(":")[0] for m in service["volumes"]}
    config = (COMPOSE.parent / mounts["/etc/prometheus/prometheus.yml"]).resolve()
    assert config == PROMETHEUS_CONFIG
    assert "--config.file=/etc/prometheus/prometheus.yml" in script
    # Published on the host's loopback alone: its data names every worker and route.
    assert all(str(port).startswith("127.0.0.1:") for port in service["ports"])


def test_compose_grafana_provisions_the_dashboard_over_prometheus() -> None:
    service = compose()["services"]["grafana"]
    mounts = {
        m.split(":")[1]: (COMPOSE.parent / m.split(":")[0]).resolve() for m in service["volumes"]
    }
    assert mounts["/etc/grafana/provisioning"] == GRAFANA / "provisioning"
    (provider,) = yaml.safe_load(
        (GRAFANA / "provisioning" / "dashboards" / "treadle.yml").read_text()
    )["providers"]
    folder = provider["options"]["path"]
    assert mounts[f"{folder}/treadle.json"] == GRAFANA / "treadle.json"
    (source,) = yaml.safe_load(
        (GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text()
    )["datasources"]
    assert source["type"] == "prometheus"
    assert source["url"] == "http://prometheus:9090"
    dashboard = json.loads((GRAFANA / "treadle.json").read_text())
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == source["uid"], panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == source["uid"], panel["title"]


def compose_cli() -> list[str] | None:
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=60)
        if probe.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def run_compose_config(
    tmp_path: Path, env_values: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    cli = compose_cli()
    if cli is None:
        pytest.skip("neither the docker compose plugin nor docker-compose is installed")
    env_file = tmp_path / "test.env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in env_values.items()))
    env = {
        k: v for k, v in os.environ.items() if k not in TEST_ENV and not k.startswith("TREADLE_")
    }
    return subprocess.run(
        [*cli, "--env-file", str(env_file), "-f", str(COMPOSE), "config"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_compose_config_validates(tmp_path: Path) -> None:
    result = run_compose_config(tmp_path, TEST_ENV)
    assert result.returncode == 0, result.stderr
    rendered = yaml.safe_load(result.stdout)
    assert TEST_ENV["TREADLE_SERVER_SECRET"] in json.dumps(rendered["services"])


@pytest.mark.parametrize(
    "secret", ["TREADLE_SERVER_SECRET", "TREADLE_METRICS_TOKEN", "GRAFANA_ADMIN_PASSWORD"]
)
@pytest.mark.parametrize("value", [None, ""])
def test_compose_config_refuses_to_run_without_a_secret(
    tmp_path: Path, secret: str, value: str | None
) -> None:
    env = {k: v for k, v in TEST_ENV.items() if k != secret}
    if value is not None:
        env[secret] = value
    result = run_compose_config(tmp_path, env)
    assert result.returncode != 0
    assert secret in result.stderr


# --- Helm chart ----------------------------------------------------------------------------


@cache
def chart_values() -> dict[str, Any]:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert isinstance(values, dict)
    return values


def templates() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted((CHART / "templates").iterdir()) if p.is_file()}


def lookup(values: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(values, dict) or part not in values:
            raise KeyError(dotted)
        values = values[part]
    return values


def test_chart_metadata() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "treadle"
    assert chart["type"] == "application"
    assert re.fullmatch(r"\d+\.\d+\.\d+", str(chart["version"]))
    assert chart.get("appVersion")


def test_every_referenced_value_exists_in_values_yaml() -> None:
    missing = []
    for name, text in templates().items():
        for ref in re.findall(r"\.Values\.([A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)*)", text):
            try:
                lookup(chart_values(), ref)
            except KeyError:
                missing.append(f"{name}: .Values.{ref}")
    assert not missing, missing
    with pytest.raises(KeyError):
        lookup(chart_values(), "worker.no_such_value")


def test_every_included_template_is_defined() -> None:
    texts = templates()
    defined = set(re.findall(r'define\s+"([^"]+)"', "".join(texts.values())))
    for name, text in texts.items():
        for used in re.findall(r'(?:include|template)\s+"([^"]+)"', text):
            assert used in defined, f"{name} includes undefined template {used!r}"


def test_template_blocks_are_balanced() -> None:
    opener = re.compile(r"\{\{-?\s*(?:if|range|with|define|block)\b")
    closer = re.compile(r"\{\{-?\s*end\s*-?\}\}")
    for name, text in templates().items():
        assert text.count("{{") == text.count("}}"), f"{name}: unbalanced braces"
        assert len(opener.findall(text)) == len(closer.findall(text)), f"{name}: if/range/with/end"


def pseudo_render(text: str, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Enough of Helm to see a template's YAML shape: both branches of every `if` are kept,
    `toYaml .Values.x | nindent N` and `{{ .Values.x }}` get their values (from `values`, by
    default values.yaml), anything else `X`. An empty list adds nothing (it is appended to a
    list, or guarded by an `if`)."""
    values = chart_values() if values is None else values
    out: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if re.fullmatch(r"\{\{-?\s*(if|else|end|with|range)\b.*\}\}", stripped):
            continue
        block = re.fullmatch(r"\{\{-?\s*(.*?)\s*\|\s*nindent\s+(\d+)\s*-?\}\}", stripped)
        if block:
            indent = " " * int(block[2])
            source = re.fullmatch(r"toYaml\s+\.Values\.([\w.]+)", block[1])
            if source:
                dumped = yaml.safe_dump(lookup(values, source[1]), default_flow_style=False)
                if dumped.strip() == "[]":
                    continue
                if dumped.strip() == "{}":
                    dumped = "rendered: X\n"
                out += [indent + ln for ln in dumped.splitlines()]
            else:
                out.append(f"{indent}rendered: X")
            continue

        def value(m: re.Match[str]) -> str:
            ref = re.fullmatch(r"\.Values\.([\w.]+)(\s*\|\s*quote)?", m[1].strip())
            return str(lookup(values, ref[1])) if ref else "X"

        out.append(re.sub(r"\{\{-?(.*?)-?\}\}", value, line))
    return [doc for doc in yaml.safe_load_all("\n".join(out)) if doc]


@cache
def chart_objects() -> dict[str, list[dict[str, Any]]]:
    objects: dict[str, list[dict[str, Any]]] = {}
    for name, text in templates().items():
        if name.endswith(".yaml"):
            for doc in pseudo_render(text):
                objects.setdefault(doc["kind"], []).append(doc)
    return objects


def containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    return list(obj["spec"]["template"]["spec"]["containers"])


def component(kind: str, name: str) -> dict[str, Any]:
    (found,) = [
        o
        for o in chart_objects().get(kind, [])
        if o["metadata"]["labels"].get("app.kubernetes.io/component") == name
    ]
    return found


def test_chart_templates_are_yaml_of_the_expected_kinds() -> None:
    kinds = {k: len(v) for k, v in chart_objects().items()}
    for kind in ["Deployment", "Service", "HorizontalPodAutoscaler", "StatefulSet", "Job"]:
        assert kind in kinds, kinds
    for kind in ["ConfigMap", "Secret", "PersistentVolumeClaim"]:
        assert kinds.get(kind) == 1, kinds


def test_chart_commands_are_real_treadle_server_invocations() -> None:
    for kind in ["Deployment", "StatefulSet", "Job"]:
        for obj in chart_objects()[kind]:
            for container in containers(obj):
                assert "command" not in container, "keep the image's treadle-server entrypoint"
                check_invocation([str(a) for a in container["args"]], f"{kind} {container['name']}")


def test_chart_workers_take_one_gpu_and_their_pod_name() -> None:
    worker = component("StatefulSet", "worker")
    (container,) = containers(worker)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    args = container["args"]
    # One rank per GPU of the pod: the group size is the GPU limit itself, and the device is
    # left for the worker to number (`cuda` alone, or cuda:0..N-1 for a group).
    # Helm is not run here (pseudo_render makes the expression X): the expression itself must
    # read the pod's GPU limit, the one source of the size, and give 1 where values leave it
    # out, rather than an empty --group-size the worker refuses.
    template = templates()["worker.yaml"]
    size = re.search(r'"--group-size", "\{\{\s*(.*?)\s*\}\}"', template)
    assert size is not None, "--group-size is not taken from the values"
    assert re.fullmatch(
        r'index \.Values\.worker\.resources\.limits "nvidia\.com/gpu" \| default 1', size[1]
    ), size[1]
    assert not any("GROUP_SIZE" in text for text in templates().values())
    assert option(args, "--device") == "cuda"
    assert args[args.index("--worker-id") + 1] == "$(TREADLE_WORKER_ID)"
    env = {e["name"]: e for e in container["env"]}
    assert env["TREADLE_WORKER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_chart_runs_exactly_one_beat() -> None:
    beat = component("Deployment", "beat")
    assert beat["spec"]["replicas"] == 1
    assert beat["spec"]["strategy"]["type"] == "Recreate"


def test_chart_migrates_before_install_and_upgrade() -> None:
    job = component("Job", "migrate")
    hooks = set(job["metadata"]["annotations"]["helm.sh/hook"].split(","))
    # On rollback, the older image's migrate fails unless `treadle-server downgrade` ran first.
    assert {"pre-install", "pre-upgrade", "pre-rollback"} <= hooks
    assert containers(job)[0]["args"] == ["migrate"]
    # What the Job reads must exist before it runs: hooks of a lower weight.
    for kind in ["ConfigMap", "Secret"]:
        (obj,) = chart_objects()[kind]
        assert hooks <= set(obj["metadata"]["annotations"]["helm.sh/hook"].split(","))
        assert int(obj["metadata"]["annotations"]["helm.sh/hook-weight"]) < int(
            job["metadata"]["annotations"]["helm.sh/hook-weight"]
        )


def test_chart_api_probes_health_and_shares_artifacts() -> None:
    api = component("Deployment", "api")
    (container,) = containers(api)
    assert container["readinessProbe"]["httpGet"]["path"] == "/api/v1/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/api/v1/healthz"
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert chart_values()["artifacts"]["mountPath"] in mounts
    (worker,) = containers(component("StatefulSet", "worker"))
    assert chart_values()["artifacts"]["mountPath"] in {
        m["mountPath"] for m in worker["volumeMounts"]
    }
    (pvc,) = chart_objects()["PersistentVolumeClaim"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]


def test_chart_has_no_default_secrets() -> None:
    secrets = chart_values()["secrets"]
    assert not any(secrets[k] for k in ("databaseUrl", "redisUrl", "serverSecret"))
    assert "required" in templates()["secret.yaml"]


def test_chart_containers_run_locked_down_with_their_own_writable_folders() -> None:
    wanted = {
        "runAsNonRoot": True,
        "runAsUser": 10001,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
    }
    for kind in ["Deployment", "StatefulSet", "Job"]:
        for obj in chart_objects()[kind]:
            volumes = {v["name"]: v for v in obj["spec"]["template"]["spec"]["volumes"]}
            for container in containers(obj):
                where = f"{kind} {container['name']}"
                security = container["securityContext"]
                assert {k: security.get(k) for k in wanted} == wanted, where
                assert security["capabilities"]["drop"] == ["ALL"], where
                mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
                writable = ["/tmp"] if kind == "Job" else ["/tmp", "/var/lib/treadle"]
                for path in writable:
                    assert "emptyDir" in volumes[mounts[path]], f"{where}: {path} is not writable"


def test_chart_workers_are_ready_while_they_renew_their_lease() -> None:
    (container,) = containers(component("StatefulSet", "worker"))
    env = {e["name"]: e.get("value") for e in container["env"]}
    lease = float(chart_values()["config"]["TREADLE_WORKER_LEASE_SECONDS"])
    for probe in ["startupProbe", "readinessProbe"]:
        spec = container[probe]
        max_age = check_probe(spec["exec"]["command"], env["TREADLE_LIVENESS_FILE"], probe)
        assert max_age >= lease, probe
        assert spec["timeoutSeconds"] >= 5, f"{probe}: the probe starts a Python interpreter"
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "time to load models"
    # Restarting a worker that cannot reach the database would only drop the runs it holds.
    assert "livenessProbe" not in container
    assert component("StatefulSet", "worker")["spec"]["updateStrategy"]["type"] == "RollingUpdate"


def test_chart_restarts_a_beat_whose_loop_stopped() -> None:
    (container,) = containers(component("Deployment", "beat"))
    env = {e["name"]: e.get("value") for e in container["env"]}
    probe = container["livenessProbe"]
    max_age = check_probe(probe["exec"]["command"], env["TREADLE_LIVENESS_FILE"], "beat")
    assert max_age >= 30 * BEAT_TICK_SECONDS
    assert probe["timeoutSeconds"] >= 5


def test_chart_grace_periods_outlast_a_long_poll_and_a_drain() -> None:
    api = component("Deployment", "api")["spec"]["template"]["spec"]
    assert api["terminationGracePeriodSeconds"] >= LONG_POLL_SECONDS + 10
    worker = component("StatefulSet", "worker")["spec"]["template"]["spec"]
    assert worker["terminationGracePeriodSeconds"] >= DRAIN_SECONDS + 30


def test_chart_disruption_budgets_keep_an_api_replica_and_all_workers_but_one() -> None:
    budgets = {
        pdb["metadata"]["labels"]["app.kubernetes.io/component"]: pdb
        for pdb in chart_objects()["PodDisruptionBudget"]
    }
    assert budgets["api"]["spec"]["minAvailable"] == 1
    assert budgets["worker"]["spec"]["maxUnavailable"] == 1
    for name, pdb in budgets.items():
        kind = "StatefulSet" if name == "worker" else "Deployment"
        pods = component(kind, name)["spec"]["template"]["metadata"]["labels"]
        selector = pdb["spec"]["selector"]["matchLabels"]
        assert selector["app.kubernetes.io/component"] == pods["app.kubernetes.io/component"]


def test_chart_extra_volumes_mounts_and_env_reach_the_containers() -> None:
    values = json.loads(json.dumps(chart_values()))
    models = {"name": "models", "persistentVolumeClaim": {"claimName": "m", "readOnly": True}}
    values["worker"]["extraVolumes"] = [models]
    values["worker"]["extraVolumeMounts"] = [{"name": "models", "mountPath": "/models"}]
    values["extraEnv"] = [{"name": "AWS_PROFILE", "value": "treadle"}]
    rendered = {
        doc["kind"]: doc
        for name in ["worker.yaml", "api.yaml", "beat.yaml", "migrate-job.yaml"]
        for doc in pseudo_render(templates()[name], values)
    }
    worker = rendered["StatefulSet"]["spec"]["template"]["spec"]
    assert models in worker["volumes"]
    (container,) = worker["containers"]
    assert {"name": "models", "mountPath": "/models"} in container["volumeMounts"]
    for kind in ["StatefulSet", "Deployment", "Job"]:
        (container,) = containers(rendered[kind])
        assert {"name": "AWS_PROFILE", "value": "treadle"} in container["env"], kind


def fullname(release: str) -> str:
    """treadle.fullname's rule (checked against _helpers.tpl below)."""
    name = release if "treadle" in release else f"{release}-treadle"
    return name[:63].rstrip("-")


def helper_limit(helper: str) -> int:
    """The `trunc N` of a helper in _helpers.tpl (the same N in each of its branches)."""
    text = (CHART / "templates" / "_helpers.tpl").read_text()
    _, found, rest = text.partition(f'define "{helper}"')
    assert found, f"no helper {helper}"
    (limit,) = set(re.findall(r"trunc (\d+)", rest.split("define ")[0]))
    return int(limit)


def test_worker_ids_fit_the_workers_table_for_a_long_release_name() -> None:
    assert helper_limit("treadle.fullname") == 63
    release = "r" * 60
    statefulset = f"{fullname(release)}-worker"[: helper_limit("treadle.workerName")].rstrip("-")
    # The label controller-revision-hash is <statefulset>-<10 characters>, at most 63.
    assert len(statefulset) + 11 <= 63
    id_type = Worker.__table__.c.id.type
    assert isinstance(id_type, String) and id_type.length
    last_pod = f"{statefulset}-{chart_values()['worker']['replicas'] * 100}"
    assert len(last_pod) <= min(63, id_type.length), last_pod
    for component_name in ["api", "beat", "migrate"]:
        limit = helper_limit("treadle.componentName")
        assert len(f"{fullname(release)}-{component_name}"[:limit]) <= 63


def test_chart_tags_its_images_as_the_docs_build_them() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert chart["appVersion"] == version, "appVersion is the server's version"
    images = chart_values()["image"]
    assert images["api"]["tag"] == images["worker"]["tag"] == "", "tags default to appVersion"
    texts = [
        (ROOT / "docs" / "operations.md").read_text(),
        *map(Path.read_text, DOCKERFILES.values()),
    ]
    built = [
        found
        for text in texts
        for found in re.findall(
            r"docker build -f infra/docker/(\w+)\.Dockerfile -t ([\w./-]+):?(\S*)", text
        )
    ]
    assert len(built) >= 4, built
    for dockerfile, repository, tag in built:
        assert repository == images[dockerfile]["repository"], repository
        assert tag == version, f"docs build {repository}:{tag}, the chart pulls :{version}"


def helm_template(*args: str, release: str = "t") -> subprocess.CompletedProcess[str]:
    if shutil.which("helm") is None:
        pytest.skip("helm is not installed; the chart is checked statically above")
    return subprocess.run(
        ["helm", "template", release, str(CHART), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_helm_renders_the_chart() -> None:
    result = helm_template(
        "--set", "secrets.databaseUrl=postgresql+psycopg://u:p@db/treadle",
        "--set", "secrets.redisUrl=redis://redis:6379/0",
        "--set", "secrets.serverSecret=helm-template-check-0123456789",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    kinds = {d["kind"] for d in yaml.safe_load_all(result.stdout) if d}
    assert {"Deployment", "StatefulSet", "Job", "HorizontalPodAutoscaler"} <= kinds
    lint = subprocess.run(
        ["helm", "lint", str(CHART), "--set", "secrets.existingSecret=x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_helm_names_fit_for_a_long_release_name() -> None:
    result = helm_template("--set", "secrets.existingSecret=x", release="r" * 53)
    assert result.returncode == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    for doc in docs:
        if doc["kind"] in ("Service", "Job"):
            assert len(doc["metadata"]["name"]) <= 63, doc["metadata"]["name"]
    (statefulset,) = [d for d in docs if d["kind"] == "StatefulSet"]
    assert len(statefulset["metadata"]["name"]) <= 52


def test_helm_refuses_to_render_without_secrets() -> None:
    result = helm_template()
    assert result.returncode != 0 and "secrets." in result.stderr
