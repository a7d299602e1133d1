"""Which upstreams' input figures a request admitted on a bound may be billed without a count.

A request admitted on an upper bound of its input is billed at the upstream's own input figure
when the counted path could accept it (:meth:`extproc.core.session.Session.settlement`), without
tokenizing the prompt.  That shortcut is earned and kept per model, in each process:

* **earned**: after a process starts, and after every change of the rules (a new config
  version), a model's requests are counted until one count agrees with the upstream's figure
  (its *probation*); an upstream that under-reports from the start never gets the shortcut;
* **kept under audit**: one request of the model in ``requests.input_audit_every`` (``every``)
  is counted anyway at admission (per model, so no mix of models can starve one of audits),
  and a figure may stand without a count only while fewer than ``every - 1`` requests of the
  model were billed that way with figures read since the latest figure a count agreed with:
  the next one is counted, whatever the sampling did.  So one process bills at most
  ``every - 1`` requests of a model at the upstream's figure after it began to under-report;
* **lost**: when a count shows the upstream's figure outside the bounds the counted path
  trusts, the shortcut stops for that model: every later request of it is counted.  The server
  writes the stop to Redis (:meth:`stopped_elsewhere` takes the other replicas' stops back),
  so it holds on every replica and across restarts, for the config version it was found under.

The tables are bounded: only configured models reach them, and past ``max_models`` stopped
models every model is counted (slower, never wrong); past ``max_models`` tracked models a new
one stays in probation (counted).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

#: The most models whose shortcut is tracked (beyond: every model is counted).
MAX_STOPPED_MODELS = 1024


@dataclass(frozen=True, slots=True)
class Suspects:
    """The requests of a model this process billed at the upstream's own input figure since
    its last agreeing count: the ones a later disagreement says were probably billed low.
    ``bills``: each one's (reported figure, the bound it was admitted on)."""

    requests: int = 0
    reported_tokens: int = 0
    bills: tuple[tuple[int, int], ...] = ()

    def unbilled_estimate(self, reported: int, counted: int) -> int:
        """What those requests were likely short, if the upstream under-reported them as it did
        the request whose count disagreed (``reported`` against ``counted``): each one's figure
        scaled by ``counted / reported - 1``, but never more than its bound less its figure
        (its true count is at most the bound); 0 when the upstream over-reported."""
        if counted <= reported:
            return 0
        r = max(1, reported)
        return sum(min(f * (counted - r) // r, max(0, b - f)) for f, b in self.bills)


@dataclass(slots=True)
class _Trust:
    """A model whose shortcut was earned (in this process, under the rules in force)."""

    # the report order (:attr:`Session.report_seq`) of the latest figure a count agreed with
    agreed_at: int = 0
    # requests allowed to be billed at the upstream's figure, not yet settled
    reserved: int = 0
    # (report order, reported figure, bound) of the requests billed at the upstream's figure
    # whose figure was read after the latest agreeing one
    bills: list[tuple[int, int, int]] = field(default_factory=list)


class InputAudits:
    """The audit sampler, each model's earned shortcut, and the models whose upstream input
    figures disagreed with a count.

    Which bills an agreeing count vouches for goes by the order the upstream's figures were
    read (:attr:`extproc.core.session.Session.report_seq`), not by the order requests settle:
    a count of a figure read before the upstream began to under-report clears none of the bills
    whose figures were read after."""

    __slots__ = ("_all_stopped", "_max", "_seen", "_stopped", "_trust")

    def __init__(self, max_models: int = MAX_STOPPED_MODELS) -> None:
        self._max = max_models
        self._seen: dict[str, int] = {}
        self._stopped: set[str] = set()
        self._all_stopped = False
        # models whose shortcut was earned (absent: in probation)
        self._trust: dict[str, _Trust] = {}

    def reset(self) -> None:
        """The rules changed (a new config version): every model is in probation again and
        the stops found under the old version no longer hold (an operator changes the rules
        to fix an upstream or a tokenizer; an upstream still lying is caught again by the
        probation's first count)."""
        self._seen.clear()
        self._stopped.clear()
        self._all_stopped = False
        self._trust.clear()

    def count_now(self, model: str, every: int) -> bool:
        """Whether a request of ``model`` just admitted on a bound is counted at once: every
        one of a model in probation or whose shortcut stopped, and one in ``every`` of each
        model (an audit)."""
        if self.stopped(model) or model not in self._trust:
            return True
        seen = self._seen.get(model, 0) + 1
        self._seen[model] = seen
        return seen % max(1, every) == 0

    def take_uncounted(self, model: str, every: int) -> bool:
        """Whether this request of ``model`` may be billed at the upstream's own input figure
        without a count (False: count it).  Taken at once (a reservation, given back by
        :meth:`release` when the request settles), so requests settling together cannot all
        pass on the same room: at most ``every - 1`` bills whose figures were read since the
        latest agreeing one."""
        t = None if self.stopped(model) else self._trust.get(model)
        if t is None or t.reserved + len(t.bills) >= max(1, every) - 1:
            return False
        t.reserved += 1
        return True

    def release(self, model: str) -> None:
        """A request that took :meth:`take_uncounted` has settled (billed through
        :meth:`billed_uncounted`, or counted after all)."""
        t = self._trust.get(model)
        if t is not None and t.reserved > 0:
            t.reserved -= 1

    def billed_uncounted(self, model: str, reported: int, seq: int, bound: int) -> None:
        """A request of ``model`` admitted on ``bound`` was billed at the upstream's figure
        ``reported`` (read in report order ``seq``) without a count: a suspect should a later
        count disagree."""
        t = self._trust.get(model)
        if t is not None and seq > t.agreed_at:
            t.bills.append((seq, max(0, reported), bound))

    def agreed(self, model: str, seq: int) -> None:
        """A count agreed with ``model``'s upstream figure read in report order ``seq``: the
        shortcut is earned (or kept), and the bills whose figures were read before are
        cleared."""
        if self.stopped(model):
            return
        t = self._trust.get(model)
        if t is None:
            if len(self._trust) >= self._max:
                return  # beyond the table's size a model stays in probation (counted)
            t = self._trust[model] = _Trust()
        if seq > t.agreed_at:
            t.agreed_at = seq
            t.bills = [b for b in t.bills if b[0] > seq]

    def stopped(self, model: str) -> bool:
        """Whether ``model``'s upstream input figures are no longer billed without a count."""
        return self._all_stopped or model in self._stopped

    def disagreed(self, model: str) -> Suspects | None:
        """A count disagreed with ``model``'s upstream figure: stop its shortcut.  The requests
        billed at its figure since its latest agreeing one when this stops it (it was taken
        until now), None when it was stopped already."""
        if self.stopped(model):
            return None
        t = self._trust.get(model)
        bills = tuple((r, b) for _, r, b in t.bills) if t is not None else ()
        self._stop(model)
        return Suspects(len(bills), sum(r for r, _ in bills), bills)

    def stopped_elsewhere(self, models: Iterable[str]) -> list[str]:
        """Stops another replica (or this one before a restart) found under the same config
        version, read from Redis: the models this stops now."""
        new = [m for m in models if not self.stopped(m)]
        for m in new:
            self._stop(m)
        return new

    def _stop(self, model: str) -> None:
        self._trust.pop(model, None)
        if len(self._stopped) >= self._max:
            self._all_stopped = True
        else:
            self._stopped.add(model)

    def __len__(self) -> int:
        return len(self._stopped)
