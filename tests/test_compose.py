"""The docker-compose stack: `docker-compose config` validates it and names a missing required
variable; its resolved environment builds our Settings; every long-running service has a
health check; the SparseGuard processes share one image and start after the migration and
healthy infrastructure; the Prometheus and Alertmanager configs it mounts scrape, load the
rules the `rules` step writes (promtool) and route to the webhook receiver; the Dockerfile
installs CPU torch before the project and runs as non-root."""

from __future__ import annotations

import base64
import fnmatch
import os
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from alerts.signing import secret_key
from services.cli import build_parser
from services.config import Settings
from services.gateway.auth import hash_key

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "services" / "Dockerfile"
PROMETHEUS_CONFIG = ROOT / "alerts" / "deploy" / "prometheus.yml"
ALERTMANAGER_CONFIG = ROOT / "alerts" / "deploy" / "alertmanager.yml"

REQUIRED = {
    "POSTGRES_PASSWORD": "compose-check-password",
    "GRAFANA_ADMIN_PASSWORD": "compose-check-grafana",
    "SPARSEGUARD_WEBHOOK_URL": "https://hooks.example.com/sparseguard",
    "SPARSEGUARD_WEBHOOK_SECRET": "whsec_" + base64.b64encode(bytes(range(32))).decode(),
    "SPARSEGUARD_ADMIN_KEY_HASH": hash_key("compose-check-admin-key"),
}
INFRASTRUCTURE = ("kafka", "postgres", "redis")
PROCESSES = {
    "gateway": ["gateway", "--host", "0.0.0.0"],
    "aggregator": ["aggregator"],
    "worker": ["worker"],
    "beat": ["beat"],
}
ONE_SHOTS = {"migrate", "calibrate", "rules"}
MONITORING = ("prometheus", "alertmanager", "grafana")


def load_yaml(path: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(path.read_text(encoding="utf-8"))
    return loaded


@pytest.fixture(scope="module")
def stack() -> dict[str, dict[str, Any]]:
    """The compose file's services as written (YAML anchors and merges applied)."""
    found: dict[str, dict[str, Any]] = load_yaml(COMPOSE_FILE)["services"]
    return found


def mounts(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> source (volume name or host path) of a service's volumes."""
    return {volume.split(":")[1]: volume.split(":")[0] for volume in service["volumes"]}


def run_config(variables: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """`docker-compose config` with exactly `variables`: no inherited environment, no .env."""
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose is not installed (`make test` installs the Debian package)")
    empty_env_file = tmp_path / "empty.env"
    empty_env_file.write_text("", encoding="utf-8")
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), **variables}
    command = [binary, "--env-file", str(empty_env_file), "-f", str(COMPOSE_FILE), "config"]
    return subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_compose_config_validates_with_the_required_variables(tmp_path: Path) -> None:
    result = run_config(REQUIRED, tmp_path)
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)["services"]
    assert set(resolved) == {*INFRASTRUCTURE, *PROCESSES, *ONE_SHOTS, *MONITORING}


@pytest.mark.parametrize("missing", sorted(REQUIRED))
def test_a_missing_required_variable_stops_compose_naming_it(missing: str, tmp_path: Path) -> None:
    variables = {name: value for name, value in REQUIRED.items() if name != missing}
    result = run_config(variables, tmp_path)
    assert result.returncode != 0
    assert f"set {missing} (see the top of docker-compose.yml)" in result.stderr


def test_the_resolved_environment_builds_the_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = run_config(REQUIRED, tmp_path)
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)["services"]
    environments = [resolved[name]["environment"] for name in (*PROCESSES, *ONE_SHOTS)]
    assert all(env == environments[0] for env in environments)
    for name in [name for name in os.environ if name.startswith("SPARSEGUARD_")]:
        monkeypatch.delenv(name)
    for name, value in environments[0].items():
        monkeypatch.setenv(name, str(value))
    settings = Settings()
    password = REQUIRED["POSTGRES_PASSWORD"]
    assert settings.database_url == (
        f"postgresql+psycopg://sparseguard:{password}@postgres:5432/sparseguard"
    )
    assert settings.telemetry.bootstrap_servers == "kafka:9092"
    assert settings.celery_broker_url == "redis://redis:6379/0"
    assert (settings.gateway.host, settings.aggregator.host) == ("0.0.0.0", "0.0.0.0")
    assert settings.gateway.admin_key_hashes == [REQUIRED["SPARSEGUARD_ADMIN_KEY_HASH"]]
    [receiver] = settings.alerts.receivers
    assert receiver.url == REQUIRED["SPARSEGUARD_WEBHOOK_URL"]
    assert secret_key(receiver.secret.get_secret_value())  # a valid Standard Webhooks secret


