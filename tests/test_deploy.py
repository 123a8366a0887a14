"""Deployment files: docker-compose.yml, Dockerfile, .dockerignore and deploy/kubernetes.yaml.

No container engine is needed: the compose file is checked against the Compose Specification's JSON
Schema and by `docker-compose config`, the Dockerfile by hadolint and by reading it, the Kubernetes
manifests by reading them.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from imgedit.config.settings import REGISTRY

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_SCHEMA = Path(__file__).resolve().parents[2] / "shared/schemas/compose-spec.json"
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
KUBERNETES = ROOT / "deploy/kubernetes.yaml"
PORT = 7860
GPU = "nvidia.com/gpu"


def test_app_port_and_health_route_are_what_the_deploy_files_assume():
    defaults = {var.name: var.default for var in REGISTRY}
    assert defaults["GRADIO_SERVER_PORT"] == str(PORT)
    assert '@router.get("/health")' in (ROOT / "imgedit/web/api/rest.py").read_text(encoding="utf-8")


# ---------------------------------------------------------------- docker-compose.yml


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def compose_validator():
    if not COMPOSE_SCHEMA.is_file():
        pytest.skip(f"Compose Specification schema not found at {COMPOSE_SCHEMA} (shared/schemas is absent)")
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(COMPOSE_SCHEMA.read_text(encoding="utf-8"))
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def test_compose_file_matches_the_compose_spec_schema(compose, compose_validator):
    errors = sorted(compose_validator.iter_errors(compose), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)


def test_compose_schema_check_is_not_vacuous(compose, compose_validator):
    broken = copy.deepcopy(compose)
    broken["services"]["imgedit"]["deploy"]["resources"]["reservations"]["devices"][0]["gpus"] = "all"
    assert list(compose_validator.iter_errors(broken)), "the schema accepted an unknown device key"


def test_compose_service(compose):
    service = compose["services"]["imgedit"]
    assert service["build"] in (".", {"context": "."})
    assert service["image"] == "imgedit:latest"
    env_files = service["env_file"] if isinstance(service["env_file"], list) else [service["env_file"]]
    assert [f if isinstance(f, str) else f["path"] for f in env_files] == [".env"]
    assert f"${{GRADIO_SERVER_PORT:-{PORT}}}:{PORT}" in service["ports"]
    # The container side is pinned, whatever GRADIO_SERVER_PORT says in .env (that one picks the host port).
    assert str(service["environment"]["GRADIO_SERVER_PORT"]) == str(PORT)
    assert service["environment"]["GRADIO_SERVER_NAME"] == "0.0.0.0"
    assert service["init"] is True
    assert service["restart"] == "unless-stopped"
    assert "shm_size" in service

    cache = [m.group(1) for v in service["volumes"] if (m := re.fullmatch(r"(.+):/models(?::rw)?", v))]
    assert cache, "the model cache must be mounted (read-write) at /models"
    named = re.fullmatch(r"\$\{MODEL_CACHE_DIR:-(\w+)\}|(\w+)", cache[0])
    assert named, f"the /models source should default to a named volume, got {cache[0]!r}"
    assert (named.group(1) or named.group(2)) in (compose.get("volumes") or {}), "named volume not declared"

    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert len(devices) == 1
    gpu = devices[0]
    assert gpu["driver"] == "nvidia"
    assert "gpu" in gpu["capabilities"]
    assert ("count" in gpu) != ("device_ids" in gpu), "compose takes count or device_ids, not both"

    health = service["healthcheck"]
    test = " ".join(health["test"]) if isinstance(health["test"], list) else health["test"]
    assert f"127.0.0.1:{PORT}/health" in test and "python" in test
    assert "curl" not in test and "wget" not in test, "the image has no curl/wget; use python"
    assert _seconds(health["start_period"]) >= 600


def _seconds(value: str | int) -> float:
    if isinstance(value, (int, float)):
        return float(value)
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", value)
    assert parts and "".join(n + u for n, u in parts) == value, f"not a duration: {value!r}"
    return sum(float(n) * units[u] for n, u in parts)


def _compose_config(tmp_path: Path, extra_env: str = "") -> dict:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose is not installed")
    for name in ("docker-compose.yml", "Dockerfile", ".dockerignore"):
        shutil.copy(ROOT / name, tmp_path / name)
    # Compose needs .env (env_file); the documented first step is `cp .env.example .env`.
    (tmp_path / ".env").write_text((ROOT / ".env.example").read_text(encoding="utf-8") + extra_env)
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path)}  # no stray GRADIO_* etc. from the caller
    quiet = subprocess.run([binary, "config", "-q"], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=120)
    assert quiet.returncode == 0, quiet.stderr + quiet.stdout
    full = subprocess.run([binary, "config"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert full.returncode == 0, full.stderr + full.stdout
    return yaml.safe_load(full.stdout)["services"]["imgedit"]


def test_docker_compose_config_with_the_example_env(tmp_path):
    service = _compose_config(tmp_path)
    assert [(p["published"], p["target"]) for p in service["ports"]] in ([(PORT, PORT)], [(str(PORT), PORT)])
    assert str(service["deploy"]["resources"]["reservations"]["devices"][0]["count"]) == "all"
    assert service["environment"]["DEVICE_MAP"] == "balanced"  # .env reaches the container
    assert any(v.startswith("models:/models") for v in service["volumes"])


def test_docker_compose_config_with_overrides(tmp_path):
    service = _compose_config(tmp_path, "GPU_COUNT=2\nGRADIO_SERVER_PORT=8080\nMODEL_CACHE_DIR=/srv/models\n")
    assert [(int(p["published"]), p["target"]) for p in service["ports"]] == [(8080, PORT)]
    assert str(service["environment"]["GRADIO_SERVER_PORT"]) == str(PORT)
    assert str(service["deploy"]["resources"]["reservations"]["devices"][0]["count"]) == "2"
    assert any(v.startswith("/srv/models:/models") for v in service["volumes"])


# ---------------------------------------------------------------- Dockerfile


def _hadolint() -> str | None:
    local = Path(sys.executable).parent / "hadolint"
    return str(local) if local.is_file() else shutil.which("hadolint")


def test_hadolint_passes():
    binary = _hadolint()
    if binary is None:
        pytest.skip("hadolint is not installed")
    result = subprocess.run([binary, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pending += line[:-1].rstrip() + " " if line.endswith("\\") else line
        if line.endswith("\\"):
            continue
        keyword, _, args = pending.partition(" ")
        out.append((keyword.upper(), args.strip()))
        pending = ""
    assert not pending, "Dockerfile ends inside a continued line"
    return out


def test_dockerfile_essentials():
    instructions = _instructions()
    by_kind: dict[str, list[str]] = {}
    for kind, args in instructions:
        by_kind.setdefault(kind, []).append(args)

    base = by_kind["FROM"][0].split()[0]
    assert ":" in base and not base.endswith(":latest"), f"pin the base image tag: {base}"
    assert "cuda" in base or base.startswith("pytorch/"), f"expected a CUDA base image: {base}"

    user = by_kind["USER"][-1].split(":")[0]
    assert user not in ("root", "0"), "the image must not run as root"
    assert user == "1000", "run as uid 1000 (numeric, so Kubernetes runAsNonRoot can check it)"
    assert instructions[-1][0] == "CMD" and json.loads(instructions[-1][1]) == ["python", "app.py"]
    assert [kind for kind, _ in instructions].index("USER") < len(instructions) - 1

    assert any(str(PORT) in args.split() for args in by_kind["EXPOSE"])
    env = " ".join(by_kind["ENV"])
    assert "HF_HOME=/models/hf" in env and "GRADIO_SERVER_NAME=0.0.0.0" in env
    # what a start measures or compiles is kept on the model volume, so a recreated container reuses it
    assert "COMPILE_CACHE_DIR=/models/compile" in env and "IMGEDIT_SIZES_CACHE=/models/imgedit-sizes" in env
    assert any("/models" in args for args in by_kind["VOLUME"])
    assert any("-r requirements.txt" in args for args in by_kind["RUN"])

    (health,) = by_kind["HEALTHCHECK"]
    assert "/health" in health and "python" in health and "curl" not in health
    start = re.search(r"--start-period=(\S+)", health)
    assert start and _seconds(start.group(1)) >= 600, "model loading is slow: use a long --start-period"


def _dockerignore_excludes(path: str) -> bool:
    """Docker's rule: patterns in order, the last one matching the path or a parent decides; ! re-includes."""
    excluded = False
    for raw in DOCKERIGNORE.read_text(encoding="utf-8").splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        regex = re.escape(pattern).replace(r"\*\*/", "(?:.*/)?").replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        parts = path.split("/")
        if any(re.fullmatch(regex, "/".join(parts[:i])) for i in range(1, len(parts) + 1)):
            excluded = not negate
    return excluded


