"""Ouroboros: a small draft model of the target's family, with a phrase pool kept across queries."""

from .config import OuroborosConfig
from .drafter import OuroborosDrafter
from .phrase_pool import PhrasePool, PhrasePoolError

__all__ = ["OuroborosConfig", "OuroborosDrafter", "PhrasePool", "PhrasePoolError"]
