"""The version of a set of rules: what metrics, the usage API and the admin store call it."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import yaml


def config_version(text: str) -> str:
    """A short hash of the effective rules: the parsed document, so comments, key order and
    whitespace do not change it."""
    try:
        doc: Any = yaml.safe_load(text)
    except yaml.YAMLError:
        doc = text
    canon = json.dumps(doc, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()[:12]
