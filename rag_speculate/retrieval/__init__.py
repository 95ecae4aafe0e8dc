"""Retrieval: the corpus index (FAISS over chunk embeddings), the REST datastore, and the shipped NQ corpus."""
