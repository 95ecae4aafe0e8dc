"""Drafters propose what the target model verifies; see `base.Drafter` for the interface."""

from .base import DraftContext, Drafter
from .combined import CombinedConfig, CombinedDrafter
from .ngram_trie import NGramTrieDrafter
from .ouroboros import OuroborosConfig, OuroborosDrafter, PhrasePool, PhrasePoolError
from .rest import Datastore, DatastoreError, RESTDrafter

__all__ = [
    "CombinedConfig",
    "CombinedDrafter",
    "Datastore",
    "DatastoreError",
    "DraftContext",
    "Drafter",
    "NGramTrieDrafter",
    "OuroborosConfig",
    "OuroborosDrafter",
    "PhrasePool",
    "PhrasePoolError",
    "RESTDrafter",
]
