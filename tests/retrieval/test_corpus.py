"""The corpus index: reading, chunking, FAISS search against brute force, the manifest's checks, atomic rebuilds."""

from __future__ import annotations

import gzip
import itertools
import json
import os
import warnings

import numpy as np
import pytest
import torch
from conftest import char_tokenizer, hf_greedy, tiny_model

from rag_speculate import InvalidArgumentError, NGramTrieDrafter, RESTDrafter, SpeculativeEngine
from rag_speculate.drafters.rest.datastore import Datastore
from rag_speculate.entrypoints.prompt import drafting_documents, rag_messages
from rag_speculate.retrieval.corpus import (
    ChunkingOptions,
    CorpusIndex,
    CorpusIndexError,
    Document,
    Embedder,
    load_embedder,
    read_corpus,
)

TEXTS = [
    "the cat sat on the mat and looked at the rain falling on the garden all afternoon.",
    "paris is the capital of france; the eiffel tower stands on the left bank of the seine.",
    "dogs bark at night and chase cars along the dusty road to the old farm.",
    "the moon orbits the earth every twenty seven days, pulling the tides of the oceans.",
    "a violin has four strings tuned in fifths and is played with a bow of horse hair.",
]
OPTIONS = ChunkingOptions(chunk_tokens=48, chunk_overlap=8)


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    return load_embedder()


@pytest.fixture(scope="module")
def documents() -> list[Document]:
    return [Document(text, f"title {i}", f"doc-{i}", {"n": i}) for i, text in enumerate(TEXTS)]


@pytest.fixture
def built(tmp_path, documents, tokenizer, embedder) -> CorpusIndex:
    return CorpusIndex.build(documents, tmp_path / "index", tokenizer=tokenizer, embedder=embedder, options=OPTIONS)


# --- reading --------------------------------------------------------------------------------


def test_a_folder_corpus_skips_what_it_cannot_read_and_says_so(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("first document", encoding="utf-8")
    (tmp_path / "sub" / "b.md").write_text("# second", encoding="utf-8")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "blank.txt").write_text("  \n", encoding="utf-8")
    (tmp_path / "ignored.csv").write_text("not, a, document", encoding="utf-8")
    with pytest.warns(RuntimeWarning, match=r"skipped 2 unreadable entries.*blank.txt \(empty\).*latin1.txt \(UnicodeDecodeError\)"):
        documents = read_corpus(tmp_path)
    assert [(d.id, d.title, d.text) for d in documents] == [("a.txt", "a", "first document"), ("sub/b.md", "b", "# second")]


def test_a_jsonl_corpus_keeps_titles_ids_and_metadata(tmp_path):
    rows = [{"body": "one", "title": "T", "id": 7, "metadata": {"k": 1}}, {"body": ""}, "not an object", {"body": "two"}]
    file = tmp_path / "corpus.jsonl.gz"
    with gzip.open(file, "wt", encoding="utf-8") as out:
        out.write("\n".join(json.dumps(r) for r in rows) + "\n{broken\n")
    with pytest.warns(RuntimeWarning, match=r"skipped 3 .*line 2 \(no text in field 'body'\).*line 5 \(not JSON\)"):
        documents = read_corpus(file, text_field="body")
    assert documents == [Document("one", "T", "7", {"k": 1}), Document("two", "", "4", {})]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p / "missing", "does not exist"),
        (lambda p: (p / "x.csv").write_text("a") and p / "x.csv", "must be a folder of .txt/.md files or a .jsonl"),
        (lambda p: p, "has no documents with text"),
        (lambda p: (p / "e.jsonl").write_text('{"title": "no text"}\n') and p / "e.jsonl", r"no documents with text \(1 skipped\)"),
    ],
)
def test_unusable_corpora_are_refused_by_name(tmp_path, make, message):
    with pytest.raises(InvalidArgumentError, match=message), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        read_corpus(make(tmp_path))


# --- building and searching -----------------------------------------------------------------


def test_chunks_are_overlapping_slices_of_the_documents_tokens(built, documents, tokenizer):
    chunks = [built.chunk(i) for i in range(len(built))]
    assert len(chunks) > len(documents)  # the documents are longer than one chunk
    for number, document in enumerate(documents):
        ids = tokenizer.encode(document.text, add_special_tokens=False)
        own = [c for c in chunks if c.id == document.id]
        assert own[0].token_ids == ids[:48] and own[0].metadata == {"n": number}
        for previous, chunk in itertools.pairwise(own):
            assert chunk.token_ids[:8] == previous.token_ids[-8:]
        assert own[-1].token_ids == ids[(len(own) - 1) * 40 :]
        for chunk in own:
            assert chunk.text in document.text and chunk.text.strip() in tokenizer.decode(chunk.token_ids)


