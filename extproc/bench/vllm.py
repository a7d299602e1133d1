"""A real model server for tests and benchmarks: vLLM's CPU build serving the tiny local model
(:mod:`extproc.bench.engine_model`), pinned to its own core, and readers of its ``/metrics``.

vLLM is installed in ``.venv-engine`` (``scripts/setup --engine``), apart from the project's
venv. Its CPU engine busy-polls a core; sharing cores with the gateway starves the processor
(docs/operations.md), so :class:`Engine` runs it under ``taskset`` on one core and
:func:`pin_self` moves the caller (and so every process it starts afterwards: Envoy, the
processor, Redis) to the others.

The ground truth is the engine's own Prometheus counters: ``vllm:prompt_tokens_total`` (tokens
prefilled), ``vllm:generation_tokens_total`` (tokens generated, delivered or not),
``vllm:num_requests_running``/``waiting`` and ``vllm:request_success_total`` by finish reason.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis
import yaml
from prometheus_client.parser import text_string_to_metric_families

from extproc.bench.engine_model import ensure_model
from extproc.stack import Stack, StackPorts, free_port

REPO = Path(__file__).resolve().parents[2]
ENGINE_VENV = REPO / ".venv-engine"
SERVED_NAME = "tiny"
#: The same model under a second served name, metered on the exact path for non-streams
#: (``non_streams: exact``) in :func:`engine_rules`.
EXACT_NAME = "tiny-exact"
#: Once more, on the exact path asking the engine for :data:`EXACT_INTERVAL` tokens per chunk
#: (``exact_stream_interval``).
EXACT16_NAME = "tiny-exact16"
EXACT_INTERVAL = 16


class EngineError(RuntimeError):
    """The engine is not installed or did not start; the message says why."""


def engine_python(venv: Path = ENGINE_VENV) -> Path | None:
    """The Python of ``.venv-engine`` if vLLM is installed there, else ``None``."""
    py = venv / "bin" / "python"
    if py.exists() and (venv / ".aiq-engine-installed").exists():
        return py
    return None


def cpus() -> list[int]:
    """The CPUs this process may run on, sorted."""
    return sorted(os.sched_getaffinity(0))


def split_cpus() -> tuple[set[int], set[int]]:
    """(engine CPUs, gateway CPUs): the first CPU for the engine, the rest for the gateway
    (on a single CPU both get it, and the tests say so in their measurements)."""
    mine = cpus()
    if len(mine) < 2:
        return set(mine), set(mine)
    return {mine[0]}, set(mine[1:])


def pin_self(cpuset: set[int]) -> set[int]:
    """Pin every thread of this process to ``cpuset``; returns the previous affinity.
    Processes started afterwards inherit it."""
    before = set(os.sched_getaffinity(0))
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(tid), cpuset)
    return before


@dataclass(frozen=True)
class EngineMetrics:
    """One scrape of the engine's ``/metrics`` (summed over label sets)."""

    prompt_tokens: int
    generation_tokens: int
    running: int
    waiting: int
    finished: dict[str, int] = field(default_factory=dict)  # finished_reason -> requests

    @property
    def tokens(self) -> int:
        """Prompt + generation tokens: what a per-token bill of this engine would add up to."""
        return self.prompt_tokens + self.generation_tokens

    def __sub__(self, other: EngineMetrics) -> EngineMetrics:
        reasons = set(self.finished) | set(other.finished)
        return EngineMetrics(
            prompt_tokens=self.prompt_tokens - other.prompt_tokens,
            generation_tokens=self.generation_tokens - other.generation_tokens,
            running=self.running,
            waiting=self.waiting,
            finished={
                r: self.finished.get(r, 0) - other.finished.get(r, 0)
                for r in sorted(reasons)
                if self.finished.get(r, 0) != other.finished.get(r, 0)
            },
        )


def parse_metrics(text: str) -> EngineMetrics:
    """The figures :class:`EngineMetrics` keeps, from vLLM's Prometheus text."""
    sums: dict[str, float] = {}
    finished: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
            if sample.name == "vllm:request_success_total":
                reason = sample.labels.get("finished_reason", "")
                finished[reason] = finished.get(reason, 0) + int(sample.value)
    need = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")
    missing = [n for n in need if n not in sums]
    if missing:
        raise EngineError(f"engine /metrics lacks {', '.join(missing)}")
    return EngineMetrics(
        prompt_tokens=int(sums["vllm:prompt_tokens_total"]),
        generation_tokens=int(sums["vllm:generation_tokens_total"]),
        running=int(sums.get("vllm:num_requests_running", 0)),
        waiting=int(sums.get("vllm:num_requests_waiting", 0)),
        finished={k: v for k, v in finished.items() if v},
    )


