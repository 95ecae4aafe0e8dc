"""rag-speculate: lossless speculative decoding for RAG, drafting from what the pipeline retrieved."""

from .datastore import Datastore, DatastoreError
from .drafters import (
    CombinedDrafter,
    DraftContext,
    Drafter,
    NGramTrieDrafter,
    OuroborosDrafter,
    PhrasePool,
    PhrasePoolError,
    RESTDrafter,
)
from .engine import DEFAULT_DRAFT_BUDGET, SpeculativeEngine
from .errors import InvalidArgumentError, ModelPackageError, RagSpeculateError
from .result import GenerationResult, GenerationStats, GenerationStream
from .tree import DraftTree
from .verify import Verification

__all__ = [
    "DEFAULT_DRAFT_BUDGET",
    "CombinedDrafter",
    "Datastore",
    "DatastoreError",
    "DraftContext",
    "DraftTree",
    "Drafter",
    "GenerationResult",
    "GenerationStats",
    "GenerationStream",
    "InvalidArgumentError",
    "ModelPackageError",
    "NGramTrieDrafter",
    "OuroborosDrafter",
    "PhrasePool",
    "PhrasePoolError",
    "RESTDrafter",
    "RagSpeculateError",
    "SpeculativeEngine",
    "Verification",
]
