"""``python -m extproc.bench``: run the benchmark suite."""

from __future__ import annotations

import sys

from extproc.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