def completed_dependencies(stack: dict[str, dict[str, Any]]) -> set[str]:
    """Services others wait on to finish: the one-shot steps."""
    return {
        name
        for service in stack.values()
        for name, dependency in service.get("depends_on", {}).items()
        if dependency["condition"] == "service_completed_successfully"
    }


def test_every_long_running_service_has_a_health_check(
    stack: dict[str, dict[str, Any]],
) -> None:
    assert completed_dependencies(stack) == ONE_SHOTS
    for name, service in stack.items():
        if name in ONE_SHOTS:
            assert "restart" not in service, name
            continue
        assert service["restart"] == "unless-stopped", name
        assert service["healthcheck"]["test"][0] in ("CMD", "CMD-SHELL"), name


def test_the_sparseguard_processes_share_one_image_and_start_in_order(
    stack: dict[str, dict[str, Any]],
) -> None:
    for name in (*PROCESSES, *ONE_SHOTS):
        service = stack[name]
        assert service["build"] == {"context": ".", "dockerfile": "services/Dockerfile"}, name
        assert service["image"] == "sparseguard:local", name
    for name, command in PROCESSES.items():
        service = stack[name]
        assert service["command"] == command
        conditions = {dep: spec["condition"] for dep, spec in service["depends_on"].items()}
        assert conditions["migrate"] == "service_completed_successfully", name
        assert all(conditions[infra] == "service_healthy" for infra in INFRASTRUCTURE), name
        # python:3.11-slim has no curl or wget.
        assert service["healthcheck"]["test"][:2] == ["CMD", "python"], name
    assert stack["migrate"]["command"] == ["db", "upgrade"]
    assert stack["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"


def sparseguard_commands(stack: dict[str, dict[str, Any]]) -> list[list[str]]:
    """Every `sparseguard` command line the compose file runs (entrypoint `sparseguard`)."""
    commands = [stack[name]["command"] for name in (*PROCESSES, "migrate", "rules")]
    [script] = stack["calibrate"]["command"]
    for step in script.split("&&"):
        words = shlex.split(step)
        words = words[1:] if words[0] == "exec" else words
        assert words[0] == "sparseguard"
        commands.append(words[1:])
    return commands


def test_every_sparseguard_command_parses(stack: dict[str, dict[str, Any]]) -> None:
    parser = build_parser()
    for command in sparseguard_commands(stack):
        assert callable(parser.parse_args(command).handler), command


def test_kafka_runs_in_kraft_mode_and_postgres_reports_readiness(
    stack: dict[str, dict[str, Any]],
) -> None:
    kafka = stack["kafka"]
    assert kafka["image"].startswith("apache/kafka:")
    assert kafka["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert "pg_isready" in stack["postgres"]["healthcheck"]["test"]


def provisioning_variables(node: Any) -> set[str]:
    """The environment variables ($NAME or ${NAME}) Grafana expands in a provisioning file."""
    if isinstance(node, dict):
        return set().union(*(provisioning_variables(value) for value in node.values()))
    if isinstance(node, list):
        return set().union(*(provisioning_variables(value) for value in node))
    if isinstance(node, str):
        return {a or b for a, b in re.findall(r"\$\{(\w+)\}|\$(\w+)", node)}
    return set()


def test_grafana_provisioning_finds_its_dashboards_and_variables(
    stack: dict[str, dict[str, Any]],
) -> None:
    grafana = stack["grafana"]
    sources = mounts(grafana)
    for kind in ("datasources", "dashboards"):
        path = f"/etc/grafana/provisioning/{kind}"
        assert sources[path] == f"./dashboards/provisioning/{kind}"
    paths = {path for path, source in sources.items() if source == "./dashboards/json"}
    provisioning = ROOT / "dashboards" / "provisioning"
    providers = [load_yaml(path) for path in sorted(provisioning.glob("dashboards/*.y*ml"))]
    for provider in (p for file in providers for p in file["providers"]):
        assert provider["options"]["path"] in paths
    files = [load_yaml(path) for path in sorted(provisioning.glob("*/*.y*ml"))]
    variables = set().union(*(provisioning_variables(file) for file in files))
    assert variables <= set(grafana["environment"])


def test_prometheus_scrapes_both_processes_and_alerts_through_alertmanager(
    stack: dict[str, dict[str, Any]],
) -> None:
    config = load_yaml(PROMETHEUS_CONFIG)
    targets = {
        target
        for job in config["scrape_configs"]
        for static in job["static_configs"]
        for target in static["targets"]
    }
    assert {"gateway:8000", "aggregator:8001"} <= targets
    [alertmanagers] = config["alerting"]["alertmanagers"]
    assert alertmanagers["static_configs"][0]["targets"] == ["alertmanager:9093"]
    prometheus = stack["prometheus"]
    assert mounts(prometheus)["/etc/prometheus/prometheus.yml"] == "./alerts/deploy/prometheus.yml"
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]


def rules_path_in_prometheus(stack: dict[str, dict[str, Any]]) -> PurePosixPath:
    """Where Prometheus sees the file the `rules` step writes (through their shared volume)."""
    out = PurePosixPath(stack["rules"]["command"][-1])
    [(directory, volume)] = mounts(stack["rules"]).items()
    prometheus_dirs = {source: path for path, source in mounts(stack["prometheus"]).items()}
    return PurePosixPath(prometheus_dirs[volume]) / out.relative_to(directory)


def test_prometheus_loads_the_rules_the_rules_step_writes(
    stack: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    seen = rules_path_in_prometheus(stack)
    patterns = load_yaml(PROMETHEUS_CONFIG)["rule_files"]
    assert any(fnmatch.fnmatch(str(seen), pattern) for pattern in patterns)
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (`make test` installs the Debian package)")
    # Run the `rules` step's own command here, then promtool-check the config loading its output.
    command = [*stack["rules"]["command"][:-1], str(tmp_path / "rules" / seen.name)]
    (tmp_path / "rules").mkdir()
    args = build_parser().parse_args(command)
    assert args.handler(args, Settings(home=tmp_path)) == 0
    config = load_yaml(PROMETHEUS_CONFIG) | {"rule_files": [str(tmp_path / "rules" / "*.yml")]}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config), encoding="utf-8")
    result = subprocess.run(
        [promtool, "check", "config", str(tmp_path / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"SUCCESS: \d+ rules found", result.stdout + result.stderr)


def test_alertmanager_routes_every_alert_to_the_webhook_receiver(
    stack: dict[str, dict[str, Any]],
) -> None:
    config = load_yaml(ALERTMANAGER_CONFIG)
    receivers = {receiver["name"]: receiver for receiver in config["receivers"]}
    assert "routes" not in config["route"]
    [webhook] = receivers[config["route"]["receiver"]]["webhook_configs"]
    url_file = PurePosixPath(webhook["url_file"])
    alertmanager = stack["alertmanager"]
    assert str(url_file.parent) in alertmanager["tmpfs"]
    [script] = alertmanager["command"]
    assert f'"$$SPARSEGUARD_WEBHOOK_URL" > {url_file} &&' in script
    assert "--config.file=/etc/alertmanager/alertmanager.yml" in script
    assert alertmanager["environment"]["SPARSEGUARD_WEBHOOK_URL"].startswith(
        "${SPARSEGUARD_WEBHOOK_URL:?"
    )
    config_mount = mounts(alertmanager)["/etc/alertmanager/alertmanager.yml"]
    assert config_mount == "./alerts/deploy/alertmanager.yml"


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = DOCKERFILE.read_text(encoding="utf-8")
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    pairs = [line.strip().split(maxsplit=1) for line in joined.splitlines() if line.strip()]
    return [(pair[0].upper(), pair[1]) for pair in pairs]


def test_the_image_installs_cpu_torch_before_the_project_and_runs_as_non_root(
    stack: dict[str, dict[str, Any]],
) -> None:
    instructions = dockerfile_instructions()
    assert instructions[0] == ("FROM", "python:3.11-slim")
    installs = [args for kind, args in instructions if kind == "RUN" and "pip install" in args]
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    [torch_pin] = [dep for dep in pyproject["project"]["dependencies"] if dep.startswith("torch")]
    assert "--index-url https://download.pytorch.org/whl/cpu" in installs[0]
    assert torch_pin in installs[0].split()
    assert re.search(r"pip install (-e )?\.( |$)", installs[1])
    users = [args for kind, args in instructions if kind == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert ("ENTRYPOINT", '["sparseguard"]') in instructions
    # Named volumes start with the owner of the image directory they are mounted on.
    created = " ".join(args for kind, args in instructions if kind == "RUN" and "chown" in args)
    for name in (*PROCESSES, *ONE_SHOTS):
        for path in mounts(stack[name]):
            assert path in created, (name, path)


def test_the_build_context_leaves_out_secrets_and_local_state() -> None:
    ignored = (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines()
    assert {".env", ".git", ".venv", "*.safetensors", "*.gguf"} <= set(ignored)
