"""Which upstreams' input figures a request admitted on a bound may be billed without a count.

A request admitted on an upper bound of its input is billed at the upstream's own input figure
when the counted path could accept it (:meth:`extproc.core.session.Session.settlement`), without
tokenizing the prompt.  One such request in ``requests.input_audit_every`` is counted anyway
(an audit), and any whose figure had to be checked is counted too; when a count shows the
upstream's figure outside the bounds the counted path trusts, the shortcut stops for that
model: every later request of it admitted on a bound is counted, so an upstream that reports
less (uncached tokens only, another tokenizer) is billed on the count from then on.

The table is bounded: only configured models with a proven bound reach it, and past
``max_models`` stopped models every model is counted (slower, never wrong).
"""

from __future__ import annotations

#: The most models whose shortcut is tracked as stopped (beyond: every model is counted).
MAX_STOPPED_MODELS = 1024


class InputAudits:
    """The audit sampler and the models whose upstream input figures disagreed with a count."""

    __slots__ = ("_all_stopped", "_max", "_seen", "_stopped")

    def __init__(self, max_models: int = MAX_STOPPED_MODELS) -> None:
        self._seen = 0
        self._stopped: set[str] = set()
        self._all_stopped = False
        self._max = max_models

    def count_now(self, model: str, every: int) -> bool:
        """Whether a request of ``model`` just admitted on a bound is counted at once: one in
        ``every`` (an audit), and every one of a model whose shortcut stopped."""
        self._seen += 1
        return self.stopped(model) or self._seen % max(1, every) == 0

    def stopped(self, model: str) -> bool:
        """Whether ``model``'s upstream input figures are no longer billed without a count."""
        return self._all_stopped or model in self._stopped

    def disagreed(self, model: str) -> bool:
        """A count disagreed with ``model``'s upstream figure: stop its shortcut.  True when
        this stops it (it was taken until now)."""
        if self.stopped(model):
            return False
        if len(self._stopped) >= self._max:
            self._all_stopped = True
        else:
            self._stopped.add(model)
        return True

    def __len__(self) -> int:
        return len(self._stopped)
