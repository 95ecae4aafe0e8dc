"""The LangChain and LlamaIndex adapters, end to end on the small packaged model: real framework objects,
no mocks. One engine serves every test (loaded once, shared through the adapters' `engine=`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# The examples are scripts: their folder makes them (and their shared nq_corpus module) importable.
sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))

# The machine has 2 cores shared with other work; more threads only oversubscribe them.
torch.set_num_threads(1)

MODEL = "smollm2-135m-instruct"
DTYPE = "float32"
# A plain raw-text continuation this model produces without ever stopping early, and the document it
# continues: a prompt template that trims the document leaves the rest to the drafters.
COUNT_DOCUMENT = ", ".join(str(i) for i in range(1, 80))
COUNT_PROMPT = f"Numbers: {COUNT_DOCUMENT[:30]}"


@pytest.fixture(scope="session")
def engine():
    from rag_speculate.decoding.budget import CostModel
    from rag_speculate.entrypoints.engines import shared_engine

    # The same cache entry the standard suites' ChatSpeculativeHF(model=MODEL, dtype=DTYPE) resolves to.
    engine = shared_engine(MODEL, dtype=DTYPE, device="cpu", draft_budget=None)
    # A pinned cost curve (the shape measured for this model here) keeps drafting choices, and so
    # the stats these tests compare, independent of the shared machine's timing noise.
    engine.cost_model = CostModel({1: 0.05, 2: 0.085, 5: 0.095, 17: 0.135}, learn=False)
    return engine
