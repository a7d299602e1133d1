"""How far the gateway's recount of streamed deltas drifts from the tokens the engine generated.

An engine streams one delta per generated token, through an incremental detokenizer that holds
back bytes that do not yet form a complete UTF-8 character (vLLM uses ``tokenizers``'
``DecodeStream``, which emits nothing while the text ends in U+FFFD).  The gateway counts each
delta's text again with the model's tokenizer (:func:`extproc.core.tokens.count_stream_delta`).
This module simulates that: encode a text (the tokens a model would emit for it), decode it token
by token the engine's way, recount the deltas, and compare with the number of tokens.

Texts: English prose (this repository's ``docs/*.md``), Python code (``extproc/**/*.py``), Chinese
and emoji generated from fixed word lists, and uniformly random token ids (what a randomly
initialised test model emits).  Tokenizers: tiktoken ``cl100k_base`` (bundled) and a 4,096-token
byte-level BPE trained here on the other half of the same material.  Everything is seeded, so
the figures are reproducible: ``python -m extproc.bench.stream_drift``.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from extproc.core.tokens import REPLACEMENT_CHAR, count_stream_delta

ROOT = Path(__file__).resolve().parents[2]
SEED = 20261204

_ZH_WORDS = [
    "配额",
    "网关",
    "为",
    "每个",
    "租户",
    "统计",
    "令牌",
    "模型",
    "服务器",
    "把",
    "答案",
    "流式",
    "返回",
    "给",
    "客户端",
    "请求",
    "在",
    "窗口",
    "内",
    "被",
    "接受",
    "或者",
    "拒绝",
    "并",
    "附带",
    "重试",
    "时间",
    "运维",
    "人员",
    "读取",
    "用量",
    "记录",
    "和",
    "告警",
    "我们",
    "需要",
    "一个",
    "可靠",
    "的",
    "计费",
    "系统",
    "它",
    "必须",
    "与",
    "引擎",
    "自己",
    "的",
    "计数",
    "一致",
    "当",
    "流",
    "被",
    "切断",
    "时",
    "只",
    "收取",
    "已经",
    "交付",
    "的",
    "部分",
    "这",
    "是",
    "公平",
    "的",
    "做法",
    "今天",
    "天气",
    "很",
    "好",
    "他们",
    "去",
    "公园",
    "散步",
    "学习",
    "新",
    "知识",
    "让",
    "人",
    "快乐",
    "数据",
    "库",
    "保存",
    "共享",
    "计数器",
    "每",
    "分钟",
    "令牌",
    "数",
    "限制",
    "预算",
    "货币",
]
_ZH_PUNCT = ("\uff0c", "\u3002", "\u3001", "\uff1b", "\uff1f", "\uff01")
_EMOJI = [
    "😀",
    "😂",
    "🥰",
    "😎",
    "🤔",
    "🙄",
    "😴",
    "🚀",
    "🔥",
    "✨",
    "🎉",
    "👍",
    "👋",
    "🙏",
    "💡",
    "📈",
    "🌍",
    "❤️",
    "✅",
    "⚠️",
    "🇨🇭",
    "🇯🇵",
    "🇧🇷",
    "👩\u200d💻",
    "👨\u200d👩\u200d👧",
    "🧑🏽\u200d🚀",
    "👍🏿",
    "🏳️\u200d🌈",
    "🐍",
    "🦀",
    "☕",
    "🍣",
    "🎵",
]
_EN_FILLER = [
    "ok",
    "so",
    "then",
    "yes",
    "no",
    "great",
    "thanks",
    "wow",
    "nice",
    "done",
    "ship",
    "it",
]

Category = str


def _docs(parity: int) -> str:
    files = sorted((ROOT / "docs").glob("*.md"))
    return "\n\n".join(p.read_text(encoding="utf-8") for p in files[parity::2])


def _code(parity: int) -> str:
    files = sorted((ROOT / "extproc").rglob("*.py"))
    files = [p for p in files if "_gen" not in p.parts]
    return "\n\n".join(p.read_text(encoding="utf-8") for p in files[parity::2])


def _chinese(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    n = 0
    while n < chars:
        sentence = "".join(rng.choice(_ZH_WORDS) for _ in range(rng.randint(4, 14)))
        sentence += rng.choice(_ZH_PUNCT)
        out.append(sentence)
        n += len(sentence)
    return "".join(out)


def _emoji(rng: random.Random, items: int) -> str:
    out: list[str] = []
    for _ in range(items):
        if rng.random() < 0.3:
            out.append(" " + rng.choice(_EN_FILLER) + " ")
        out.append(rng.choice(_EMOJI))
    return "".join(out)


def texts(parity: int, size: int = 60_000) -> dict[Category, str]:
    """The sample texts (``parity`` 0 trains the local BPE, 1 is measured)."""
    rng = random.Random(SEED + parity)
    return {
        "english": _docs(parity)[:size],
        "code": _code(parity)[:size],
        "chinese": _chinese(rng, size // 3),
        "emoji": _emoji(rng, size // 8),
    }


# --------------------------------------------------------------------------- engines


@dataclass(frozen=True)
class Engine:
    """A tokenizer the way an engine uses it: encode, stream-decode, and count."""

    name: str
    encode: Callable[[str], list[int]]
    deltas: Callable[[Sequence[int]], list[str]]
    count: Callable[[str], int]
    vocab: int


def byte_deltas(token_bytes: Callable[[int], bytes], ids: Iterable[int]) -> list[str]:
    """One entry per generated token: the text the engine streams after it (empty while it holds
    back an incomplete UTF-8 sequence, as ``DecodeStream`` does); whatever is still held at the
    end is flushed with replacement characters into the last entry."""
    out: list[str] = []
    pending = b""
    for i in ids:
        pending += token_bytes(i)
        text = pending.decode("utf-8", "replace")
        if text.endswith(REPLACEMENT_CHAR):
            out.append("")
        else:
            out.append(text)
            pending = b""
    if pending and out:
        out[-1] += pending.decode("utf-8", "replace")
    return out


def tiktoken_engine() -> Engine:
    """cl100k_base, the bundled file."""
    from extproc.tokenizers.tiktoken_files import bundled_encoding

    enc = bundled_encoding()
    return Engine(
        "tiktoken cl100k_base",
        enc.encode_ordinary,
        lambda ids: byte_deltas(enc.decode_single_token_bytes, ids),
        lambda text: len(enc.encode_ordinary(text)),
        min(enc._special_tokens.values()) - 1,  # ordinary ids are 0..100255
    )


def train_bpe(corpus: Iterable[str], vocab_size: int = 4096) -> Any:
    """A byte-level BPE like the engine test model's, trained on ``corpus``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|pad|>", "<|bos|>", "<|eos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def bpe_engine(tok: Any, name: str = "byte-level BPE 4096 (trained here)") -> Engine:
    """A Hugging Face tokenizer streamed through ``tokenizers``' own ``DecodeStream``."""
    from tokenizers.decoders import DecodeStream

    def deltas(ids: Sequence[int]) -> list[str]:
        stream = DecodeStream(skip_special_tokens=True)
        out = [stream.step(tok, i) or "" for i in ids]
        decoded = tok.decode(list(ids), skip_special_tokens=True)
        held = decoded[len("".join(out)) :]  # held back at the end: flushed with the last
        if held and out:
            out[-1] += held
        return out

    return Engine(
        name,
        lambda text: tok.encode(text, add_special_tokens=False).ids,
        deltas,
        lambda text: len(tok.encode(text, add_special_tokens=False).ids),
        tok.get_vocab_size(),
    )


