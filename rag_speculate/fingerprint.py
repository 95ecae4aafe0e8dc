"""Identities as hashes: a tokenizer's (recorded by everything stored as token ids) and a model's
weights' (recorded by the prompt cache's disk tier, whose KV entries only that model computes).

A stored token id means text only through the tokenizer that produced it, so the datastore and
the corpus index record the tokenizer's hash and refuse to be read with a tokenizer whose ids mean
other text. A stored KV entry is the output of one model's weights, so the prompt cache's blocks
are filed under a hash of them.
"""

from __future__ import annotations

import hashlib
import json
import weakref

import torch
from transformers import PreTrainedTokenizerBase

# A model object -> its weights' fingerprint: hashing a 1.5B model's weights takes seconds, so once.
_WEIGHTS: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
# Configuration fields that say where a model came from or how it was saved, not what it computes.
_NOT_COMPUTED = ("architectures", "transformers_version", "dtype", "torch_dtype")


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A sha256 of the tokenizer's vocabulary and special tokens: equal fingerprints, equal token ids."""
    identity = {
        "vocab": sorted((token_id, token) for token, token_id in tokenizer.get_vocab().items()),
        "special": sorted(zip(tokenizer.all_special_ids, tokenizer.all_special_tokens)),
    }
    return hashlib.sha256(json.dumps(identity, ensure_ascii=False).encode()).hexdigest()


def weights_fingerprint(model: torch.nn.Module) -> str:
    """A sha256 of `model`'s configuration and of every tensor of its state (name, dtype, shape,
    bytes), or of the verified source `known_weights` recorded for it. Computed once per model
    object: weights changed in place afterwards are not seen."""
    digest = _WEIGHTS.get(model)
    if digest is None:
        digest = _WEIGHTS[model] = _hashed(model)
    return digest


def known_weights(model: torch.nn.Module, source: str) -> None:
    """Record that `model`'s weights are exactly those of `source` (a checksummed file and the dtype
    it was loaded in, say), so that its fingerprint needs no pass over the weights."""
    digest = hashlib.sha256(f"source\0{source}\0{_config(model)}".encode())
    _WEIGHTS[model] = digest.hexdigest()


def changed_weights(model: torch.nn.Module, change: str) -> None:
    """Record that `model`'s weights were changed in place by `change` (quantized, say): a fingerprint
    known or computed before now names other weights, so it becomes one of the old and the change."""
    digest = _WEIGHTS.pop(model, None)
    if digest is not None:
        _WEIGHTS[model] = hashlib.sha256(f"{digest}\0changed\0{change}".encode()).hexdigest()


def _config(model: torch.nn.Module) -> str:
    config = getattr(model, "config", None)
    if config is None:
        return ""
    fields = {k: v for k, v in config.to_dict().items() if not k.startswith("_") and k not in _NOT_COMPUTED}
    return json.dumps(fields, sort_keys=True, default=str)


def _hashed(model: torch.nn.Module) -> str:
    digest = hashlib.sha256(f"weights\0{_config(model)}".encode())
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(f"\0{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        # Bytes as stored, whatever the dtype (numpy has no bf16); a GPU tensor is copied out in turn.
        digest.update(tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy())
    return digest.hexdigest()
