"""The ``ai-quota`` sub-commands of the service itself (``serve``, ``up``, ``check-config``,
``envoy-config``), one module each with ``configure_parser`` and ``run``; the side tools keep
theirs in their own package's ``cli.py``.  :mod:`extproc.cli` wires them all."""

from __future__ import annotations

#: The rules file ``up`` runs on, and ``serve`` without ``--config``/``AIQ_CONFIG``.
DEMO_CONFIG = "config/demo.yaml"
#: The envoyproxy/ratelimit config ``up`` serves on the RLS API (the seed article's).
DEMO_RLS_CONFIG = "config/ratelimit"
