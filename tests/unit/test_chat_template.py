"""Chat input counted by rendering the model's chat template (extproc.core.chat_template and
extproc.tokenizers.load_chat_template) against a byte-level BPE trained here: exact counts
checked by hand (special tokens one each, the text between them encoded alone) and against
transformers' own ``apply_chat_template``; bodies the template path does not model fall back to
the framing formula."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from extproc import tokenizers as tz
from extproc.core.apis.base import ApiName, ParsedRequest
from extproc.core.apis.messages import MESSAGES, count_messages_input
from extproc.core.apis.openai import CHAT
from extproc.core.apis.openai.counting import count_chat_request
from extproc.core.apis.responses import RESPONSES, count_responses_input
from extproc.core.chat_template import count_with_template, template_of
from extproc.core.counters import EstimateCounter, HuggingFaceCounter
from extproc.core.tokens import TokenizerSpec

pytestmark = pytest.mark.unit

tokenizers = pytest.importorskip("tokenizers")

SPECIALS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CORPUS = [
    "The quota gateway counts tokens for every tenant while the model streams answers back.",
    "def count(text: str) -> int:\n    return len(text.split())\n",
    "配额网关为每个租户统计令牌\uff0c模型把答案流式返回\u3002",
    'Emoji too: 😀🚀🔥✨ and symbols {"a": [1, 2, 3]}',
]

#: Loops over a message's content parts (vLLM's "openai" content format), like the engine
#: fixture's template.
PARTS_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
#: Reads content as one string; uses bos/eos, tools (tojson), tool calls, raise_exception,
#: loop controls and a generation block, as real templates do.
STRING_TEMPLATE = """{{ bos_token }}
{% if tools %}<|system|>
Tools: {{ tools | tojson }}<|end|>
{% endif %}
{% for message in messages %}
{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}
{{ raise_exception('unknown role ' + message['role']) }}
{% endif %}
{% if message['role'] == 'assistant' %}
<|assistant|>
{% generation %}{{ message['content'] }}{% if message.tool_calls %}
{% for call in message.tool_calls %}call {{ call.function.name }}({{ call.function.arguments | tojson }})
{% endfor %}{% endif %}{% endgeneration %}{{ eos_token }}
{% else %}
<|{{ message['role'] }}|>
{{ message['content'] }}<|end|>
{% endif %}
{% if loop.index > 50 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}<|assistant|>
{% endif %}"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE trained on a small mixed corpus, saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 50, trainer=trainer)
    out = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    tok.save(str(out))
    return out


def _model_dir(base: Path, trained: Path, name: str, config: dict[str, Any]) -> Path:
    d = base / name
    d.mkdir()
    (d / "tokenizer.json").write_bytes(trained.read_bytes())
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d / "tokenizer.json"


CONFIG = {"bos_token": "<|bos|>", "eos_token": {"content": "<|eos|>"}, "pad_token": "<|pad|>"}


@pytest.fixture(scope="module")
def parts_counter(trained: Path, tmp_path_factory: pytest.TempPathFactory) -> HuggingFaceCounter:
    """A counter whose directory carries the content-parts template."""
    path = _model_dir(
        tmp_path_factory.mktemp("m"), trained, "parts", {**CONFIG, "chat_template": PARTS_TEMPLATE}
    )
    counter = tz.load_counter(TokenizerSpec(kind="huggingface", path=str(path)))
    assert isinstance(counter, HuggingFaceCounter)
    return counter


@pytest.fixture(scope="module")
def string_counter(trained: Path, tmp_path_factory: pytest.TempPathFactory) -> HuggingFaceCounter:
    """A counter whose directory carries the string-content template."""
    path = _model_dir(
        tmp_path_factory.mktemp("m"), trained, "str", {**CONFIG, "chat_template": STRING_TEMPLATE}
    )
    counter = tz.load_counter(TokenizerSpec(kind="huggingface", path=str(path)))
    assert isinstance(counter, HuggingFaceCounter)
    return counter


SPEC = TokenizerSpec(kind="huggingface", path="unused")


def _req(api: ApiName, body: dict[str, Any]) -> ParsedRequest:
    return ParsedRequest(
        api=api, model="m", stream=False, sequences=1, declared_max_output=None, body=body
    )


def _by_hand(counter: HuggingFaceCounter, text: str) -> int:
    """Special tokens one each, every stretch between them encoded on its own."""
    tok = counter.tokenizer
    total = 0
    rest = text
    while rest:
        hits = [(rest.find(s), s) for s in SPECIALS if s in rest]
        if not hits:
            return total + len(tok.encode(rest, add_special_tokens=False).ids)
        at, special = min(hits)
        if at:
            total += len(tok.encode(rest[:at], add_special_tokens=False).ids)
        total += 1
        rest = rest[at + len(special) :]
    return total


