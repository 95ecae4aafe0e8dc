"""One engine per process: what the server, `ask`, `demo` and the adapters hold is one SpeculativeEngine,
built with every option the user gave and drafting from the index and the draft model named."""

from __future__ import annotations

import pytest
from packaged_fixtures import DOCUMENT, MODEL

from rag_speculate import InvalidArgumentError, SpeculativeEngine
from rag_speculate.drafters import CombinedDrafter, NGramTrieDrafter, OuroborosDrafter, RESTDrafter
from rag_speculate.entrypoints import engines
from rag_speculate.entrypoints.openai import ServerConfig, load
from rag_speculate.models.loading import load_tokenizer
from rag_speculate.retrieval.corpus import CorpusIndex, Document


@pytest.fixture
def built(monkeypatch) -> list[SpeculativeEngine]:
    """Every SpeculativeEngine built in the test, in a process whose shared engines start empty."""
    monkeypatch.setattr(engines, "_engines", {})
    made: list[SpeculativeEngine] = []
    construct = SpeculativeEngine.__init__

    def counted(self, *args, **kwargs):
        made.append(self)
        construct(self, *args, **kwargs)

    monkeypatch.setattr(SpeculativeEngine, "__init__", counted)
    return made


def test_the_server_holds_one_engine_with_the_options_given(built, tmp_path):
    documents = [Document(id="eiffel", text=DOCUMENT, title="Eiffel Tower")]
    CorpusIndex.build(documents, tmp_path / "index", tokenizer=load_tokenizer(MODEL))
    config = ServerConfig(model=MODEL, index=tmp_path / "index", draft_model=MODEL, device="cpu", dtype="float32",
                          draft_budget=3, max_batch=2, prompt_cache_dir=tmp_path / "cache", prompt_cache_disk_bytes=1 << 20)  # fmt: skip
    engine, index = load(config)
    assert built == [engine]
    assert engine.draft_budget == 3 and engine.max_batch == 2
    assert engine.prompt_cache.store is not None and engine.prompt_cache.stats().disk_max_bytes == 1 << 20
    assert isinstance(engine.drafter, CombinedDrafter)
    assert [type(d) for d in engine.drafter.drafters] == [NGramTrieDrafter, RESTDrafter, OuroborosDrafter]
    assert engine.drafter.drafters[1].datastore is index.datastore
    # A second entrance asking for the same configuration gets the same engine.
    again = engines.shared_engine(MODEL, dtype="float32", device="cpu", index=index, draft_model=MODEL, draft_budget=3,
                                  max_batch=2, prompt_cache_dir=tmp_path / "cache", prompt_cache_disk_bytes=1 << 20)  # fmt: skip
    assert again is engine and len(built) == 1


def test_the_server_config_passes_cuda_graphs_to_its_engine(built):
    with pytest.raises(InvalidArgumentError, match="cuda_graphs=True, but the model is on cpu"):
        load(ServerConfig(model=MODEL, device="cpu", cuda_graphs=True))
    engine, _ = load(ServerConfig(model=MODEL, device="cpu", cuda_graphs=False))
    assert not engine.stats().static_step and engine.stats().cuda_graphs == 0


def test_an_option_the_engine_does_not_take_is_refused_by_name(built):
    with pytest.raises(InvalidArgumentError, match="unknown engine option 'draft_budgett'"):
        engines.shared_engine(MODEL, device="cpu", draft_budgett=3)
    assert not built  # refused before any model loaded
    with pytest.raises(InvalidArgumentError, match="draft_budget must be an integer >= 0"):
        engines.shared_engine(MODEL, device="cpu", draft_budget=-1)
