"""Drafters propose what the target model verifies; see `base.Drafter` for the interface."""

from .base import DraftContext, Drafter
from .combined import CombinedDrafter
from .ngram_trie import NGramTrieDrafter
from .ouroboros import OuroborosDrafter
from .phrase_pool import PhrasePool, PhrasePoolError
from .rest import RESTDrafter

__all__ = [
    "CombinedDrafter",
    "DraftContext",
    "Drafter",
    "NGramTrieDrafter",
    "OuroborosDrafter",
    "PhrasePool",
    "PhrasePoolError",
    "RESTDrafter",
]
