"""Drafters propose what the target model verifies; see `base.Drafter` for the interface."""

from .base import DraftContext, Drafter
from .ngram_trie import NGramTrieDrafter

__all__ = ["DraftContext", "Drafter", "NGramTrieDrafter"]
