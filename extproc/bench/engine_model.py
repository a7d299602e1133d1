"""Build the tiny model the engine tests serve: a random Llama and a locally trained tokenizer.

Nothing comes from a model hub. The tokenizer is a 4,096-token byte-level BPE trained with
``tokenizers`` on a text generated here (English words, code, CJK, emoji: deterministic, so two
builds give the same files); the model is a randomly initialised ``LlamaForCausalLM`` with 2
layers, hidden size 64, 2 heads of 32 (vLLM's CPU attention refuses a head size of 16), in
float32, saved as safetensors (~640k parameters). ``tokenizer_config.json`` carries a plain chat
template, which vLLM applies for chat, Responses and Messages requests.

The build needs ``torch`` and ``transformers``, which only ``.venv-engine`` has
(``scripts/setup --engine``); it is run there as ``python -m extproc.bench.engine_model --out DIR``.
:func:`model_dir` (importable from the project's own venv) names the cache directory, keyed by
a hash of this file, so a change to the recipe builds a new model and an unchanged one is
reused between runs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

VOCAB_SIZE = 4096
SEED = 20261203
SPECIAL_TOKENS = [
    "<|pad|>",
    "<|bos|>",
    "<|eos|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
]
#: Each message is ``<|role|>\ncontent<|end|>\n``; the reply is primed with ``<|assistant|>\n``.
CHAT_TEMPLATE = (
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
MAX_MODEL_LEN = 4096

_SENTENCE = (
    "the quota gateway counts tokens for every tenant and key while the model server streams "
    "answers back through envoy redis holds shared counters per window a request is admitted "
    "when its estimate fits the budget otherwise it is refused with a retry after header "
    "streams are metered as they pass and cut when the limit is reached billing follows what "
    "was delivered to the client operators read usage records and alerts from prometheus "
    "a small model generates random text quickly on a single core of a shared machine"
)
_WORDS = _SENTENCE.split()
_CODE = [
    "def count(text: str) -> int:\n    return len(text.split())\n",
    "for i in range(10):\n    print(i, i * i)\n",
    "class Window:\n    def __init__(self, size):\n        self.size = size\n",
    'if __name__ == "__main__":\n    main()\n',
    '{"model": "tiny", "stream": true, "max_tokens": 64}\n',
]
_EMOJI = (
    "😀😁😂🤣😃😄😅😆😉😊😋😎😍😘🥰🙂🤗🤩🤔🤨😐😑😶🙄😏😣😥😮🤐😯😪😫🥱😴😌😛🚀🔥✨🎉👍👋🙏💡📈🌍"
)


def _cjk_chars(rng: random.Random) -> str:
    # a fixed set of common CJK Unified Ideographs plus full-width punctuation
    chars = [chr(c) for c in range(0x4E00, 0x4E00 + 600)]
    chars += [chr(c) for c in range(0x6700, 0x6700 + 200)]
    rng.shuffle(chars)
    return "".join(chars)


def corpus(lines: int = 20000) -> list[str]:
    """The deterministic training text: prose, code, Chinese-like text and emoji."""
    rng = random.Random(SEED)
    cjk = _cjk_chars(rng)
    out: list[str] = []
    for i in range(lines):
        kind = i % 5
        if kind in (0, 1):
            n = rng.randint(5, 30)
            words = [rng.choice(_WORDS) for _ in range(n)]
            out.append(" ".join(words).capitalize() + ".")
        elif kind == 2:
            out.append(rng.choice(_CODE))
        elif kind == 3:
            # Zipf-like: early characters far more frequent, so BPE merges some pairs
            n = rng.randint(5, 40)
            text = "".join(
                cjk[min(len(cjk) - 1, int(rng.paretovariate(1.2)) - 1)] for _ in range(n)
            )
            out.append(text + rng.choice("\uff0c\u3002\uff01\uff1f"))  # full-width , . ! ?
        else:
            n = rng.randint(1, 6)
            out.append(
                " ".join(rng.choice(_WORDS) for _ in range(3))
                + " "
                + "".join(rng.choice(_EMOJI) for _ in range(n))
            )
    return out


def recipe_hash() -> str:
    """A hash of this file: the cache key of a build."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def cache_root() -> Path:
    """``$AIQ_ENGINE_MODEL_CACHE`` or ``~/.cache/ai-quota/engine-model``."""
    env = os.environ.get("AIQ_ENGINE_MODEL_CACHE")
    if env:
        return Path(env)
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "ai-quota" / "engine-model"


def model_dir() -> Path:
    """Where this recipe's model lives once built."""
    return cache_root() / recipe_hash()


def ensure_model(engine_python: Path, repo: Path) -> Path:
    """Build the model with ``engine_python`` unless this recipe's build is cached; its path."""
    out = model_dir()
    if (out / "DONE").exists():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(  # noqa: S603 - our own venv and module
        [str(engine_python), "-m", "extproc.bench.engine_model", "--out", str(tmp)],
        cwd=str(repo),
        check=True,
        timeout=600,
    )
    if not (out / "DONE").exists():
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def build_tokenizer(out: Path) -> None:
    """Train the byte-level BPE and write ``tokenizer.json`` and ``tokenizer_config.json``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_MODEL_LEN,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps(
            {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}, indent=2
        )
        + "\n"
    )


def build_model(out: Path) -> None:
    """Write a random tiny Llama whose vocabulary is the tokenizer's."""
    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=MAX_MODEL_LEN,
        bos_token_id=tok.token_to_id("<|bos|>"),
        eos_token_id=tok.token_to_id("<|eos|>"),
        pad_token_id=tok.token_to_id("<|pad|>"),
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(str(out), safe_serialization=True)


def build(out: Path) -> None:
    """Build everything into ``out`` and mark it complete."""
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    build_model(out)
    (out / "RECIPE").write_text(recipe_hash() + "\n")
    (out / "DONE").write_text("")


def main(argv: list[str] | None = None) -> int:
    """``python -m extproc.bench.engine_model --out DIR``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--out", type=Path, default=None, help="default: the cache directory")
    args = ap.parse_args(argv)
    out = args.out or model_dir()
    build(out)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