def test_dockerignore_keeps_secrets_and_clutter_out_but_not_what_the_image_copies():
    for path in (".env", ".venv", ".git", ".pytest_cache", ".ruff_cache", "artifacts", ".cache", "tests",
                 "imgedit/__pycache__/settings.cpython-312.pyc"):
        assert _dockerignore_excludes(path), f"{path} would be sent to the build context"
    copied = [src for kind, args in _instructions() if kind == "COPY"
              for src in args.split()[:-1] if not src.startswith("--")]
    assert copied
    for src in [*copied, "imgedit/config/settings.py"]:
        assert not _dockerignore_excludes(src.rstrip("/")), f"{src} is copied by the Dockerfile but ignored"


# ---------------------------------------------------------------- deploy/kubernetes.yaml


@pytest.fixture(scope="module")
def manifests() -> dict[str, dict]:
    docs = [d for d in yaml.safe_load_all(KUBERNETES.read_text(encoding="utf-8")) if d]
    kinds = [d["kind"] for d in docs]
    assert sorted(kinds) == ["Deployment", "PersistentVolumeClaim", "Service"], kinds
    return {d["kind"]: d for d in docs}


def _port(value, container: dict) -> int:
    if isinstance(value, int):
        return value
    return next(p["containerPort"] for p in container["ports"] if p.get("name") == value)