def test_search_matches_a_brute_force_cosine_ranking(built, embedder):
    texts = [built.chunk(i).text for i in range(len(built))]
    vectors = embedder.model.encode(texts, normalize_embeddings=True)
    for query in ["what is the capital of france", "how many strings does a violin have", "tides"]:
        reference = embedder.model.encode([query], normalize_embeddings=True)[0] @ vectors.T
        hits = built.search(query, k=4)
        assert [h.chunk for h in hits] == list(np.argsort(-reference)[:4])
        assert [h.score for h in hits] == pytest.approx(sorted(reference, reverse=True)[:4], abs=1e-5)
    assert built.search("capital of france", k=1)[0].title == "title 1"
    assert len(built.search("anything", k=1000)) == len(built)


def test_ivf_search_finds_the_same_best_chunk(tmp_path, documents, tokenizer, embedder, built):
    options = ChunkingOptions(48, 8, ivf_lists=2, ivf_probe=2)
    ivf = CorpusIndex.build(documents, tmp_path / "ivf", tokenizer=tokenizer, embedder=embedder, options=options)
    # Probing every list makes IVF exact.
    for query in ["capital of france", "violin strings", "barking dogs"]:
        assert [h.chunk for h in ivf.search(query, 3)] == [h.chunk for h in built.search(query, 3)]
    with pytest.raises(InvalidArgumentError, match="ivf_lists .* must not exceed the number of chunks"):
        CorpusIndex.build(documents, tmp_path / "ivf2", tokenizer=tokenizer, embedder=embedder, options=ChunkingOptions(48, 8, ivf_lists=999))


def test_the_datastore_holds_every_documents_tokens(built, documents, tokenizer):
    assert built.datastore.num_documents == len(documents)
    assert built.datastore.num_tokens == sum(len(tokenizer.encode(d.text)) for d in documents)
    retrieval = built.datastore.retrieve(tokenizer.encode("the eiffel tower"), m=5)
    assert tokenizer.decode(retrieval.continuations[0]) == " stan"


def test_retrieved_chunks_draft_losslessly_through_the_engine(built, tokenizer):
    model = tiny_model("llama", seed=1)
    hits = built.search("capital of france", k=2)
    prompt = tokenizer.encode(rag_messages("capital of france?", hits)[1]["content"][-200:])
    engine = SpeculativeEngine(model, tokenizer, [NGramTrieDrafter(), RESTDrafter(built.datastore)])
    result = engine.generate(prompt, documents=drafting_documents(hits), max_new_tokens=40)
    assert result.token_ids == hf_greedy(model, prompt, 40)


def test_rag_messages_number_the_passages(built):
    hits = built.search("capital of france", k=2)
    system, user = rag_messages("Where is the Eiffel tower?", hits)
    assert system["role"] == "system" and user["content"].startswith(f"Passages:\n[1] {hits[0].title}\n{hits[0].text}")
    assert user["content"].endswith("\n\nQuestion: Where is the Eiffel tower?")


# --- saving, reloading, rebuilding ----------------------------------------------------------


def test_rebuilding_the_same_inputs_does_nothing(built, documents, tokenizer, embedder):
    manifest = built.path / "manifest.json"
    before = manifest.stat().st_mtime_ns
    messages = []
    again = CorpusIndex.build(documents, built.path, tokenizer=tokenizer, embedder=embedder, options=OPTIONS, log=messages.append)
    assert manifest.stat().st_mtime_ns == before and messages == [f"{built.path} is up to date ({len(built)} chunks)"]
    assert len(again) == len(built)