def test_content_format_is_detected(
    parts_counter: HuggingFaceCounter, string_counter: HuggingFaceCounter
) -> None:
    """A template looping over message['content'] gets parts; one that prints it, a string."""
    parts, string = template_of(parts_counter), template_of(string_counter)
    assert parts is not None and parts.content_format == "openai"
    assert string is not None and string.content_format == "string"
    assert string.variables["bos_token"] == "<|bos|>"
    assert string.variables["eos_token"] == "<|eos|>"  # from the {"content": ...} form


def test_parts_template_counts_exactly_by_hand(parts_counter: HuggingFaceCounter) -> None:
    """Chat input = the rendered template's tokens, each role marker one token."""
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "配额网关 😀"}]},
        ],
    }
    rendered = "<|system|>\nBe brief.<|end|>\n<|user|>\n配额网关 😀<|end|>\n<|assistant|>\n"
    expected = _by_hand(parts_counter, rendered)
    assert CHAT.count_input(_req("chat", body), parts_counter, SPEC) == expected
    # 5 markers; and not the framing formula's figure
    assert expected != count_chat_request(body, parts_counter, SPEC)


def test_responses_and_messages_render_like_chat(parts_counter: HuggingFaceCounter) -> None:
    """Instructions / system become a system message: the three APIs count the same prompt."""
    chat = {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    }
    responses = {"instructions": "Be brief.", "input": "hi"}
    messages = {
        "system": [{"type": "text", "text": "Be brief."}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_tokens": 5,
    }
    n = CHAT.count_input(_req("chat", chat), parts_counter, SPEC)
    assert RESPONSES.count_input(_req("responses", responses), parts_counter, SPEC) == n
    assert MESSAGES.count_input(_req("messages", messages), parts_counter, SPEC) == n
    assert n == _by_hand(
        parts_counter, "<|system|>\nBe brief.<|end|>\n<|user|>\nhi<|end|>\n<|assistant|>\n"
    )


def test_unmodelled_bodies_fall_back_to_the_formula(string_counter: HuggingFaceCounter) -> None:
    """Tool items, tool_use blocks, built-in tools and a template that raises: the formula."""
    responses = {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}
    assert RESPONSES.count_input(
        _req("responses", responses), string_counter, SPEC
    ) == count_responses_input(responses, string_counter, SPEC)
    builtin = {"input": "hi", "tools": [{"type": "web_search"}]}
    assert RESPONSES.count_input(
        _req("responses", builtin), string_counter, SPEC
    ) == count_responses_input(builtin, string_counter, SPEC)
    messages = {
        "messages": [
            {"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}
        ]
    }
    assert MESSAGES.count_input(
        _req("messages", messages), string_counter, SPEC
    ) == count_messages_input(messages, string_counter, SPEC)
    raising = {"messages": [{"role": "narrator", "content": "once upon a time"}]}
    assert CHAT.count_input(_req("chat", raising), string_counter, SPEC) == count_chat_request(
        raising, string_counter, SPEC
    )


def test_one_template_path_for_the_three_chat_apis(parts_counter: HuggingFaceCounter) -> None:
    """count_with_template renders chat, Responses and Messages bodies alike; None without a
    template or with a tool it does not model (the codec's formula counts then)."""
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    responses = {"input": "hi"}
    messages = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    n = count_with_template("chat", chat, parts_counter, SPEC)
    assert n is not None and n == CHAT.count_input(_req("chat", chat), parts_counter, SPEC)
    assert count_with_template("responses", responses, parts_counter, SPEC) == n
    assert count_with_template("messages", messages, parts_counter, SPEC) == n
    builtin = {**responses, "tools": [{"type": "web_search"}]}
    assert count_with_template("responses", builtin, parts_counter, SPEC) is None
    plain = EstimateCounter()
    assert count_with_template("chat", chat, plain, SPEC) is None
    assert count_with_template("responses", responses, plain, SPEC) is None
    assert count_with_template("messages", messages, plain, SPEC) is None


def test_media_parts_add_their_flat_cost(parts_counter: HuggingFaceCounter) -> None:
    """An image part costs the spec's image figure on top of the rendered text."""
    text_only = {"messages": [{"role": "user", "content": [{"type": "text", "text": "look"}]}]}
    with_image = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "look"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                ],
            }
        ]
    }
    spec = TokenizerSpec(kind="huggingface", path="unused", image_tokens=100)
    base = CHAT.count_input(_req("chat", text_only), parts_counter, spec)
    assert CHAT.count_input(_req("chat", with_image), parts_counter, spec) == base + 100