def scrape(url: str, timeout: float = 5.0) -> EngineMetrics:
    """Read ``url`` (the engine's ``/metrics``)."""
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - loopback URL
        return parse_metrics(r.read().decode())


def wait_metrics(
    url: str, until: Callable[[EngineMetrics], bool], timeout: float = 30.0
) -> EngineMetrics:
    """Scrape until ``until`` holds; the scrape that satisfied it (or raise after ``timeout``)."""
    deadline = time.monotonic() + timeout
    last: EngineMetrics | None = None
    while True:
        last = scrape(url)
        if until(last):
            return last
        if time.monotonic() > deadline:
            raise EngineError(f"engine metrics did not settle within {timeout:.0f}s: {last}")
        time.sleep(0.02)


def wait_idle(url: str, timeout: float = 30.0) -> EngineMetrics:
    """Scrape until no request runs or waits and two scrapes agree (the counters are final)."""
    deadline = time.monotonic() + timeout
    prev: EngineMetrics | None = None
    while True:
        cur = scrape(url)
        if cur.running == 0 and cur.waiting == 0 and cur == prev:
            return cur
        if time.monotonic() > deadline:
            raise EngineError(f"engine did not go idle within {timeout:.0f}s: {cur}")
        prev = cur
        time.sleep(0.05)


@dataclass
class Engine:
    """``vllm serve`` (the OpenAI-compatible API server) on the tiny model, pinned to ``cpuset``."""

    workdir: Path
    cpuset: set[int]
    python: Path | None = None
    port: int = 0
    max_num_seqs: int = 16
    extra_args: list[str] = field(default_factory=list)
    popen: subprocess.Popen[bytes] | None = None
    model: Path | None = None
    started_s: float = 0.0  # seconds from spawn to a healthy /health

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        """The engine's Prometheus endpoint."""
        return f"{self.url}/metrics"

    @property
    def log_path(self) -> Path:
        """Where the engine's output goes."""
        return self.workdir / "vllm.log"

    def metrics(self) -> EngineMetrics:
        """One scrape of the engine's counters."""
        return scrape(self.metrics_url)

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the engine's log."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def start(self, timeout: float = 420.0) -> None:
        """Build (or reuse) the model, start the server and wait for ``/health``."""
        py = self.python or engine_python()
        if py is None:
            raise EngineError("vLLM is not installed: run scripts/setup --engine")
        self.python = py
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.model = ensure_model(py, REPO)
        self.port = self.port or free_port()
        taskset = shutil.which("taskset")
        cpulist = ",".join(str(c) for c in sorted(self.cpuset))
        argv = [
            *([taskset, "-c", cpulist] if taskset else []),
            str(py),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model),
            "--served-model-name",
            SERVED_NAME,
            EXACT_NAME,
            EXACT16_NAME,
            "--dtype",
            "float32",
            "--max-model-len",
            "4096",
            "--enforce-eager",
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--seed",
            "0",
            *self.extra_args,
        ]
        env = dict(os.environ)
        env.update(
            {
                "VLLM_CPU_OMP_THREADS_BIND": cpulist,
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "TOKENIZERS_PARALLELISM": "false",
            }
        )
        t0 = time.monotonic()
        # the child writes to its own copy of the log's descriptor: ours is closed at once
        with self.log_path.open("ab") as out:
            self.popen = subprocess.Popen(  # noqa: S603 - our own venv's Python
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=str(self.workdir),
                start_new_session=True,
            )
        deadline = t0 + timeout
        while True:
            if self.popen.poll() is not None:
                raise EngineError(
                    f"vLLM exited with status {self.popen.returncode}\n{self.log_tail()}"
                )
            if _healthy(f"{self.url}/health"):
                break
            if time.monotonic() > deadline:
                self.stop()
                raise EngineError(f"vLLM not healthy within {timeout:.0f}s\n{self.log_tail()}")
            time.sleep(0.25)
        self.started_s = time.monotonic() - t0

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the server's process group, then SIGKILL what is left."""
        p = self.popen
        if p is None:
            return
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
        # the engine core runs in a child process of the same group
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
        self.popen = None


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:  # noqa: S310 - loopback URL
            return bool(r.status == 200)
    except OSError:
        return False


#: charge_every_tokens in :func:`engine_rules`.
EVERY = 16
#: Tokens an engine may generate past the last one delivered before a cut stops it: the
#: processor meters every EVERY tokens, and the engine keeps decoding until Envoy's reset
#: reaches it (measured 1-15 per stream on a pinned 2-core machine).
RUN_AHEAD_BOUND = 2 * EVERY + 16

