"""The planner's one error type (its own module so every planner module can raise it without cycles)."""

from __future__ import annotations

__all__ = ["PlanError"]


class PlanError(ValueError):
    """An inconsistent plan or plan document; the message says which invariant broke."""
