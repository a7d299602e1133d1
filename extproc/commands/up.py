"""``ai-quota up`` (what ``scripts/run`` calls): Redis, the simulator, the ext_proc service and
Envoy on loopback in the foreground; the terminal shows the addresses, then the decisions."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from extproc.commands import DEMO_CONFIG, DEMO_RLS_CONFIG
from extproc.commands.log_tail import LogFollower, format_log_line

if TYPE_CHECKING:
    from extproc.stack import Stack


def configure_parser(u: argparse.ArgumentParser) -> None:
    """Flags of ``ai-quota up``: the ports, the rules file, an existing Redis, the workdir."""
    from extproc.stack import DEFAULT_WORKDIR

    u.add_argument("--config", default=DEMO_CONFIG, help="rules file (default %(default)s)")
    u.add_argument("--port", type=int, default=10000, help="Envoy listener (default %(default)s)")
    u.add_argument("--admin-port", type=int, default=9901, help="Envoy admin (default %(default)s)")
    u.add_argument("--sim-port", type=int, default=18080, help="simulator (default %(default)s)")
    u.add_argument(
        "--extproc-port", type=int, default=50051, help="ext_proc gRPC (default %(default)s)"
    )
    u.add_argument(
        "--redis-port", type=int, default=6379, help="Redis to start (default %(default)s)"
    )
    u.add_argument("--redis-url", help="use this Redis instead of starting one")
    u.add_argument(
        "--security",
        choices=["token", "mtls", "insecure"],
        default="token",
        help="how Envoy reaches the processors' gRPC port: TLS + a bearer token (default), "
        "mutual TLS, or plaintext without credentials (docs/security.md)",
    )
    u.add_argument(
        "--rls-config",
        default=DEMO_RLS_CONFIG,
        help="envoyproxy/ratelimit config the RLS API serves (default %(default)s; '' for none)",
    )
    u.add_argument(
        "--metrics-port", type=int, help="serve the processor's Prometheus metrics on this port"
    )
    u.add_argument(
        "--workdir", default=DEFAULT_WORKDIR, help="logs and generated files (default %(default)s)"
    )


def run(args: argparse.Namespace) -> int:
    """Run Redis, the simulator, the ext_proc service and Envoy in the foreground.

    The terminal shows the banner with the URLs, then one line per decision (and any warning);
    each process's own output (the Redis banner, Envoy's access log, ...) goes to
    ``<workdir>/<name>.log``, and the stack's addresses to ``<workdir>/stack.json``.
    """
    from extproc.stack import StackError

    workdir = Path(args.workdir).resolve()
    stack = _stack(args, workdir)
    stop = {"flag": False}

    def on_signal(_s: int, _f: object) -> None:
        stop["flag"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    workdir.mkdir(parents=True, exist_ok=True)
    followers = [LogFollower(workdir / "extproc0.log")]
    print("starting Redis, the simulator, ext_proc and Envoy ...", flush=True)
    try:
        stack.start()
    except StackError as exc:
        print(f"ai-quota up: {exc}", file=sys.stderr)
        return 1
    print(banner(stack, args, workdir), flush=True)
    try:
        while not stop["flag"]:
            _show_decisions(followers)
            if _a_process_exited(stack):
                stop["flag"] = True
            time.sleep(0.2)
    finally:
        print("stopping...", file=sys.stderr, flush=True)
        stack.stop()
    return 0


def _stack(args: argparse.Namespace, workdir: Path) -> Stack:
    """The stack the flags describe (not started); processes log JSON to their files."""
    from extproc.stack import Stack, StackPorts

    return Stack(
        config=args.config,
        workdir=workdir,
        ports=StackPorts(
            envoy=args.port,
            envoy_admin=args.admin_port,
            sim=args.sim_port,
            extproc=args.extproc_port,
            redis=args.redis_port,
        ),
        redis_url=args.redis_url,
        log_format="json",
        inherit_output=False,
        metrics_port=args.metrics_port or 0,
        security=args.security,
        extproc_env={"AIQ_RLS_CONFIG": str(Path(args.rls_config).resolve())}
        if args.rls_config
        else {},
    )


def _show_decisions(followers: list[LogFollower]) -> None:
    for f in followers:
        for line in f.new_lines():
            shown = format_log_line(line)
            if shown:
                print(shown, flush=True)


def _a_process_exited(stack: Stack) -> bool:
    """Whether a process of the stack exited (each one is reported on stderr)."""
    exited = False
    for p in stack.procs:
        if p.popen.poll() is not None:
            print(
                f"ai-quota up: {p.name} exited with status {p.popen.returncode}; "
                f"stopping (its log: {p.log_path})",
                file=sys.stderr,
            )
            exited = True
    return exited


def _door(stack: Stack) -> str:
    c = stack.credentials
    if c is None:
        return "plaintext, no credential (--insecure)"
    how = "Envoy's client certificate" if stack.security == "mtls" else "Envoy's bearer token"
    return f"TLS + {how}; CA, certificates and tokens in {c.dir} (docs/security.md)"


def banner(stack: Stack, args: argparse.Namespace, workdir: Path) -> str:
    """What the terminal shows once the stack is up: the addresses and how to try it."""
    base = stack.base_url
    metrics = f"http://127.0.0.1:{stack.metrics_port}/metrics" if stack.metrics_port else "off"
    rls = (
        f"127.0.0.1:{args.extproc_port}   envoyproxy/ratelimit config: {args.rls_config}"
        if args.rls_config
        else "not served (no --rls-config)"
    )
    return f"""
ai-quota is up.
  Envoy (OpenAI API) : {base}
  Envoy admin        : http://127.0.0.1:{args.admin_port}
  ext_proc (gRPC)    : 127.0.0.1:{args.extproc_port}   rules: {args.config}
  RLS v3 (same port) : {rls}
  simulator          : {stack.sim_url}   (ground truth: {stack.sim_url}/sim/requests)
  redis              : {stack.effective_redis_url}   (AOF in {workdir})
  metrics            : {metrics}
  logs               : {workdir}/*.log (Envoy's access log: envoy0.log)
  addresses          : {stack.state_file}
  gRPC port's door   : {_door(stack)}

Try it (demo keys: sk-demo-standard, sk-demo-tight = 5 RPM / 2,000 TPM, sk-demo-strict,
sk-demo-budget = $0.02 a month, 2 at once):
  curl -s {base}/chat/completions -H 'Authorization: Bearer sk-demo-tight' \\
    -H 'content-type: application/json' \\
    -d '{{"model":"sim-small","messages":[{{"role":"user","content":"hi"}}],"max_tokens":20}}' -i
  python -c "import openai; c=openai.OpenAI(base_url='{base}', api_key='sk-demo-tight'); \\
[print(x.choices[0].delta.content or '', end='', flush=True) for x in c.chat.completions.create(\\
model='sim-small', messages=[{{'role':'user','content':'hi'}}], max_tokens=1000, stream=True) if x.choices]"
  ai-quota usage --key sk-demo-tight --address 127.0.0.1:{args.extproc_port}

Ctrl-C stops everything. Decisions:
"""
