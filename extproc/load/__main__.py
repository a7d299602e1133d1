"""``python -m extproc.load``: run the load-test harness without the ``ai-quota`` wrapper."""

from __future__ import annotations

import sys

from extproc.load.cli import main

if __name__ == "__main__":
    sys.exit(main())