def test_kubernetes_deployment(manifests):
    deployment = manifests["Deployment"]
    spec = deployment["spec"]
    pod = spec["template"]["spec"]
    labels = spec["template"]["metadata"]["labels"]
    assert spec["replicas"] == 1
    assert spec["selector"]["matchLabels"].items() <= labels.items()

    security = pod["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] == 1000

    (container,) = pod["containers"]
    assert any(p["containerPort"] == PORT for p in container["ports"])
    limits = container["resources"]["limits"]
    assert int(limits[GPU]) >= 1

    env = {e["name"]: e for e in container["env"]}
    assert env["DEVICE_MAP"]["value"] == "balanced"
    assert env["HF_HOME"]["value"] == "/models/hf"
    assert "QWEN_MODEL" in env
    key = env["API_KEY"]["valueFrom"]["secretKeyRef"]
    assert key["optional"] is True, "the API key Secret must be optional"

    for probe_name in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container[probe_name]["httpGet"]
        assert probe["path"] == "/health", probe_name
        assert _port(probe["port"], container) == PORT, probe_name
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "allow for slow model loading"

    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    cache = [name for name, path in mounts.items() if path == "/models"]
    assert cache, "the model cache must be mounted at /models"
    claim = volumes[cache[0]]["persistentVolumeClaim"]["claimName"]
    assert claim == manifests["PersistentVolumeClaim"]["metadata"]["name"]


def test_kubernetes_service_reaches_the_pods(manifests):
    service = manifests["Service"]["spec"]
    template = manifests["Deployment"]["spec"]["template"]
    assert service["selector"] and service["selector"].items() <= template["metadata"]["labels"].items()
    (container,) = template["spec"]["containers"]
    assert [_port(p.get("targetPort", p["port"]), container) for p in service["ports"]] == [PORT]


# ---------------------------------------------------------------- WORKERS=ray: compose and KubeRay

RAY_COMPOSE_FILE = ROOT / "deploy/docker-compose.ray.yml"
KUBERAY = ROOT / "deploy/kuberay.yaml"


def _ray_pin() -> str:
    pins = [line.split("==")[1].strip() for line in (ROOT / "requirements.txt").read_text().splitlines()
            if line.startswith("ray==")]
    assert len(pins) == 1, "requirements.txt pins ray exactly once"
    return pins[0]


@pytest.fixture(scope="module")
def ray_compose() -> dict:
    return yaml.safe_load(RAY_COMPOSE_FILE.read_text(encoding="utf-8"))


def test_ray_compose_file_matches_the_compose_spec_schema(ray_compose, compose_validator):
    errors = sorted(compose_validator.iter_errors(ray_compose), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)
    broken = copy.deepcopy(ray_compose)
    broken["services"]["gpu-node"]["deploy"]["resources"]["reservations"]["devices"][0]["gpus"] = "all"
    assert list(compose_validator.iter_errors(broken)), "the schema accepted an unknown device key"


def test_ray_compose_server_is_the_head_and_the_nodes_hold_the_gpus(ray_compose):
    server, node = ray_compose["services"]["imgedit"], ray_compose["services"]["gpu-node"]
    assert server["environment"]["WORKERS"] == "ray" and server["environment"]["RAY_ADDRESS"] == "auto"
    head = " ".join(server["command"])
    assert "ray start --head --port=6379 --num-gpus=0" in head and head.endswith("exec python app.py")
    assert "deploy" not in server, "the server holds no GPU"
    assert f"${{GRADIO_SERVER_PORT:-{PORT}}}:{PORT}" in server["ports"]
    assert "ray start --address=imgedit:6379" in " ".join(node["command"]) and "--block" in node["command"][-1]
    assert node["image"] == server["image"] == "imgedit:latest"
    assert node["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert node["environment"]["RAY_AUTH_TOKEN"] == server["environment"]["RAY_AUTH_TOKEN"]
    assert any(v.endswith(":/models") for v in node["volumes"])


@pytest.fixture(scope="module")
def kuberay() -> list[dict]:
    return [d for d in yaml.safe_load_all(KUBERAY.read_text(encoding="utf-8")) if d]


def test_kuberay_raycluster(kuberay):
    (cluster,) = [d for d in kuberay if d["kind"] == "RayCluster"]
    assert cluster["apiVersion"] == "ray.io/v1"
    assert cluster["spec"]["rayVersion"] == _ray_pin(), "the cluster's ray must be the pinned one"
    assert cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    head = cluster["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    (server,) = head["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in server["env"]}
    assert env["WORKERS"] == "ray" and env["RAY_ADDRESS"] == "auto"
    assert "${KUBERAY_GEN_RAY_START_CMD}" in server["args"][0] and server["args"][0].endswith("exec python app.py")
    assert GPU not in server["resources"].get("limits", {})
    assert {"containerPort": PORT, "name": "http"} in server["ports"]
    (group,) = cluster["spec"]["workerGroupSpecs"]
    (worker,) = group["template"]["spec"]["containers"]
    assert worker["resources"]["limits"][GPU] >= 1 and worker["image"] == server["image"]
    assert "${KUBERAY_GEN_RAY_START_CMD}" in worker["args"][0]
    claims = {v["persistentVolumeClaim"]["claimName"] for v in group["template"]["spec"]["volumes"]
              if "persistentVolumeClaim" in v}
    (pvc,) = [d for d in kuberay if d["kind"] == "PersistentVolumeClaim"]
    assert claims == {pvc["metadata"]["name"]} and pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    (service,) = [d for d in kuberay if d["kind"] == "Service"]
    assert service["spec"]["selector"] == {"ray.io/cluster": cluster["metadata"]["name"], "ray.io/node-type": "head"}
    assert service["spec"]["ports"][0]["targetPort"] == PORT


def _ray_compose_config(tmp_path: Path, extra_env: str) -> subprocess.CompletedProcess:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose is not installed")
    (tmp_path / "deploy").mkdir()
    shutil.copy(RAY_COMPOSE_FILE, tmp_path / "deploy" / RAY_COMPOSE_FILE.name)
    for name in ("Dockerfile", ".dockerignore"):
        shutil.copy(ROOT / name, tmp_path / name)
    (tmp_path / ".env").write_text((ROOT / ".env.example").read_text(encoding="utf-8") + extra_env)
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path)}
    # The README's command, less `up`: --env-file .env from the project root, -f the file in deploy/.
    return subprocess.run([binary, "--env-file", ".env", "-f", f"deploy/{RAY_COMPOSE_FILE.name}", "config"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_ray_compose_config_with_the_example_env(tmp_path):
    done = _ray_compose_config(tmp_path, "RAY_AUTH_TOKEN=0123456789abcdef\nGPU_COUNT=2\n")
    assert done.returncode == 0, done.stderr + done.stdout
    services = yaml.safe_load(done.stdout)["services"]
    assert services["imgedit"]["environment"]["WORKERS"] == "ray"  # the service wins over .env's WORKERS=local
    assert services["gpu-node"]["environment"]["RAY_AUTH_TOKEN"] == "0123456789abcdef"
    assert str(services["gpu-node"]["deploy"]["resources"]["reservations"]["devices"][0]["count"]) == "2"
    assert services["imgedit"]["build"]["context"] == str(tmp_path)


def test_ray_compose_refuses_to_start_without_a_token(tmp_path):
    done = _ray_compose_config(tmp_path, "")
    assert done.returncode != 0 and "RAY_AUTH_TOKEN" in done.stderr
