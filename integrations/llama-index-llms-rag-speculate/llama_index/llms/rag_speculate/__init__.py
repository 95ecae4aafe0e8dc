"""LlamaIndex integration of rag-speculate: lossless speculative decoding for local Hugging Face models."""

from llama_index.llms.rag_speculate.base import SpeculativeHFLLM
from llama_index.llms.rag_speculate.documents import DraftDocumentsPostprocessor, drafting_from

__all__ = ["DraftDocumentsPostprocessor", "SpeculativeHFLLM", "drafting_from"]
