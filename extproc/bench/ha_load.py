"""A bounded mixed load on the real limiter for the Redis failover drills, with its own ground
truth.

``workers`` clients send requests for one busy tenant (one hash tag): 70 % streams (an
admission, five lazy charges of 10 tokens 20 ms apart, a settlement) and 30 % plain requests
(an admission, a settlement).  Each call that fails is sent again, the same call (every call is
idempotent by its ledger and sequence number), until it is acknowledged or the load's deadline
passes; so every call issued is meant to land exactly once, and the tenant's counter on the
master at the end must equal the sum of what was issued.  Lost tokens: truth - counter when
positive; doubled: counter - truth when positive.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from extproc.core.rules import Adjustment, BucketCharge
from extproc.errors import LimiterUnavailable
from extproc.limiter.base import AdmitCall
from extproc.limiter.redis import RedisLimiter

TTL = 120_000


@dataclass
class Report:
    """What a drill measured."""

    truth: int = 0  # tokens issued (each call meant to land once)
    counter: int = 0  # the tenant's counter on the master at the end
    requests: int = 0
    calls_ok: int = 0
    calls_failed: int = 0
    unfinished: int = 0  # calls still unacknowledged at the deadline
    fault_at: float = 0.0
    promoted_at: float = 0.0
    first_failure_after_fault: float = 0.0  # monotonic
    first_success_after_fault: float | None = None  # seconds from the fault to the first
    # success of a call started after the first failure the fault caused (None: none failed)
    failed_after_promotion: int = 0  # call attempts started > 2 s after the promotion that failed
    errors: Counter[str] = field(default_factory=Counter)

    @property
    def lost(self) -> int:
        return max(0, self.truth - self.counter)

    @property
    def doubled(self) -> int:
        return max(0, self.counter - self.truth)

    def summary(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "calls_ok": self.calls_ok,
            "calls_failed": self.calls_failed,
            "unfinished": self.unfinished,
            "truth_tokens": self.truth,
            "counter_tokens": self.counter,
            "lost": self.lost,
            "doubled": self.doubled,
            "fault_to_promotion_s": round(self.promoted_at - self.fault_at, 2)
            if self.promoted_at
            else None,
            "fault_to_first_success_s": None
            if self.first_success_after_fault is None
            else round(self.first_success_after_fault, 2),
            "failed_after_promotion_2s": self.failed_after_promotion,
            "errors": dict(self.errors),
        }


def _kind(exc: BaseException) -> str:
    """A short name for what made a call fail (NOSCRIPT / READONLY / breaker / ...)."""
    text = ""
    seen: BaseException | None = exc
    while seen is not None:
        text += f" {type(seen).__name__}: {seen}"
        seen = seen.__cause__
    for mark in ("NOSCRIPT", "READONLY", "MOVED", "CLUSTERDOWN", "TRYAGAIN", "NOREPLICAS"):
        if mark in text:
            return mark
    if "NoScriptError" in text or "losing the script" in text:
        return "NOSCRIPT"
    if "unavailable; retry shortly" in text:
        return "breaker"
    if "Timeout" in text:
        return "timeout"
    if "MasterNotFound" in text:
        return "master_not_found"
    if "Connection" in text or "connect" in text:
        return "connection"
    return "other"


class Load:
    """The load and its ledger (see the module)."""

    def __init__(self, lim: RedisLimiter, tenant: str, *, workers: int = 12, seed: int = 7) -> None:
        self.lim = lim
        self.tag = f"drill:{{{tenant}}}"
        self.key = f"{self.tag}:tpm"
        self.workers = workers
        self.rng = random.Random(seed)
        self.report = Report()
        self._stop = asyncio.Event()
        self._deadline = 0.0

    def _bucket(self, amount: int) -> list[BucketCharge]:
        far = int(time.time() * 1000) + 600_000
        return [BucketCharge(self.key, "tpm", amount, 10**12, far)]

    async def _until_ok(self, call: Any) -> bool:
        """Send ``call()`` until acknowledged (or the deadline); whether it was."""
        r = self.report
        while True:
            started = time.monotonic()
            try:
                await call()
            except LimiterUnavailable as exc:
                r.calls_failed += 1
                r.errors[_kind(exc)] += 1
                if r.fault_at and not r.first_failure_after_fault and started >= r.fault_at:
                    r.first_failure_after_fault = started
                if r.promoted_at and started > r.promoted_at + 2.0:
                    r.failed_after_promotion += 1
                if time.monotonic() > self._deadline:
                    r.unfinished += 1
                    return False
                await asyncio.sleep(0.05)
                continue
            r.calls_ok += 1
            if (
                r.first_failure_after_fault
                and r.first_success_after_fault is None
                and started > r.first_failure_after_fault
            ):
                r.first_success_after_fault = time.monotonic() - r.fault_at
            return True

    async def _request(self) -> None:
        r = self.report
        led = f"{self.tag}:req:{uuid.uuid4().hex[:12]}"
        stream = self.rng.random() < 0.7
        r.requests += 1
        reserve = 20 if stream else 50
        r.truth += reserve
        ok = await self._until_ok(
            lambda: self.lim.admit(
                AdmitCall(
                    led,
                    self._bucket(reserve),
                    tpm_charged=reserve,
                    count_refused=False,
                    ledger_ttl_ms=TTL,
                )
            )
        )
        if not ok:
            return
        if stream:
            for seq in range(1, 6):
                await asyncio.sleep(0.02)
                r.truth += 10
                if not await self._until_ok(
                    lambda seq=seq: self.lim.charge(
                        led, seq, self._bucket(0), 10, strict=False, ledger_ttl_ms=TTL
                    )
                ):
                    return
        adjust = -5 if stream else 7
        r.truth += adjust
        far = int(time.time() * 1000) + 600_000
        await self._until_ok(
            lambda: self.lim.settle(led, [Adjustment(self.key, adjust, far)], ledger_ttl_ms=TTL)
        )

    async def _worker(self) -> None:
        while not self._stop.is_set():
            await self._request()
            await asyncio.sleep(0.005)

    def start(self, deadline_s: float) -> asyncio.Future[Any]:
        """Start the workers; they stop issuing when :meth:`stop` is called and give up on
        unacknowledged calls ``deadline_s`` from now."""
        self._deadline = time.monotonic() + deadline_s
        return asyncio.gather(*(self._worker() for _ in range(self.workers)))

    def stop(self) -> None:
        self._stop.set()
