"""``python -m extproc`` is the ``ai-quota`` command."""

from __future__ import annotations

import sys

from extproc.cli import main

sys.exit(main())
