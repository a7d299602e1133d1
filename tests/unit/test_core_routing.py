"""How a request's path is handled (extproc.core.routing): a metered API call is metered
whatever the allow-list says, an allow-listed path passes, any other follows ``paths.other``
(refused with a client error, counted on RPM only, or passed); a path is public only when
allow-listed and listed public, and a metered call never is."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.core.routing import public_path, route
from extproc.errors import PathNotAllowed

pytestmark = pytest.mark.unit

METERED = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"]
OTHER = ["/v1/models", "/health", "/v1/files", "/admin/x"]
POLICIES = ["passthrough", "reject", "rpm_only"]


@given(
    path=st.sampled_from(METERED),
    other=st.sampled_from(POLICIES),
    allowed=st.lists(st.sampled_from(["/v1/*", "/health", *METERED]), max_size=3),
)
def test_a_metered_call_is_metered_whatever_the_lists(
    path: str, other: str, allowed: list[str]
) -> None:
    kind, api = route(path, "POST", allowed=tuple(allowed), other=other)
    assert kind == "metered" and api is not None
    assert not public_path(path, "POST", allowed=tuple(allowed), public=tuple(allowed))


@given(path=st.sampled_from(OTHER + METERED), other=st.sampled_from(POLICIES))
def test_other_paths_follow_the_policy(path: str, other: str) -> None:
    """A GET (never metered) on a path not allow-listed: refused, RPM-only or passed."""
    if other == "reject":
        with pytest.raises(PathNotAllowed):
            route(path, "GET", allowed=(), other=other)
        return
    kind, api = route(path, "GET", allowed=(), other=other)
    assert api is None and kind == ("rpm_only" if other == "rpm_only" else "pass")


@given(path=st.sampled_from(OTHER), public=st.booleans())
def test_an_allow_listed_path_passes_and_is_public_only_when_listed(
    path: str, public: bool
) -> None:
    allowed = (path,)
    assert route(path, "GET", allowed=allowed, other="reject") == ("pass", None)
    got = public_path(path, "GET", allowed=allowed, public=allowed if public else ())
    assert got is public
    assert not public_path(path, "GET", allowed=(), public=(path,))  # public needs allow too
