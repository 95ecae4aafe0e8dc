"""The parts of speculative decoding the engine and the drafters share: the draft tree, requests and
results, sampling, verification, the draft budget, a model's forwards on its KV cache, the prompt cache."""
