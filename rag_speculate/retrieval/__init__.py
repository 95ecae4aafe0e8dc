"""Retrieval: the corpus index (FAISS over chunk embeddings, with a REST datastore of its tokens) and the
shipped Natural Questions corpus."""
