"""Tenants, API keys and limits changed at run time: a Redis store, its admin gRPC API and
CLI, and the subscription every replica keeps to it (docs/admin.md)."""
