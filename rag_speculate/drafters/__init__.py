"""Drafters propose what the target model verifies; see `base.Drafter` for the interface."""

from .base import DraftContext, Drafter
from .ngram_trie import NGramTrieDrafter
from .rest import RESTDrafter

__all__ = ["DraftContext", "Drafter", "NGramTrieDrafter", "RESTDrafter"]