def test_request_template_kwargs_cannot_override_the_conversation(
    string_counter: HuggingFaceCounter,
) -> None:
    """chat_template_kwargs reach the template, but never messages or the generation prompt."""
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hello"}]}
    n = CHAT.count_input(_req("chat", body), string_counter, SPEC)
    hostile = {**body, "chat_template_kwargs": {"messages": [], "add_generation_prompt": False}}
    assert CHAT.count_input(_req("chat", hostile), string_counter, SPEC) == n
    no_prompt = {**body, "add_generation_prompt": False}
    assert CHAT.count_input(_req("chat", no_prompt), string_counter, SPEC) < n


def test_long_text_is_cut_around_special_tokens(trained: Path) -> None:
    """Pieces of a long text never split a special token: the count stays exact."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(trained))
    counter = HuggingFaceCounter(tok, name="t", max_piece_chars=16)
    text = "<|user|>\nThe quota gateway counts tokens for every tenant<|end|>\n" * 20
    assert counter.count(text) == len(tok.encode(text, add_special_tokens=False).ids)
    # a run with no safe cut is cut by force: never fewer tokens than the truth
    run = "<|user|>" + "配额网关😀" * 30 + "<|end|>"
    assert counter.count(run) >= len(tok.encode(run, add_special_tokens=False).ids)


def test_no_template_and_bad_templates(trained: Path, tmp_path: Path) -> None:
    """No config: no template; a chat_template.jinja file wins; a broken one is a load error."""
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "tokenizer.json").write_bytes(trained.read_bytes())
    assert tz.load_chat_template(str(plain / "tokenizer.json")) is None
    named = _model_dir(
        tmp_path,
        trained,
        "named",
        {"chat_template": [{"name": "default", "template": "{{ messages | length }}"}]},
    )
    assert tz.load_chat_template(str(named)) is not None
    (named.parent / "chat_template.jinja").write_text(PARTS_TEMPLATE)
    loaded = tz.load_chat_template(str(named))
    assert loaded is not None and loaded.content_format == "openai"
    broken = _model_dir(tmp_path, trained, "broken", {"chat_template": "{% for x in %}"})
    with pytest.raises(tz.TokenizerLoadError, match="does not compile"):
        tz.load_chat_template(str(broken), model="m")


def test_sandbox_refuses_attribute_escapes(trained: Path, tmp_path: Path) -> None:
    """A template reaching for Python internals fails to render: the formula counts instead."""
    path = _model_dir(
        tmp_path, trained, "evil", {"chat_template": "{{ messages.__class__.__mro__ }}"}
    )
    counter = tz.load_counter(TokenizerSpec(kind="huggingface", path=str(path)))
    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert CHAT.count_input(_req("chat", body), counter, SPEC) == count_chat_request(
        body, counter, SPEC
    )


# ------------------------------------------------------------------ transformers as the oracle

ORACLE_CHATS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "hello"}]},
    {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "配额网关为每个租户统计令牌 😀🚀"},
            {"role": "assistant", "content": "好的。"},
            {"role": "user", "content": "def count(text: str) -> int:\n    return 0\n"},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get", "arguments": {"city": "Zürich"}},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
        "tools": [
            {
                "type": "function",
                "function": {"name": "get", "parameters": {"type": "object", "properties": {}}},
            }
        ],
    },
]


@pytest.fixture(scope="module")
def oracle() -> Iterator[Any]:
    """transformers' fast-tokenizer class (import is slow: once per module)."""
    transformers = pytest.importorskip("transformers")
    yield transformers.PreTrainedTokenizerFast


@pytest.mark.parametrize("template", ["parts", "string"])
@pytest.mark.parametrize("case", range(len(ORACLE_CHATS)))
def test_counts_equal_transformers_apply_chat_template(
    oracle: Any,
    trained: Path,
    parts_counter: HuggingFaceCounter,
    string_counter: HuggingFaceCounter,
    template: str,
    case: int,
) -> None:
    """The count is the length of transformers' own tokenised rendering, token for token."""
    counter = parts_counter if template == "parts" else string_counter
    source = PARTS_TEMPLATE if template == "parts" else STRING_TEMPLATE
    hf = oracle(tokenizer_file=str(trained), bos_token="<|bos|>", eos_token="<|eos|>")
    hf.chat_template = source
    body = ORACLE_CHATS[case]
    ids = hf.apply_chat_template(
        body["messages"], tools=body.get("tools"), add_generation_prompt=True, tokenize=True
    )
    if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    assert CHAT.count_input(_req("chat", body), counter, SPEC) == len(ids)