def test_an_interrupted_rebuild_leaves_the_previous_index(built, documents, tokenizer, embedder, monkeypatch):
    def crash(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(Datastore, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        CorpusIndex.build(documents[:2], built.path, tokenizer=tokenizer, embedder=embedder, options=OPTIONS)
    assert sorted(os.listdir(built.path.parent)) == ["index"]  # no staging folder left behind
    reloaded = CorpusIndex.load(built.path, tokenizer=tokenizer, embedder=embedder)
    assert len(reloaded) == len(built) and reloaded.manifest == built.manifest


def test_changed_inputs_rebuild_in_place(built, documents, tokenizer, embedder):
    smaller = CorpusIndex.build(documents[:2], built.path, tokenizer=tokenizer, embedder=embedder, options=OPTIONS)
    assert smaller.manifest["documents"] == 2
    assert CorpusIndex.load(built.path).manifest["build_key"] == smaller.manifest["build_key"]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: (p / "chunk_tokens.npy").write_bytes((p / "chunk_tokens.npy").read_bytes()[:-4]), "chunk_tokens.npy has .* bytes, .* were written"),
        (lambda p: _flip_last_byte(p / "vectors.faiss"), "vectors.faiss does not match its checksum"),
        (lambda p: (p / "chunks.jsonl").unlink(), "chunks.jsonl is missing"),
        (lambda p: (p / "manifest.json").write_text("{oops"), "manifest.json is not valid JSON"),
        (lambda p: _edit_manifest(p, format_version=99), "format version 99"),
        (lambda p: _flip_last_byte(p / "datastore" / "tokens.npy"), "tokens.npy does not match its checksum"),
    ],
)
def test_damaged_indexes_are_refused_with_the_file_named(built, damage, message):
    damage(built.path)
    with pytest.raises(CorpusIndexError, match=message) as error:
        CorpusIndex.load(built.path)
    assert "rag-speculate index CORPUS --out" in str(error.value)


def test_missing_and_foreign_folders_are_refused(tmp_path, documents, tokenizer, embedder):
    with pytest.raises(CorpusIndexError, match="no corpus index at"):
        CorpusIndex.load(tmp_path / "nowhere")
    foreign = tmp_path / "photos"
    foreign.mkdir()
    (foreign / "cat.jpg").write_bytes(b"\xff\xd8")
    with pytest.raises(CorpusIndexError, match="is not a corpus index"):
        CorpusIndex.load(foreign)
    with pytest.raises(CorpusIndexError, match="exists and is not a corpus index; refusing to replace it"):
        CorpusIndex.build(documents, foreign, tokenizer=tokenizer, embedder=embedder, options=OPTIONS)
    assert os.listdir(foreign) == ["cat.jpg"]


def test_another_tokenizer_is_refused_before_any_search(built):
    with pytest.raises(CorpusIndexError, match="another tokenizer"):
        CorpusIndex.load(built.path, tokenizer=char_tokenizer("abc "))
    with pytest.raises(CorpusIndexError, match="another tokenizer"):
        built.check_tokenizer(char_tokenizer("abc "))


def test_another_embedding_model_is_refused_even_under_the_same_name(built, embedder):
    other = load_embedder(embedder.name)
    with torch.no_grad():
        next(other.model.parameters()).add_(0.01)
    with pytest.raises(CorpusIndexError, match="was built with embedding model .* weights differ"):
        CorpusIndex.load(built.path, embedder=other)


@pytest.mark.parametrize(("query", "k", "message"), [("", 3, "query is empty"), ("  ", 3, "query is empty"), ("x", 0, "k must be"), ("x", "3", "k must be")])
def test_bad_searches_are_refused(built, query, k, message):
    with pytest.raises(InvalidArgumentError, match=message):
        built.search(query, k)


@pytest.mark.parametrize(
    ("options", "message"),
    [(ChunkingOptions(0, 0), "chunk_tokens >= 1"), (ChunkingOptions(8, 8), "chunk_overlap < chunk_tokens"), (ChunkingOptions(8, -1), "chunk_overlap must be"), (ChunkingOptions(8, 2, 1, 0), "ivf_probe")],
)
def test_bad_options_are_refused(tmp_path, documents, tokenizer, embedder, options, message):
    with pytest.raises(InvalidArgumentError, match=message):
        CorpusIndex.build(documents, tmp_path / "x", tokenizer=tokenizer, embedder=embedder, options=options)
    with pytest.raises(InvalidArgumentError, match="non-empty list of Document"):
        CorpusIndex.build([], tmp_path / "x", tokenizer=tokenizer, embedder=embedder)


def _flip_last_byte(file) -> None:
    data = bytearray(file.read_bytes())
    data[-1] ^= 0xFF
    file.write_bytes(bytes(data))


def _edit_manifest(path, **changes) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    manifest.update(changes)
    (path / "manifest.json").write_text(json.dumps(manifest))

