"""Counting a request's input tokens: small bodies inline, large ones in worker threads (tiktoken
releases the GIL), at most ``Gateway.count_slots`` at a time and within the counting deadline,
so a burst of huge prompts queues instead of slowing every other tenant's chunks; and the
count of a prompt admitted on a bound, after admission (:class:`BoundCounting`, executing the
core's :mod:`extproc.core.bound_count`).

The cheap alternative admission may decide on, the same walk of the request with the model's
upper-bound counter (no tokenizer run), is the core's
:func:`extproc.core.admission_rules.bound_input`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog

from extproc.config.runtime import Model, RuntimeConfig
from extproc.core.admission_plan import Cost
from extproc.core.admission_rules import client_errors
from extproc.core.apis.base import ApiFormat, ParsedRequest
from extproc.core.bound_count import (
    BoundAction,
    CountForNote,
    CountInput,
    ScheduleNote,
    after_admission,
    after_count,
    count_at_response,
    count_before_figures,
    note,
    note_due,
)
from extproc.core.envelope import BoundCounted, CountPrepared
from extproc.core.phase_records import AdmitModel
from extproc.errors import GatewayBusy, GatewayError
from extproc.gateway import Gateway
from extproc.limiter.base import InputNote
from extproc.server.context import RequestContext

log = structlog.get_logger("extproc")

# Bodies longer than this (bytes) are counted in a worker thread.
OFFLOAD_BYTES = 16_384


async def count_input(
    gw: Gateway,
    cfg: RuntimeConfig,
    api: ApiFormat,
    req: ParsedRequest,
    model: AdmitModel,
    *,
    size: int,
) -> int:
    """The request's input tokens by ``model``'s tokenizer (raises the client-facing errors)."""

    def count() -> int:
        return api.count_input(req, model.counter, model.tokenizer)

    t0 = time.perf_counter()
    with client_errors:
        n = await _run(gw, cfg, count, size)
    gw.metrics.tokenize_seconds.labels(api.name).observe(time.perf_counter() - t0)
    return n


async def _run(gw: Gateway, cfg: RuntimeConfig, count: Callable[[], int], size: int) -> int:
    if size <= OFFLOAD_BYTES:
        return count()
    try:
        async with asyncio.timeout(cfg.count_deadline_ms / 1000), gw.count_slots:
            return await asyncio.to_thread(count)
    except TimeoutError:
        raise GatewayBusy(
            "The gateway is busy counting other large prompts; retry in a second."
        ) from None


class BoundCounting:
    """One request's count of a prompt admitted on an upper bound, after admission: executes
    the core's rules (:mod:`extproc.core.bound_count`): the background count, the note's timer
    and the note, the count a figure waits for."""

    __slots__ = ("_cfg", "_counting", "_exact", "_gw", "_noting", "_s", "_size", "_uncounted_ok")

    def __init__(self, ctx: RequestContext) -> None:
        self._gw, self._cfg, self._s = ctx.gw, ctx.cfg, ctx.s
        self._size = 0  # the request body's bytes
        # the exact input count of a request admitted on a bound, running after its answer
        self._counting: asyncio.Task[None] | None = None
        # writing the exact input into the open ledger, a moment after admission (the count
        # taken for it, when not audited, is kept: settlement reuses it): a timer until then
        # (most requests settle first and cancel it: no task, no loop turn), then the task
        self._noting: asyncio.Task[None] | asyncio.TimerHandle | None = None
        self._exact: int | None = None
        # whether the upstream's input figure may stand without a count (asked once)
        self._uncounted_ok: bool | None = None

    def admitted(self, size: int) -> None:
        """The request was admitted (its body ``size`` bytes): on a bound, the session gets its
        way to count, and the core decides when (the audit asked here, once)."""
        s = self._s
        self._size = size
        if not s.input_pending or s.cost is None:  # admitted unmetered (fail-open): no count
            return
        api, req, model = s.api, s.req, s.model
        assert api is not None and req is not None and isinstance(model, Model)
        s.handle(
            CountPrepared(
                lambda: api.count_input(req, model.counter, model.tokenizer),
                inline=size <= OFFLOAD_BYTES,
            )
        )
        self._run(after_admission(audit=self._gw.audit_input(self._cfg, model.name)))

    def _run(self, actions: tuple[BoundAction, ...]) -> None:
        s = self._s
        for act in actions:
            if isinstance(act, CountInput):
                # the first step runs once the current answer is being written: off its path
                self._counting = asyncio.ensure_future(self._count_exact(act.note_after_s))
            elif isinstance(act, ScheduleNote):
                self._noting = asyncio.get_running_loop().call_later(
                    act.after_s, self._note_due, act.exact
                )
            elif isinstance(act, CountForNote):
                self._noting = asyncio.ensure_future(self._count_for_note())
            else:
                self._gw.background.note_input(InputNote(s.ledger, act.exact, act.refund))

    def _bound(self) -> Cost:
        adm = self._s.admitted
        assert adm is not None and adm.cost is not None
        return adm.cost

    def _note_due(self, exact: int | None) -> None:
        s = self._s
        self._run(note_due(s.ledger, s.buckets, self._bound(), exact, settling=s.settling))

    async def _counted(self) -> int | None:
        """The exact input count (a large prompt in a worker thread); None when it cannot
        finish (the counting threads stayed busy past the deadline)."""
        s = self._s
        api, req, model = s.api, s.req, s.model
        assert api is not None and req is not None and isinstance(model, Model)
        try:
            return await count_input(self._gw, self._cfg, api, req, model, size=self._size)
        except GatewayError as err:
            log.warning("input_count_failed", request_id=s.request_id, error=err.message)
        except Exception:  # the bound stands; the request goes on
            log.exception("input_count_failed", request_id=s.request_id)
        return None

    async def _count_for_note(self) -> None:
        s = self._s
        if s.settling:
            return
        exact = await self._counted()
        if exact is None:
            return
        self._exact = exact  # settlement reuses it
        write = note(s.ledger, s.buckets, self._bound(), exact, settling=s.settling)
        if write is not None:
            self._run((write,))

    async def _count_exact(self, note_after_s: float | None = None) -> None:
        """Replace the bound admission charged with the exact count; a count that cannot finish
        leaves the bound: an over-count, never an under-count."""
        s = self._s
        exact = self._exact
        if exact is None:
            exact = await self._counted()
        cost = s.cost
        if s.input_pending and cost is not None:
            s.handle(BoundCounted(cost.input_tokens if exact is None else exact))
            self._run(after_count(exact, note_after_s=note_after_s, settling=s.settling))

    async def input_known(self) -> None:
        """Wait for an exact input count that is running."""
        task = self._counting
        if task is not None and not task.done():
            await asyncio.shield(task)

    async def figures_ready(self) -> None:
        """Before a figure is decided (settlement, a cut's message, the access log's input):
        the exact count it needs, a large prompt's in a worker thread within the counting
        deadline, never on the event loop."""
        await self.input_known()
        s = self._s
        if s.cost is None:  # fail-open: nothing charged
            return
        needs, pending = s.needs_count, s.input_pending
        # asked only when it decides (it takes room from the model's audits)
        ok = needs or not pending or self._may_bill_uncounted()
        if count_before_figures(needs_count=needs, pending=pending, may_bill_uncounted=ok):
            await self._count_exact()

    def response_metered(self) -> None:
        """An answer to meter: should its upstream input figure not be billed without a count
        (the model's room between counts is used up), count it now, off the answer's path, so
        that every figure shown from here on (the access log's, a cut's) is the one billed;
        settlement checks again all the same."""
        s = self._s
        pending = s.input_pending and s.cost is not None
        if not pending or self._counting is not None:
            return
        if count_at_response(
            pending=pending, counting=False, may_bill_uncounted=self._may_bill_uncounted()
        ):
            self._counting = asyncio.ensure_future(self._count_exact())

    def _may_bill_uncounted(self) -> bool:
        """Whether the upstream's input figure may be billed without a count: not while the
        model is in probation, stopped, or has had ``input_audit_every - 1`` such bills since
        its last agreeing count (:meth:`InputAudits.take_uncounted`; asked once a request)."""
        if self._uncounted_ok is None:
            model = self._s.model
            self._uncounted_ok = isinstance(model, Model) and self._gw.input_audits.take_uncounted(
                model.name, self._cfg.input_audit_every
            )
        return self._uncounted_ok

    def settling(self) -> None:
        """Settlement begins: a count for the ledger is no use now (settlement counts if it
        must)."""
        if self._noting is not None:
            self._noting.cancel()

    def settled(self) -> None:
        """Settlement is over: a bill at the upstream's figure without a count (it holds the
        model's room) or a count gives the room back."""
        model = self._s.model
        if self._uncounted_ok and isinstance(model, Model):
            self._gw.input_audits.release(model.name)
