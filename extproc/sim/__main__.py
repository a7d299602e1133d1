"""``python -m extproc.sim``: run the upstream simulator without the ai-quota entry point."""

from __future__ import annotations

import argparse
import sys

from extproc.sim.cli import configure_parser, run


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and serve the simulator."""
    parser = argparse.ArgumentParser(prog="python -m extproc.sim")
    configure_parser(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
