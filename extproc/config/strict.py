"""The base of every rules-file model."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    """Base: every model rejects unknown keys and is immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
