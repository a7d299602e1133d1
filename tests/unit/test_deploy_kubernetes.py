"""deploy/kubernetes: the kustomize base is valid Kubernetes, wired consistently, and the Envoy
side (Envoy Gateway, Istio) configures ext_proc as envoy/envoy.yaml does.

No kubectl and no cluster: every file a kustomization lists is loaded as is, core objects are
checked by ``kubernetes-validate`` against its bundled (offline) schemas for one fixed Kubernetes
version, and the custom resources, which it has no schema for, by the fields we rely on.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from extproc.config import load_config_text

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "deploy" / "kubernetes"
K8S_VERSION = "1.33.0"
EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
EXT_PROC_HEALTH = "envoy.service.ext_proc.v3.ExternalProcessor"

Obj = dict[str, Any]


def render(directory: Path) -> list[Obj]:
    """Every object of every file the kustomization in ``directory`` lists under resources
    (a listed directory is rendered recursively), in order."""
    kust = yaml.safe_load((directory / "kustomization.yaml").read_text())
    out: list[Obj] = []
    for entry in kust["resources"]:
        path = (directory / entry).resolve()
        if path.is_dir():
            out.extend(render(path))
            continue
        out.extend(doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None)
    return out


def one(objs: list[Obj], kind: str, name: str | None = None) -> Obj:
    found = [o for o in objs if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


@pytest.fixture(scope="module")
def base() -> list[Obj]:
    return render(BASE)


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Any socket connection fails: the schema validation must work offline."""

    def refuse(*_args: object, **_kwargs: object) -> None:
        raise OSError("network disabled in this test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    yield


def containers(deploy: Obj) -> dict[str, Obj]:
    return {c["name"]: c for c in deploy["spec"]["template"]["spec"]["containers"]}


# -- the base ---------------------------------------------------------------------------------


def test_base_lists_the_core_objects(base: list[Obj]) -> None:
    kinds = sorted(o["kind"] for o in base)
    assert kinds == sorted(
        ["Namespace", "ConfigMap", "Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy"]
    )
    kust = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    namespaced = [o for o in base if o["kind"] != "Namespace"]
    assert {o["metadata"]["namespace"] for o in namespaced} == {kust["namespace"]}


def test_every_core_object_is_valid_kubernetes(base: list[Obj], no_network: None) -> None:
    for obj in base:
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']}: {where}: {exc.message}")


def test_the_validator_rejects_a_wrong_field(base: list[Obj], no_network: None) -> None:
    """The validation above really checks fields (strict: unknown ones are errors)."""
    deploy = yaml.safe_load(yaml.safe_dump(one(base, "Deployment")))
    deploy["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["prot"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deploy, K8S_VERSION, strict=True)


def test_deployment_runs_two_replicas_of_serve(base: list[Obj]) -> None:
    deploy = one(base, "Deployment", "ai-quota")
    assert deploy["spec"]["replicas"] == 2
    main = containers(deploy)["ai-quota"]
    assert main["command"] == ["ai-quota", "serve"]
    assert "--grpc-address=0.0.0.0:50051" in main["args"]
    env = {e["name"]: e for e in main["env"]}
    secret = env["AIQ_REDIS_URL"]["valueFrom"]["secretKeyRef"]
    assert (secret["name"], secret["key"]) == ("ai-quota-redis", "url")


def test_probes_use_grpc_health_on_the_plaintext_health_port(base: list[Obj]) -> None:
    """Kubelet gRPC probes cannot speak TLS: they use --health-address (health alone)."""
    main = containers(one(base, "Deployment"))["ai-quota"]
    ports = {p["name"]: p["containerPort"] for p in main["ports"]}
    assert ports["grpc"] == 50051
    assert f"--health-address=0.0.0.0:{ports['health']}" in main["args"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        spec = main[probe]
        assert set(spec) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}, probe
        assert spec["grpc"]["port"] == ports["health"], probe
        # Only the names the processor answers for ("" and the ext_proc service).
        assert spec["grpc"].get("service", "") in ("", EXT_PROC_HEALTH), probe
    assert main["readinessProbe"]["grpc"]["service"] == EXT_PROC_HEALTH


def test_the_grpc_port_is_closed_by_default(base: list[Obj]) -> None:
    """The processors' command line, read by the real parser, passes the start-up checks with
    TLS and a token file, each from a read-only Secret mount; a NetworkPolicy admits only
    Envoy's pods to the gRPC port (docs/security.md)."""
    from extproc.access import check_settings
    from extproc.cli import build_parser

    deploy = one(base, "Deployment", "ai-quota")
    main = containers(deploy)["ai-quota"]
    args = build_parser().parse_args(main["command"][1:] + main["args"])
    assert not args.insecure
    check_settings(
        address=args.grpc_address,
        insecure=False,
        token_file=args.grpc_token_file,
        tls_cert=args.grpc_tls_cert,
        tls_key=args.grpc_tls_key,
        client_ca="",
        allowed_sans=[],
        allow_plaintext=False,
    )
    assert args.grpc_tls_cert and args.grpc_token_file
    volumes = {v["name"]: v for v in deploy["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["mountPath"]: m for m in main["volumeMounts"]}
    for path, secret in (
        (args.grpc_token_file, "ai-quota-grpc-token"),
        (args.grpc_tls_cert, "ai-quota-grpc-tls"),
        (args.grpc_tls_key, "ai-quota-grpc-tls"),
    ):
        mount = mounts[str(Path(path).parent)]
        assert mount["readOnly"] is True and "subPath" not in mount  # updates reach the file
        assert volumes[mount["name"]]["secret"]["secretName"] == secret
    policy = one(base, "NetworkPolicy", "ai-quota")["spec"]
    labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert selects(policy["podSelector"]["matchLabels"], labels)
    grpc_rule = next(r for r in policy["ingress"] if r["ports"][0]["port"] == "grpc")
    (peer,) = grpc_rule["from"]
    assert peer["podSelector"]["matchLabels"] == {"ai-quota/ext-proc-client": "true"}
    open_ports = {p["port"] for r in policy["ingress"] if "from" not in r for p in r["ports"]}
    assert open_ports == {"health", "metrics"}


def test_rules_come_from_the_configmap_read_only(base: list[Obj]) -> None:
    deploy = one(base, "Deployment")
    main = containers(deploy)["ai-quota"]
    config_arg = next(a for a in main["args"] if a.startswith("--config="))
    rules_path = Path(config_arg.split("=", 1)[1])
    mount = next(m for m in main["volumeMounts"] if m["mountPath"] == str(rules_path.parent))
    assert mount["readOnly"] is True
    volume = next(
        v for v in deploy["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]
    )
    cm = one(base, "ConfigMap", volume["configMap"]["name"])
    assert rules_path.name in cm["data"]


def test_configmap_rules_pass_the_projects_own_validation(base: list[Obj]) -> None:
    cm = one(base, "ConfigMap", "ai-quota-rules")
    cfg = load_config_text(cm["data"]["rules.yaml"], source="configmap-rules.yaml")
    assert cfg.plaintext_keys == 0  # hashed keys only
    assert cfg.tenants and cfg.keys_by_digest


def test_pods_are_hardened_and_stop_after_the_drain(base: list[Obj]) -> None:
    pod = one(base, "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    for c in pod["containers"]:
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True, c["name"]
        assert sc["allowPrivilegeEscalation"] is False, c["name"]
        assert sc["capabilities"]["drop"] == ["ALL"], c["name"]
        assert {"cpu", "memory"} <= set(c["resources"]["requests"]), c["name"]
        assert "memory" in c["resources"]["limits"], c["name"]
    env = {
        e["name"]: e.get("value") for e in containers(one(base, "Deployment"))["ai-quota"]["env"]
    }
    drain = float(env["AIQ_DRAIN_NOTICE_S"]) + float(env["AIQ_SHUTDOWN_GRACE_S"])
    assert pod["terminationGracePeriodSeconds"] > drain + 5  # room for the final flush


def test_service_and_pdb_select_the_pods(base: list[Obj]) -> None:
    deploy = one(base, "Deployment")
    labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert selects(deploy["spec"]["selector"]["matchLabels"], labels)
    svc = one(base, "Service", "ai-quota")
    assert selects(svc["spec"]["selector"], labels)
    pdb = one(base, "PodDisruptionBudget")
    assert selects(pdb["spec"]["selector"]["matchLabels"], labels)
    assert pdb["spec"]["minAvailable"] == 1 < deploy["spec"]["replicas"]


def test_service_ports_reach_named_container_ports(base: list[Obj]) -> None:
    svc_ports = {p["name"]: p for p in one(base, "Service")["spec"]["ports"]}
    assert svc_ports["grpc"]["appProtocol"] == "grpc"
    container_ports = {
        p["name"] for c in containers(one(base, "Deployment")).values() for p in c.get("ports", [])
    }
    for name in ("grpc", "metrics"):
        assert svc_ports[name]["targetPort"] in container_ports, name


def test_metrics_are_served_on_the_pod_ip_by_the_processor_itself(base: list[Obj]) -> None:
    cs = containers(one(base, "Deployment"))
    args = cs["ai-quota"]["args"]
    assert "--metrics-port=9090" in args and "--metrics-host=0.0.0.0" in args
    assert {p["name"]: p["containerPort"] for p in cs["ai-quota"]["ports"]}["metrics"] == 9090
    assert set(cs) == {"ai-quota"}  # no sidecar needed


def test_redis_dev_overlay_is_valid_and_provides_the_secret(no_network: None) -> None:
    objs = render(BASE / "redis-dev")
    for obj in objs:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    secret = one(objs, "Secret", "ai-quota-redis")
    assert secret["stringData"]["url"].startswith("redis://")


# -- Envoy Gateway ----------------------------------------------------------------------------


def test_envoy_gateway_extension_policy(base: list[Obj]) -> None:
    objs = render(BASE / "envoy-gateway")
    policy = one(objs, "EnvoyExtensionPolicy")
    assert policy["apiVersion"] == "gateway.envoyproxy.io/v1alpha1"
    (target,) = policy["spec"]["targetRefs"]
    assert (target["group"], target["kind"]) == ("gateway.networking.k8s.io", "Gateway")
    (ext,) = policy["spec"]["extProc"]
    (ref,) = ext["backendRefs"]
    svc = one(base, "Service", "ai-quota")
    grpc_port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "grpc")
    assert ref.get("kind", "Service") == "Service" and ref.get("group", "") == ""
    assert (ref["name"], ref["namespace"], ref["port"]) == (
        svc["metadata"]["name"],
        svc["metadata"]["namespace"],
        grpc_port,
    )
    mode = ext["processingMode"]
    assert mode["request"]["body"] == "Buffered"
    assert "response" in mode and "body" not in mode["response"]  # headers only; see below
    assert mode["allowModeOverride"] is True  # the processor switches SSE to full duplex
    assert ext["messageTimeout"] == "12s"  # above AIQ_REDIS_FAILOVER_WAIT_S (8 s) + margin
    assert ext["failOpen"] is False
    assert ext["metadata"]["writableNamespaces"] == ["ai_quota"]
    active = ext["backendSettings"]["healthCheck"]["active"]
    assert active["type"] == "GRPC" and active["grpc"]["service"] == EXT_PROC_HEALTH


def test_envoy_gateway_reference_grant_allows_the_policy(base: list[Obj]) -> None:
    objs = render(BASE / "envoy-gateway")
    policy = one(objs, "EnvoyExtensionPolicy")
    grant = one(objs, "ReferenceGrant")
    svc = one(base, "Service", "ai-quota")
    assert grant["metadata"]["namespace"] == svc["metadata"]["namespace"]
    assert {
        "group": "gateway.envoyproxy.io",
        "kind": "EnvoyExtensionPolicy",
        "namespace": policy["metadata"]["namespace"],
    } in grant["spec"]["from"]
    assert {"group": "", "kind": "Service", "name": "ai-quota"} in grant["spec"]["to"]
    ctp = one(objs, "ClientTrafficPolicy")
    assert ctp["spec"]["targetRefs"] == policy["spec"]["targetRefs"]
    assert ctp["spec"]["connection"]["bufferLimit"] == "1Mi"


# -- Istio ------------------------------------------------------------------------------------


def _reference_filter() -> Obj:
    """The ext_proc filter of envoy/envoy.yaml (what `ai-quota envoy-config` generates)."""
    boot = yaml.safe_load((ROOT / "envoy" / "envoy.yaml").read_text())
    hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    filters = hcm["typed_config"]["http_filters"]
    return next(f for f in filters if f["name"] == EXT_PROC_FILTER)["typed_config"]  # type: ignore[no-any-return]


def test_istio_envoy_filter_matches_envoy_yaml(base: list[Obj]) -> None:
    objs = render(BASE / "istio")
    ef = one(objs, "EnvoyFilter")
    assert ef["apiVersion"] == "networking.istio.io/v1alpha3"
    patches = {p["applyTo"]: p for p in ef["spec"]["configPatches"]}
    http = patches["HTTP_FILTER"]
    assert http["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"] == (
        "envoy.filters.http.router"
    )
    assert http["patch"]["operation"] == "INSERT_BEFORE"
    value = http["patch"]["value"]
    assert value["name"] == EXT_PROC_FILTER
    ours, reference = value["typed_config"], _reference_filter()
    for key in (
        "@type",
        "processing_mode",
        "allow_mode_override",
        "message_timeout",
        "max_message_timeout",
        "failure_mode_allow",
        "status_on_error",
        "metadata_options",
    ):
        assert ours[key] == reference[key], key
    ours_grpc, ref_grpc = ours["grpc_service"], reference["grpc_service"]
    assert ours_grpc["retry_policy"] == ref_grpc["retry_policy"]
    assert ours_grpc["timeout"] == ref_grpc["timeout"]

    svc = one(base, "Service", "ai-quota")
    fqdn = f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc.cluster.local"
    grpc_port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "grpc")
    assert ours_grpc["envoy_grpc"]["cluster_name"] == f"outbound|{grpc_port}||{fqdn}"
    cluster = patches["CLUSTER"]["match"]["cluster"]
    assert (cluster["service"], cluster["portNumber"]) == (fqdn, grpc_port)
    (hc,) = patches["CLUSTER"]["patch"]["value"]["health_checks"]
    assert hc["grpc_health_check"]["service_name"] == EXT_PROC_HEALTH
    dr = one(objs, "DestinationRule")
    assert dr["spec"]["host"] == fqdn


def test_body_limits_agree_with_the_rules(base: list[Obj]) -> None:
    cm = one(base, "ConfigMap", "ai-quota-rules")
    max_body = yaml.safe_load(cm["data"]["rules.yaml"])["requests"]["max_body_bytes"]
    istio = {
        p["applyTo"]: p for p in one(render(BASE / "istio"), "EnvoyFilter")["spec"]["configPatches"]
    }
    assert istio["LISTENER"]["patch"]["value"]["per_connection_buffer_limit_bytes"] == max_body
    ctp = one(render(BASE / "envoy-gateway"), "ClientTrafficPolicy")
    assert ctp["spec"]["connection"]["bufferLimit"] == f"{max_body // 1024 // 1024}Mi"


def test_optional_servicemonitor_scrapes_the_metrics_port(base: list[Obj]) -> None:
    sm = one(render(BASE / "monitoring"), "ServiceMonitor")
    svc = one(base, "Service", "ai-quota")
    assert selects(sm["spec"]["selector"]["matchLabels"], svc["metadata"]["labels"])
    assert [e["port"] for e in sm["spec"]["endpoints"]] == ["metrics"]
    assert "metrics" in {p["name"] for p in svc["spec"]["ports"]}


# -- the admin API overlay --------------------------------------------------------------------


@pytest.fixture(scope="module")
def admin() -> list[Obj]:
    return render(BASE / "admin")


def test_admin_overlay_is_valid_kubernetes(admin: list[Obj], no_network: None) -> None:
    assert sorted(o["kind"] for o in admin) == ["Deployment", "NetworkPolicy", "Service"]
    for obj in admin:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_admin_pods_serve_the_admin_api_safely(admin: list[Obj]) -> None:
    """The admin Deployment's own command line, read by the real ``ai-quota serve`` parser:
    off loopback with a token file and TLS (the listener checks pass), each file inside a
    read-only Secret mount."""
    from extproc.admin.auth import check_listen
    from extproc.cli import build_parser

    deploy = one(admin, "Deployment", "ai-quota-admin")
    main = containers(deploy)["ai-quota"]
    args = build_parser().parse_args(main["command"][1:] + main["args"])
    assert args.admin_port == 50052 and args.admin_host == "0.0.0.0"
    check_listen(args.admin_host, token=bool(args.admin_token_file), tls=bool(args.admin_tls_cert))
    volumes = {v["name"]: v for v in deploy["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["mountPath"]: m for m in main["volumeMounts"]}
    for path, secret in (
        (args.admin_token_file, "ai-quota-admin-token"),
        (args.admin_tls_cert, "ai-quota-admin-tls"),
        (args.admin_tls_key, "ai-quota-admin-tls"),
    ):
        mount = mounts[str(Path(path).parent)]
        assert mount["readOnly"] is True
        assert volumes[mount["name"]]["secret"]["secretName"] == secret
    assert {p["name"]: p["containerPort"] for p in main["ports"]}["admin"] == args.admin_port


def test_admin_pods_take_no_traffic_and_only_admin_clients_reach_them(
    base: list[Obj], admin: list[Obj]
) -> None:
    labels = one(admin, "Deployment")["spec"]["template"]["metadata"]["labels"]
    # neither the ext_proc Service nor its PodDisruptionBudget selects the admin pod
    assert not selects(one(base, "Service", "ai-quota")["spec"]["selector"], labels)
    assert not selects(one(base, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"], labels)
    svc = one(admin, "Service", "ai-quota-admin")
    assert selects(svc["spec"]["selector"], labels)
    assert {p["name"]: p["targetPort"] for p in svc["spec"]["ports"]}["admin"] == "admin"
    policy = one(admin, "NetworkPolicy")["spec"]
    assert selects(policy["podSelector"]["matchLabels"], labels)
    admin_rule = next(r for r in policy["ingress"] if r["ports"][0]["port"] == "admin")
    (peer,) = admin_rule["from"]
    assert peer["podSelector"]["matchLabels"] == {"ai-quota/admin-client": "true"}
    # the same rules file as the processors (admin changes are checked against its plans)
    proc_rules = containers(one(base, "Deployment", "ai-quota"))["ai-quota"]["args"]
    admin_rules = containers(one(admin, "Deployment"))["ai-quota"]["args"]
    assert [a for a in proc_rules if a.startswith("--config=")] == [
        a for a in admin_rules if a.startswith("--config=")
    ]


def test_redis_sentinel_overlay_is_valid_and_points_at_its_sentinels(no_network: None) -> None:
    """deploy/kubernetes/redis-sentinel: valid Kubernetes; the Secret's URL names the three
    sentinel pods through their headless Service and the master name they monitor."""
    from extproc.limiter.redis_url import parse_redis_url

    objs = render(BASE / "redis-sentinel")
    for obj in objs:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    target = parse_redis_url(one(objs, "Secret", "ai-quota-redis")["stringData"]["url"])
    assert target.kind == "sentinel"
    sentinels = one(objs, "StatefulSet", "ai-quota-sentinel")
    service = sentinels["spec"]["serviceName"]
    assert [h for h, _ in target.sentinels] == [
        f"ai-quota-sentinel-{i}.{service}.ai-quota.svc"
        for i in range(sentinels["spec"]["replicas"])
    ]
    conf = one(objs, "ConfigMap", "ai-quota-sentinel")["data"]["sentinel.conf"]
    assert f"sentinel monitor {target.master} ai-quota-redis-0.ai-quota-redis.ai-quota.svc" in conf
    assert conf.index("resolve-hostnames yes") < conf.index("sentinel monitor")
    redis_set = one(objs, "StatefulSet", "ai-quota-redis")
    assert redis_set["spec"]["replicas"] == 3
    assert one(objs, "Service", "ai-quota-redis")["spec"]["clusterIP"] == "None"


# -- credentials: each Envoy control plane presents one the processors accept -----------------
#
# The processors' port is closed (docs/security.md). deploy/kubernetes/make-secrets makes the
# credentials (run here against a stand-in kubectl that records what it is asked to create);
# the Istio overlay presents the bearer token (initial_metadata, filled by its kustomization's
# replacement) over TLS it originates; the Envoy Gateway overlay presents a client certificate
# over TLS, to processors switched to mutual TLS by its Component. Each check below goes through
# the processors' own code: the serve parser, the settings, the start-up checks, the token set.

MAKE_SECRETS = BASE / "make-secrets"
ISTIO = BASE / "istio"
EG = BASE / "envoy-gateway"
MTLS_COMPONENT = EG / "processors-mtls"

# A stand-in for kubectl: `create ...` prints the object it was asked for (as JSON, with the
# files' contents, read before make-secrets removes them), `apply -f -` records it.
_FAKE_KUBECTL = r"""import json, os, sys
argv = sys.argv[1:]
if argv[:1] == ["apply"]:
    with open(os.environ["FAKE_KUBECTL_LOG"], "a") as log:
        log.write(sys.stdin.read().strip() + "\n")
    sys.exit(0)
ns = argv[argv.index("-n") + 1] if "-n" in argv else "default"
rest = [a for a in argv if a not in ("-n", ns)]
assert rest[0] == "create", argv
kind, sub = ("ConfigMap", "") if rest[1] == "configmap" else ("Secret", rest[2])
name = rest[2] if kind == "ConfigMap" else rest[3]
data, stype = {}, ""
for a in rest:
    for flag, key in (("--cert=", "tls.crt"), ("--key=", "tls.key")):
        if a.startswith(flag) and sub == "tls":
            data[key] = open(a[len(flag):]).read()
    if a.startswith("--from-file="):
        key, _, path = a[len("--from-file="):].partition("=")
        data[key] = open(path).read()
    if a.startswith("--type="):
        stype = a[len("--type="):]
if sub == "tls":
    stype = "kubernetes.io/tls"
print(json.dumps({"kind": kind, "namespace": ns, "name": name, "type": stype, "data": data}))
"""


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Obj]:
    """What make-secrets creates for a gateway in namespace llm-gateway, by (namespace, name)."""
    import os
    import shutil
    import subprocess
    import sys

    if shutil.which("openssl") is None:
        pytest.skip("make-secrets needs openssl (scripts/setup installs it)")
    tmp = tmp_path_factory.mktemp("make-secrets")
    fake = tmp / "kubectl"
    fake.write_text(f"#!{sys.executable}\n{_FAKE_KUBECTL}")  # this interpreter, not PATH's
    fake.chmod(0o755)
    log = tmp / "applied.jsonl"
    env = {
        **os.environ,
        "KUBECTL": str(fake),
        "PYTHON": sys.executable,
        "FAKE_KUBECTL_LOG": str(log),
    }
    done = subprocess.run(
        [str(MAKE_SECRETS), "llm-gateway"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "deploy/kubernetes/istio/envoy-token.env" in done.stdout  # the Istio hint
    objs = [yaml.safe_load(line) for line in log.read_text().splitlines()]
    return {(o["namespace"], o["name"]): o for o in objs}


def _pem(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _sans(cert: Path) -> list[str]:
    """The DNS names in a certificate's subjectAltName (openssl's own reading)."""
    import subprocess

    out = subprocess.run(
        ["openssl", "x509", "-in", str(cert), "-noout", "-ext", "subjectAltName"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [p.strip()[4:] for p in out.split("\n", 1)[1].split(",") if p.strip().startswith("DNS:")]


def _signed_by(cert: Path, ca: Path) -> bool:
    import subprocess

    done = subprocess.run(
        ["openssl", "verify", "-CAfile", str(ca), str(cert)], capture_output=True, check=False
    )
    return done.returncode == 0


def _processor_settings(deploy: Obj) -> Any:
    """The processors' settings as `ai-quota serve` builds them from the container's command
    line and literal env (the real parser and settings)."""
    from extproc.cli import build_parser
    from extproc.commands.serve import settings_from_args

    main = containers(deploy)["ai-quota"]
    args = build_parser().parse_args(main["command"][1:] + main["args"])
    env = {e["name"]: e["value"] for e in main.get("env", []) if "value" in e}
    return settings_from_args(args, env)


def _with_component(deploy: Obj, component: Path) -> Obj:
    """``deploy`` with a Component's strategic-merge patches applied the way kustomize merges
    container env (by container name, then by variable name; later wins). Only what the
    component's patches use is supported: a test fails loudly on anything else."""
    comp = yaml.safe_load((component / "kustomization.yaml").read_text())
    assert comp["kind"] == "Component"
    out: Obj = yaml.safe_load(yaml.safe_dump(deploy))
    for entry in comp["patches"]:
        patch = yaml.safe_load((component / entry["path"]).read_text())
        assert (patch["kind"], patch["metadata"]["name"]) == (
            "Deployment",
            deploy["metadata"]["name"],
        )
        assert set(patch["spec"]) == {"template"} and set(patch["spec"]["template"]) == {"spec"}
        assert set(patch["spec"]["template"]["spec"]) == {"containers"}
        target = containers(out)
        for c in patch["spec"]["template"]["spec"]["containers"]:
            assert set(c) == {"name", "env"}, c
            merged = {e["name"]: e for e in target[c["name"]].get("env", [])}
            merged.update({e["name"]: e for e in c["env"]})
            target[c["name"]]["env"] = list(merged.values())
    return out


def _fill(obj: Obj, field_path: str, value: str, delimiter: str, index: int) -> None:
    """A kustomize replacement target (dotted path, ``[key=value]`` list selectors, the
    delimiter/index option) applied to ``obj``: the selected string's part ``index`` becomes
    ``value``."""
    parts = field_path.split(".")
    node: Any = obj
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if part.startswith("[") and part.endswith("]"):
            key, _, want = part[1:-1].partition("=")
            (node,) = [item for item in node if str(item.get(key)) == want]
            continue
        if last:
            pieces = node[part].split(delimiter)
            pieces[index] = value
            node[part] = delimiter.join(pieces)
        else:
            node = node[part]


def test_make_secrets_makes_the_credentials_the_manifests_name(
    base: list[Obj], made: dict[tuple[str, str], Obj], tmp_path: Path
) -> None:
    from extproc.devcerts import CLIENT_NAME, SERVER_NAME

    deploy = one(base, "Deployment", "ai-quota")
    volumes = {v["name"]: v for v in deploy["spec"]["template"]["spec"]["volumes"]}
    server = made[("ai-quota", volumes["grpc-tls"]["secret"]["secretName"])]
    assert server["type"] == "kubernetes.io/tls"
    assert {"tls.crt", "tls.key", "ca.crt"} <= set(server["data"])
    assert "items" not in volumes["grpc-tls"]["secret"]  # ca.crt reaches the pod too
    tokens = made[("ai-quota", volumes["grpc-token"]["secret"]["secretName"])]
    assert [i["key"] for i in volumes["grpc-token"]["secret"]["items"]] == list(tokens["data"])
    ca = _pem(tmp_path, "ca.crt", server["data"]["ca.crt"])
    server_cert = _pem(tmp_path, "server.crt", server["data"]["tls.crt"])
    assert _signed_by(server_cert, ca) and SERVER_NAME in _sans(server_cert)
    # the gateway's side: the same CA, the token in force, a client certificate of that CA
    client = made[("llm-gateway", "ai-quota-envoy-client")]
    assert client["data"]["ca.crt"] == server["data"]["ca.crt"]
    assert client["data"]["token"].strip() in tokens["data"]["tokens"].split()
    client_tls = made[("llm-gateway", "ai-quota-envoy-client-tls")]
    assert client_tls["type"] == "kubernetes.io/tls"
    client_cert = _pem(tmp_path, "client.crt", client_tls["data"]["tls.crt"])
    assert _signed_by(client_cert, ca) and _sans(client_cert) == [CLIENT_NAME]
    assert made[("ai-quota", "ai-quota-grpc-ca")]["data"]["ca.crt"] == server["data"]["ca.crt"]


def test_istio_presents_the_token_over_tls_the_processors_accept(
    base: list[Obj], made: dict[tuple[str, str], Obj], tmp_path: Path
) -> None:
    """The EnvoyFilter's grpc_service carries `authorization: Bearer <token>` (a placeholder
    the kustomization replaces from envoy-token.env); filled with make-secrets' token it passes
    the processors' own token check. The DestinationRule originates TLS (SNI and SAN ai-quota,
    the CA from the gateway's client Secret) to the unchanged base processors (TLS + tokens)."""
    from extproc.access import bearer
    from extproc.caller_tokens import TokenSet
    from extproc.commands.serve import check_security
    from extproc.devcerts import SERVER_NAME

    objs = render(ISTIO)
    ef = one(objs, "EnvoyFilter", "ai-quota-ext-proc")
    http = next(p for p in ef["spec"]["configPatches"] if p["applyTo"] == "HTTP_FILTER")
    (meta,) = http["patch"]["value"]["typed_config"]["grpc_service"]["initial_metadata"]
    assert meta["key"] == "authorization"
    scheme, placeholder = meta["value"].split(" ")
    assert scheme == "Bearer"

    kust = yaml.safe_load((ISTIO / "kustomization.yaml").read_text())
    (gen,) = kust["configMapGenerator"]
    assert gen["options"]["annotations"] == {"config.kubernetes.io/local-config": "true"}
    (env_file,) = gen["envs"]
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert str((ISTIO / env_file).relative_to(ROOT)) in ignored  # the token is never committed
    (rep,) = kust["replacements"]
    assert (rep["source"]["kind"], rep["source"]["name"]) == ("ConfigMap", gen["name"])
    assert rep["source"]["fieldPath"] == "data.token"
    (target,) = rep["targets"]
    assert (target["select"]["kind"], target["select"]["name"]) == (
        "EnvoyFilter",
        "ai-quota-ext-proc",
    )
    (field_path,) = target["fieldPaths"]
    opts = target["options"]
    assert (opts["delimiter"], opts["index"]) == (" ", 1)

    token = made[("llm-gateway", "ai-quota-envoy-client")]["data"]["token"].strip()
    filled = yaml.safe_load(yaml.safe_dump(ef))
    _fill(filled, field_path, token, opts["delimiter"], opts["index"])
    http = next(p for p in filled["spec"]["configPatches"] if p["applyTo"] == "HTTP_FILTER")
    (meta,) = http["patch"]["value"]["typed_config"]["grpc_service"]["initial_metadata"]
    assert meta["value"] == f"Bearer {token}" != f"Bearer {placeholder}"

    # the base processors, as they start: TLS and the token file, no client CA
    settings = _processor_settings(one(base, "Deployment", "ai-quota"))
    check_security(settings)
    assert settings.grpc_tls_cert and not settings.grpc_tls_client_ca
    tokens_file = _pem(
        tmp_path, "tokens", made[("ai-quota", "ai-quota-grpc-token")]["data"]["tokens"]
    )
    accepted = TokenSet(str(tokens_file))
    assert accepted.matches(bearer([(meta["key"], meta["value"])]))
    assert not accepted.matches(bearer([("authorization", f"Bearer {placeholder}")]))

    dr = one(objs, "DestinationRule", "ai-quota")
    tls = dr["spec"]["trafficPolicy"]["tls"]
    assert tls["mode"] == "SIMPLE"  # the processors terminate TLS themselves
    assert tls["sni"] == SERVER_NAME and tls["subjectAltNames"] == [SERVER_NAME]
    # the CA comes from the client Secret make-secrets puts in the gateway's namespace
    client = made[("llm-gateway", tls["credentialName"])]
    assert "ca.crt" in client["data"]
    assert dr["spec"]["exportTo"] == ["."]  # the gateway's namespace only (credentialName)
    assert dr["metadata"]["namespace"] == ef["metadata"]["namespace"]


def test_envoy_gateway_presents_a_client_certificate_the_processors_accept(
    base: list[Obj], made: dict[tuple[str, str], Obj], tmp_path: Path
) -> None:
    """BackendTLSPolicy: TLS to the ai-quota Service checked against make-secrets' CA with
    hostname ai-quota; EnvoyProxy: the client certificate; the Component puts the processors on
    mutual TLS with the client CA from their TLS Secret and Envoy's SAN allowed."""
    from extproc.commands.serve import check_security
    from extproc.devcerts import CLIENT_NAME, SERVER_NAME

    objs = render(EG)
    svc = one(base, "Service", "ai-quota")
    btp = one(objs, "BackendTLSPolicy", "ai-quota")
    assert btp["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert btp["metadata"]["namespace"] == svc["metadata"]["namespace"]
    (target,) = btp["spec"]["targetRefs"]
    assert (target["group"], target["kind"], target["name"]) == ("", "Service", "ai-quota")
    validation = btp["spec"]["validation"]
    assert validation["hostname"] == SERVER_NAME
    (ca_ref,) = validation["caCertificateRefs"]
    assert (ca_ref["group"], ca_ref["kind"]) == ("", "ConfigMap")
    assert "ca.crt" in made[(btp["metadata"]["namespace"], ca_ref["name"])]["data"]

    policy = one(objs, "EnvoyExtensionPolicy", "ai-quota")
    proxy = one(objs, "EnvoyProxy", "ai-quota-client")
    assert proxy["metadata"]["namespace"] == policy["metadata"]["namespace"]  # the Gateway's
    ref = proxy["spec"]["backendTLS"]["clientCertificateRef"]
    assert (ref["group"], ref["kind"]) == ("", "Secret")
    client_tls = made[(ref["namespace"], ref["name"])]
    assert client_tls["type"] == "kubernetes.io/tls"
    # the NetworkPolicy's peer label on Envoy Gateway's proxy pods
    labels = proxy["spec"]["provider"]["kubernetes"]["envoyDeployment"]["pod"]["labels"]
    netpol = one(base, "NetworkPolicy", "ai-quota")["spec"]
    grpc_rule = next(r for r in netpol["ingress"] if r["ports"][0]["port"] == "grpc")
    assert selects(grpc_rule["from"][0]["podSelector"]["matchLabels"], labels)

    # the processors with the Component: mutual TLS, Envoy's certificate allowed
    deploy = _with_component(one(base, "Deployment", "ai-quota"), MTLS_COMPONENT)
    settings = _processor_settings(deploy)
    check_security(settings)
    assert settings.grpc_tls_cert and settings.grpc_tls_client_ca
    main = containers(deploy)["ai-quota"]
    mount = next(m for m in main["volumeMounts"] if m["mountPath"] == "/var/run/ai-quota/grpc-tls")
    assert Path(settings.grpc_tls_client_ca).parent == Path(mount["mountPath"])
    volume = next(
        v for v in deploy["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]
    )
    server = made[("ai-quota", volume["secret"]["secretName"])]
    client_ca = _pem(
        tmp_path, "client-ca.crt", server["data"][Path(settings.grpc_tls_client_ca).name]
    )
    client_cert = _pem(tmp_path, "client.crt", client_tls["data"]["tls.crt"])
    assert _signed_by(client_cert, client_ca)
    assert set(_sans(client_cert)) & set(settings.allowed_sans) == {CLIENT_NAME}


def test_no_overlay_leaves_the_port_open(base: list[Obj]) -> None:
    """No manifest under deploy/kubernetes runs the processors --insecure or with tokens in
    plaintext, and no overlay's Envoy reaches them without TLS."""
    from extproc.commands.serve import check_security

    for deploy in (
        one(base, "Deployment", "ai-quota"),
        _with_component(one(base, "Deployment", "ai-quota"), MTLS_COMPONENT),
    ):
        settings = _processor_settings(deploy)
        check_security(settings)
        assert not settings.insecure and not settings.grpc_allow_plaintext
        assert settings.grpc_tls_cert and (settings.grpc_token_file or settings.grpc_tls_client_ca)
    opening = ("--insecure", "AIQ_INSECURE", "--grpc-allow-plaintext", "AIQ_GRPC_ALLOW_PLAINTEXT")
    for path in sorted(BASE.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            text = yaml.safe_dump(doc)
            assert not any(word in text for word in opening), path
    dr = one(render(ISTIO), "DestinationRule")
    assert dr["spec"]["trafficPolicy"]["tls"]["mode"] in ("SIMPLE", "MUTUAL")
    assert "portLevelSettings" not in dr["spec"]["trafficPolicy"]  # no port without TLS
    eg = render(EG)
    assert one(eg, "BackendTLSPolicy")["spec"]["targetRefs"][0]["name"] == "ai-quota"
    assert "sectionName" not in one(eg, "BackendTLSPolicy")["spec"]["targetRefs"][0]  # every port


def test_the_envoy_gateway_component_is_offered_in_the_base() -> None:
    """The base's kustomization names the Component (commented: opt-in for Envoy Gateway)."""
    text = (BASE / "kustomization.yaml").read_text()
    rel = str(MTLS_COMPONENT.relative_to(BASE))
    assert f"#   - {rel}" in text and "# components:" in text


@pytest.mark.skipif(
    __import__("shutil").which("kubectl") is None, reason="kubectl (with kustomize) not installed"
)
def test_kustomize_builds_the_overlays_with_credentials(tmp_path: Path, no_network: None) -> None:
    """Where kubectl is installed, its kustomize agrees with the readings above: the Istio
    overlay fills the token and drops the local ConfigMap; the base with the Component runs the
    processors on mutual TLS; the core objects stay valid."""
    import shutil
    import subprocess

    def build(directory: Path) -> list[Obj]:
        done = subprocess.run(
            ["kubectl", "kustomize", str(directory)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        return [d for d in yaml.safe_load_all(done.stdout) if d is not None]

    copy = tmp_path / "kubernetes"
    shutil.copytree(BASE, copy)
    (copy / "istio" / "envoy-token.env").write_text("token=tok-123_abc\n")
    istio = build(copy / "istio")
    assert sorted(o["kind"] for o in istio) == ["DestinationRule", "EnvoyFilter"]
    http = next(
        p
        for p in one(istio, "EnvoyFilter")["spec"]["configPatches"]
        if p["applyTo"] == "HTTP_FILTER"
    )
    (meta,) = http["patch"]["value"]["typed_config"]["grpc_service"]["initial_metadata"]
    assert meta == {"key": "authorization", "value": "Bearer tok-123_abc"}
    (copy / "istio" / "envoy-token.env").unlink()
    done = subprocess.run(
        ["kubectl", "kustomize", str(copy / "istio")], capture_output=True, text=True, check=False
    )
    assert done.returncode != 0  # no token file: nothing to apply with the placeholder

    kust = copy / "kustomization.yaml"
    kust.write_text(
        kust.read_text()
        .replace("# components:", "components:")
        .replace("#   - envoy-gateway/processors-mtls", "  - envoy-gateway/processors-mtls")
    )
    objs = build(copy)
    deploy = one(objs, "Deployment", "ai-quota")
    assert _processor_settings(deploy).grpc_tls_client_ca
    for obj in objs:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    assert {o["kind"] for o in build(copy / "envoy-gateway")} >= {"BackendTLSPolicy", "EnvoyProxy"}
