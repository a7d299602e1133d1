"""Wire formats of the simulator's generation APIs (pure: bytes and dicts, no I/O), and the
encoder of each (:data:`ENCODERS`).

One encoder per API turns the same generated output (reasoning, answer text or tool arguments,
per choice) into that API's events and bodies:

* ``chat``: OpenAI ``chat.completion`` / ``chat.completion.chunk`` (``data:`` lines, ``[DONE]``);
* ``completions``: OpenAI ``text_completion``;
* ``responses``: OpenAI Responses API (typed events with ``event:`` lines and ``sequence_number``);
* ``messages``: Anthropic Messages API (``event:`` lines, ``message_start`` … ``message_stop``).

Stream encoders are stateful: ``delta`` emits the events that open or close output items or
content blocks when the kind of output changes (reasoning → text, …).

One module per API (:mod:`.openai`, :mod:`.responses`, :mod:`.messages`) over what they share
(:mod:`.base`); the error bodies are :mod:`.errors`.
"""

from __future__ import annotations

from extproc.sim.wire.base import Encoder
from extproc.sim.wire.messages import MessagesEncoder
from extproc.sim.wire.openai import ChatEncoder, CompletionsEncoder
from extproc.sim.wire.responses import ResponsesEncoder

ENCODERS: dict[str, type[Encoder]] = {
    "chat": ChatEncoder,
    "completions": CompletionsEncoder,
    "responses": ResponsesEncoder,
    "messages": MessagesEncoder,
}
