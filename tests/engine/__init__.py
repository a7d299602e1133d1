"""Tests against a real model server (vLLM's CPU build serving a tiny local model)."""
