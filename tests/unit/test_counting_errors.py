"""What a body's walk raises becomes the client's error, whichever counter walked it
(``extproc.core.admission_flow``'s context manager, a class since issue 27)."""

from __future__ import annotations

import pytest

from extproc.core.admission_rules import client_errors as _client_errors
from extproc.core.tokens import PromptShapeError, PromptTooLarge
from extproc.errors import BadRequest, RequestTooLarge

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("raised", "expected", "text"),
    [
        (PromptTooLarge("prompt over 10 chars"), RequestTooLarge, "prompt over 10 chars"),
        (PromptShapeError("messages must be a list"), BadRequest, "messages must be a list"),
        (RecursionError(), BadRequest, "nested too deeply"),
    ],
)
def test_walk_errors_become_client_errors(
    raised: Exception, expected: type[Exception], text: str
) -> None:
    with pytest.raises(expected, match=text) as info, _client_errors:
        raise raised
    assert info.value.__suppress_context__


def test_other_errors_and_no_error_pass_through() -> None:
    with pytest.raises(KeyError), _client_errors:
        raise KeyError("x")
    with _client_errors:
        value = 3
    assert value == 3
