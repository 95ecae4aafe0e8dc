"""The engine: the decode loop and the public calls (`engine.py`), and turning a caller's input into
a checked request (`inputs.py`)."""

from .engine import DEFAULT_DRAFT_BUDGET, SpeculativeEngine

__all__ = ["DEFAULT_DRAFT_BUDGET", "SpeculativeEngine"]
