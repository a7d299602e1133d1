"""``ai-quota check-config``: validate a rules file, or an envoyproxy/ratelimit config (a
directory, or a file with a ``domain``), strictly (exit 0 valid, 1 invalid)."""

from __future__ import annotations

import argparse
import sys


def configure_parser(c: argparse.ArgumentParser) -> None:
    """The one argument of ``ai-quota check-config``."""
    c.add_argument("file", help="the YAML rules file, or the RLS config file or directory")


def run(args: argparse.Namespace) -> int:
    """Validate a rules file (or an RLS config): exit 0 when valid, 1 with every error
    otherwise."""
    from extproc.config import ConfigError, load_config
    from extproc.rls.load import looks_like_rls

    if looks_like_rls(args.file):
        from extproc.rls.service import check_path

        code, text = check_path(args.file)
        print(text, file=sys.stderr if code else sys.stdout)
        return code

    try:
        cfg = load_config(args.file)
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    print(
        f"{args.file}: OK ({len(cfg.models)} models, {len(cfg.tenants)} tenants, "
        f"{len(cfg.keys_by_digest)} keys)"
    )
    if cfg.plaintext_keys:
        print(f"{args.file}: warning: {cfg.plaintext_keys} plaintext key(s): for local demos only")
    print(
        f"{args.file}: every rule here, failure settings included, applies on SIGHUP without a "
        "restart; process settings (AIQ_* variables, serve flags) need one"
    )
    return 0
