"""REST (He et al., 2023): draft what followed the context's longest match in a datastore.

The datastore finds the longest suffix of the context (at most `n_max` tokens) that occurs in the
corpus and reads the `m` tokens after up to `max_matches` of its occurrences; a frequency trie
of those continuations keeps its `budget` most frequent nodes (Algorithm 2 of the paper). The
documents retrieved for one request are not used here: the datastore is the corpus.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from ...decoding.tree import DraftTree
from ...decoding.verify import Verification
from ...fingerprint import tokenizer_fingerprint
from ..agreement import MatchAgreement
from ..base import Drafter, Target
from ..frequency_trie import best_subtree, frequency_trie
from .datastore import Datastore, DatastoreError, check_retrieval_arguments

# A match in a whole corpus is weaker evidence than one in documents retrieved for this request:
# replaying greedy answers against a corpus datastore (benchmarks/rest_agreement.py), the most
# frequent continuation's first token is the target's far less often than for retrieved documents.
# The priors stay above what that replay finds where the match is long: only verified drafts teach
# the rates, and a datastore that does predict the model (the paper's) must get those trials.
REST_MATCH_PRIORS = {1: 0.25, 2: 0.35, 3: 0.5, 4: 0.6}


class RESTDrafter(Drafter):
    name = "rest"

    def __init__(self, datastore: Datastore, n_max: int = 16, m: int = 10, max_matches: int = 64):
        check_retrieval_arguments(n_max, m, max_matches)
        self.datastore = datastore
        self.n_max = n_max
        self.m = m
        self.max_matches = max_matches
        # Unlike the documents of one request, the datastore stays: how well it predicts this model
        # carries over between generations (old evidence still fades each step).
        self._agreement = MatchAgreement(REST_MATCH_PRIORS)

    def attach(self, target: Target) -> None:
        fingerprint = self.datastore.fingerprint
        if fingerprint is not None and fingerprint != tokenizer_fingerprint(target.tokenizer):
            raise DatastoreError(
                "the datastore was built with another tokenizer (its vocabulary or special tokens differ from "
                "the model's), so its token ids mean other text; rebuild it with this model's tokenizer"
            )
        if self.datastore.vocab_size > target.vocab_size:
            raise DatastoreError(
                f"the datastore's vocabulary ({self.datastore.vocab_size} ids) is larger than the model's "
                f"({target.vocab_size}): it was built for another model; rebuild it with this model's tokenizer"
            )

    def fork(self) -> RESTDrafter:
        """The datastore shared; the rates learnt so far copied, as each generation's proposals and
        verifications must meet in its own."""
        other = copy.copy(self)
        other._agreement = copy.deepcopy(self._agreement)
        return other

    def propose(self, tokens: Sequence[int], budget: int) -> DraftTree:
        if budget < 1:
            return DraftTree.empty()
        retrieval = self.datastore.retrieve(tokens, n_max=self.n_max, m=self.m, max_matches=self.max_matches)
        if not retrieval.continuations:
            return DraftTree.empty()
        agreement = self._agreement.rate(retrieval.match_length)
        return best_subtree(frequency_trie(retrieval.continuations), budget, self.name, agreement)

    def observe(self, verification: Verification) -> None:
        self._agreement.observe(verification)
