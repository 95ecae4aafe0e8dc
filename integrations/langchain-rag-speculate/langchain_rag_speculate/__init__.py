"""LangChain integration of rag-speculate: lossless speculative decoding for local Hugging Face models."""

from .chains import create_rag_chain, join_documents
from .chat_models import ChatSpeculativeHF
from .llms import SpeculativeHFLLM

__all__ = ["ChatSpeculativeHF", "SpeculativeHFLLM", "create_rag_chain", "join_documents"]