# --------------------------------------------------------------------------- measuring


@dataclass(frozen=True)
class Drift:
    """One (engine, text) measurement."""

    engine: str
    category: Category
    tokens: int
    deltas_with_replacement: int
    recount_plain: int
    recount: int
    #: lowest and highest (recount - tokens) / tokens of one response, in %
    worst_low: float
    worst_high: float

    @property
    def plain_pct(self) -> float:
        """Plain re-encoding of each delta, relative to the truth."""
        return 100.0 * (self.recount_plain - self.tokens) / self.tokens

    @property
    def pct(self) -> float:
        """The gateway's rule (replacement characters one token each), relative to the truth."""
        return 100.0 * (self.recount - self.tokens) / self.tokens


def _chunks(ids: list[int], size: int) -> Iterator[list[int]]:
    for i in range(0, len(ids), size):
        yield ids[i : i + size]


def measure(engine: Engine, category: Category, ids: list[int], stream_len: int = 500) -> Drift:
    """Stream ``ids`` in responses of ``stream_len`` tokens and recount every delta."""
    plain = ours = fffd = 0
    low = high = 0.0
    for response in _chunks(ids, stream_len):
        counted = 0
        for delta in engine.deltas(response):
            if not delta:
                continue
            fffd += REPLACEMENT_CHAR in delta
            plain += engine.count(delta)
            counted += count_stream_delta(delta, engine.count)
        ours += counted
        pct = 100.0 * (counted - len(response)) / len(response)
        low, high = min(low, pct), max(high, pct)
    return Drift(engine.name, category, len(ids), fffd, plain, ours, low, high)


def run(size: int = 60_000, random_tokens: int = 20_000) -> list[Drift]:
    """Every engine over every sample text, and over random token ids."""
    train, test = texts(0, size), texts(1, size)
    engines = [tiktoken_engine(), bpe_engine(train_bpe(list(train.values()) * 3))]
    rng = random.Random(SEED)
    out: list[Drift] = []
    for engine in engines:
        for category, text in test.items():
            out.append(measure(engine, category, engine.encode(text)))
        ids = [rng.randrange(engine.vocab) for _ in range(random_tokens)]
        out.append(measure(engine, "random ids", ids))
    return out


def table(rows: list[Drift]) -> str:
    """The figures as a Markdown table."""
    lines = [
        "| tokenizer | text | engine tokens | deltas with U+FFFD | plain recount | drift "
        "| gateway recount | drift | worst response |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.engine} | {r.category} | {r.tokens:,} | {r.deltas_with_replacement:,} "
            f"| {r.recount_plain:,} | {r.plain_pct:+.2f} % | {r.recount:,} | {r.pct:+.2f} % "
            f"| {r.worst_low:+.1f} % .. {r.worst_high:+.1f} % |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the drift table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=60_000, help="characters per text sample")
    parser.add_argument("--random-tokens", type=int, default=20_000)
    args = parser.parse_args(argv)
    print(table(run(args.size, args.random_tokens)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
