"""Drafters that stress the engine: they only change what is checked, never what may be emitted."""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from rag_speculate import DraftContext, Drafter, DraftTree


class RandomTreeDrafter(Drafter):
    """Adversarial: random trees that hide the true continuation (when known) among decoys,
    with random mutations, so acceptance stops at arbitrary depths and branches."""

    name = "random_tree"

    def __init__(self, vocab_size: int, reference: Sequence[int] = (), seed: int = 0):
        self.vocab_size = vocab_size
        self.reference = list(reference)
        self.rng = random.Random(seed)
        self.prompt_len = 0

    def start(self, context: DraftContext) -> None:
        self.prompt_len = len(context.prompt_ids)

    def propose(self, tokens: Sequence[int], budget: int) -> DraftTree:
        rng = self.rng
        tokens_out: list[int] = []
        parents: list[int] = []
        truth = self.reference[len(tokens) - self.prompt_len :]
        truth_len = rng.randint(0, min(len(truth), budget)) if truth else 0
        node = -1
        for t in truth[:truth_len]:
            # Decoy siblings before and after the true child.
            for _ in range(rng.randint(0, 2)):
                if len(tokens_out) < budget - 1:
                    tokens_out.append(rng.randrange(self.vocab_size))
                    parents.append(node)
            if len(tokens_out) >= budget:
                break
            tokens_out.append(t if rng.random() > 0.1 else rng.randrange(self.vocab_size))
            parents.append(node)
            node = len(tokens_out) - 1
        while len(tokens_out) < budget and rng.random() < 0.8:
            tokens_out.append(rng.randrange(self.vocab_size))
            parents.append(rng.randrange(-1, len(tokens_out) - 1))
        return DraftTree(tokens_out, parents)


class TopKTreeDrafter(Drafter):
    """Drafts with the target model itself: the top-k tokens at depth 1 and top-1 chains below,
    so sampling runs through accepted children at every depth."""

    name = "topk_tree"

    def __init__(self, model, k: int = 3, depth: int = 2):
        self.model, self.k, self.depth = model, k, depth
        # A proposal depends on the tokens alone; the sampling tests draw thousands from a few contexts.
        self._trees: dict[tuple[int, ...], DraftTree] = {}

    def propose(self, tokens: Sequence[int], budget: int) -> DraftTree:
        key = tuple(tokens)
        if key not in self._trees:
            self._trees[key] = self._tree(tokens)
        tree = self._trees[key]
        return DraftTree(tree.tokens[:budget], tree.parents[:budget])

    @torch.inference_mode()
    def _tree(self, tokens: Sequence[int]) -> DraftTree:
        first = self.model(torch.tensor([list(tokens)], device=self.model.device)).logits[0, -1].topk(self.k).indices.tolist()
        out, parents = [], []
        for t in first:
            seq, parent = [*tokens, t], -1
            out.append(t)
            parents.append(parent)
            parent = len(out) - 1
            for _ in range(self.depth - 1):
                nxt = int(self.model(torch.tensor([seq], device=self.model.device)).logits[0, -1].argmax())
                out.append(nxt)
                parents.append(parent)
                parent = len(out) - 1
                seq.append(nxt)
        return DraftTree(out, parents)
