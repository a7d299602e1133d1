"""Benchmarks of the gateway against baselines measured in the same run (``scripts/bench``)."""

from __future__ import annotations
