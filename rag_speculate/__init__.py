"""rag-speculate: lossless speculative decoding for RAG, drafting from what the pipeline retrieved."""

from .drafters import DraftContext, Drafter, NGramTrieDrafter
from .engine import DEFAULT_DRAFT_BUDGET, SpeculativeEngine
from .errors import InvalidArgumentError, ModelPackageError, RagSpeculateError
from .result import GenerationResult, GenerationStats, GenerationStream
from .tree import DraftTree
from .verify import Verification

__all__ = [
    "DEFAULT_DRAFT_BUDGET",
    "DraftContext",
    "DraftTree",
    "Drafter",
    "GenerationResult",
    "GenerationStats",
    "GenerationStream",
    "InvalidArgumentError",
    "ModelPackageError",
    "NGramTrieDrafter",
    "RagSpeculateError",
    "SpeculativeEngine",
    "Verification",
]
