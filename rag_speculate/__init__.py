"""rag-speculate: lossless speculative decoding for RAG, drafting from what the pipeline retrieved."""

from .decoding.result import GenerationResult, GenerationStats, GenerationStream
from .decoding.tree import DraftTree
from .decoding.verify import Verification
from .drafters import (
    CombinedConfig,
    CombinedDrafter,
    DraftContext,
    Drafter,
    NGramTrieDrafter,
    OuroborosConfig,
    OuroborosDrafter,
    PhrasePool,
    PhrasePoolError,
    RESTDrafter,
)
from .drafters.rest import Datastore, DatastoreError
from .engine import DEFAULT_DRAFT_BUDGET, SpeculativeEngine
from .errors import InvalidArgumentError, ModelPackageError, RagSpeculateError

__all__ = [
    "DEFAULT_DRAFT_BUDGET",
    "CombinedConfig",
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
    "OuroborosConfig",
    "OuroborosDrafter",
    "PhrasePool",
    "PhrasePoolError",
    "RESTDrafter",
    "RagSpeculateError",
    "SpeculativeEngine",
    "Verification",
]
