"""A tokenizer's identity as one hash, recorded by everything stored as token ids.

A stored token id means text only through the tokenizer that produced it, so the datastore and
the corpus index record this hash and refuse to be read with a tokenizer whose ids mean other text.
"""

from __future__ import annotations

import hashlib
import json

from transformers import PreTrainedTokenizerBase


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A sha256 of the tokenizer's vocabulary and special tokens: equal fingerprints, equal token ids."""
    identity = {
        "vocab": sorted((token_id, token) for token, token_id in tokenizer.get_vocab().items()),
        "special": sorted(zip(tokenizer.all_special_ids, tokenizer.all_special_tokens)),
    }
    return hashlib.sha256(json.dumps(identity, ensure_ascii=False).encode()).hexdigest()
