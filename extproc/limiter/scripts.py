"""The packaged Lua scripts, as registered: ``admit`` and ``settle`` with ``settle_lib.lua`` in
front (one copy of the settlement logic), ``admit`` and ``allowance`` with ``drafts_lib.lua``
(their reclaim hands back dead replicas' drafts)."""

from __future__ import annotations

from importlib import resources

#: Scripts that settle: the shared settlement functions go in front of their text.
_SETTLING = frozenset({"admit", "settle"})
#: Scripts whose reclaim hands back the drafts of dead replicas' draft ledgers.
_DRAFTING = frozenset({"admit", "allowance"})


def _lua(name: str) -> str:
    return resources.files("extproc.limiter").joinpath(f"lua/{name}.lua").read_text("utf-8")


def load_script(name: str) -> str:
    """The text of a packaged ``.lua`` script, as registered (``admit`` and ``settle`` with
    ``settle_lib.lua`` in front)."""
    text = _lua(name)
    if name in _DRAFTING:
        text = _lua("drafts_lib") + "\n" + text
    return _lua("settle_lib") + "\n" + text if name in _SETTLING else text
