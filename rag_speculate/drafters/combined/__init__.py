"""Several drafters in one tree under one budget (`drafter.py`), each judged by what it earns
(`ledger.py`); its tuning constants in `config.py`."""

from .config import CombinedConfig
from .drafter import CombinedDrafter

__all__ = ["CombinedConfig", "CombinedDrafter"]