#: Tenant (``e-<name>``, key ``sk-<name>``) -> plan, for the engine tests and bench.
ENGINE_TENANTS = {
    "chat": "big",
    "chatstream": "big",
    "completions": "big",
    "completionsstream": "big",
    "responses": "big",
    "responsesstream": "big",
    "messages": "big",
    "messagesstream": "big",
    "words": "big",
    "ascii": "big",
    "cjk": "big",
    "bytes": "big",
    "cutlazy": "lazy300",
    "cutstrict": "strict300",
    "conclazy": "lazy1500",
    "concstrict": "strict1500",
    "lagging": "lazy100",
    "abandoned": "big",
    "abandonedexact": "big",
    "abandonedexact16": "big",
    # the non-streams on the exact path
    "chatexact": "big",
    "completionsexact": "big",
    "responsesexact": "big",
    "messagesexact": "big",
    "chatexact16": "big",
    "completionsexact16": "big",
}


def engine_rules(tokenizer_json: Path, tenants: dict[str, str] | None = None) -> dict[str, object]:
    """Rules with one model (the engine's, metered with its own tokenizer.json), daily windows
    and a tenant ``e-<name>`` with key ``sk-<name>`` per scenario."""

    def plan(tpm: int, streaming: str = "lazy") -> dict[str, object]:
        return {
            "limits": [{"model": "*", "per": "day", "rpm": 100_000, "tpm": tpm}],
            "charging": {"streaming": streaming},
        }

    return {
        "version": 1,
        "charging": {
            "mode": "stream_incremental",
            "streaming": "lazy",
            "charge_every_tokens": EVERY,
        },
        "models": {
            # the default configuration (non-streams on the JSON path)
            SERVED_NAME: {
                "tokenizer": {"kind": "huggingface", "path": str(tokenizer_json)},
                "max_output_tokens": 2048,
                # vLLM reports its running usage in every chunk when asked
                "stream_usage": "continuous",
            },
            # the same engine, its non-streams on the exact path
            EXACT_NAME: {
                "tokenizer": {"kind": "huggingface", "path": str(tokenizer_json)},
                "max_output_tokens": 2048,
                "stream_usage": "continuous",
                "non_streams": "exact",
            },
            # and with the engine sending EXACT_INTERVAL tokens per chunk
            EXACT16_NAME: {
                "tokenizer": {"kind": "huggingface", "path": str(tokenizer_json)},
                "max_output_tokens": 2048,
                "stream_usage": "continuous",
                "non_streams": "exact",
                "exact_stream_interval": EXACT_INTERVAL,
            },
        },
        "plans": {
            "big": plan(10_000_000),
            "lazy100": plan(100),
            "lazy300": plan(300),
            "strict300": plan(300, "strict"),
            "lazy1500": plan(1500),
            "strict1500": plan(1500, "strict"),
        },
        "tenants": {
            f"e-{name}": {"plan": p, "keys": [{"name": name, "plaintext": f"sk-{name}"}]}
            for name, p in (tenants or ENGINE_TENANTS).items()
        },
    }


def start_gateway(workdir: Path, engine: Engine, rules: dict[str, object] | None = None) -> Stack:
    """Redis, one processor and one Envoy routing to ``engine`` (on the CPUs of the caller,
    which they inherit: call :func:`pin_self` first)."""
    if engine.model is None:
        raise EngineError("start the engine first")
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "rules.yaml"
    config.write_text(
        yaml.safe_dump(rules or engine_rules(engine.model / "tokenizer.json"), sort_keys=False)
    )
    stack = Stack(
        config=str(config),
        workdir=workdir,
        ports=StackPorts(
            envoy=free_port(),
            envoy_admin=free_port(),
            sim=free_port(),
            extproc=free_port(),
            redis=free_port(),
        ),
        sim_args=["--log-level", "warning"],
        upstream=("127.0.0.1", engine.port),
    )
    stack.start()
    return stack


def tokens_billed(rds: redis.Redis, tenant: str) -> int:
    """Sum of the tenant-wide TPM counters in their current windows."""
    return sum(int(rds.get(k) or 0) for k in rds.scan_iter(f"aiq:{{{tenant}}}:tpm:t:*"))


def wait_settled(rds: redis.Redis, tenant: str, timeout: float = 15.0) -> int:
    """The tenant's TPM once every request of it that was admitted has been settled."""
    deadline = time.monotonic() + timeout
    while True:
        states = [rds.hget(k, "state") for k in rds.scan_iter(f"aiq:{{{tenant}}}:req:*")]
        done = sum(1 for s in states if s in (b"settled", "settled", b"reclaimed", "reclaimed"))
        if states and done == len(states):
            return tokens_billed(rds, tenant)
        if time.monotonic() > deadline:
            raise EngineError(f"{tenant}: settlements not applied: {states}")
        time.sleep(0.02)
