"""Decoding: the engine's loop, the draft tree, its verification in one forward, and what they return."""
