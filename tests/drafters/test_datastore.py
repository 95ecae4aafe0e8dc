"""The REST datastore and drafter: retrieval against a naive scan, files, corruption, losslessness."""

from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest
from conftest import VOCAB, char_tokenizer, hf_greedy, tiny_model

import rag_speculate.drafters.rest.datastore_format as datastore_format
from rag_speculate import Datastore, DatastoreError, DraftContext, InvalidArgumentError, RESTDrafter, SpeculativeEngine
from rag_speculate.decoding.budget import CostModel
from rag_speculate.drafters.rest.datastore import tokenizer_fingerprint


def naive_retrieve(documents: list[list[int]], context: list[int], n_max: int, m: int) -> tuple[int, list[list[int]]]:
    """Algorithm 1 of the paper by brute force: the longest suffix with a continuation anywhere."""
    for n in range(min(n_max, len(context)), 0, -1):
        query = list(context[-n:])
        found = [doc[i + n : i + n + m] for doc in documents for i in range(len(doc) - n) if doc[i : i + n] == query]
        if found:
            return n, sorted(found)
    return 0, []


def random_corpus(rng: random.Random, vocab: int) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(rng.randrange(0, 80))] for _ in range(rng.randrange(1, 6))]


def random_context(rng: random.Random, documents: list[list[int]], vocab: int) -> list[int]:
    noise = [rng.randrange(vocab) for _ in range(rng.randrange(0, 5))]
    nonempty = [doc for doc in documents if doc]
    if rng.random() < 0.3 or not nonempty:
        return noise + [rng.randrange(vocab) for _ in range(rng.randrange(0, 20))]
    doc = rng.choice(nonempty)
    end = rng.randrange(len(doc))
    return noise + doc[max(0, end - rng.randrange(25)) : end + 1]


@pytest.fixture
def store_dir(tmp_path):
    return tmp_path / "store"


def small_store(vocab: int = 50) -> tuple[Datastore, list[list[int]]]:
    rng = random.Random(7)
    documents = [[rng.randrange(vocab) for _ in range(200)] for _ in range(3)]
    return Datastore.build(documents, vocab_size=vocab), documents


# --- retrieval ------------------------------------------------------------------------------


# 3 and 7: long and repeated matches; 7, 300 and 70,000: one-, two- and three-byte codes in the sort.
@pytest.mark.parametrize("vocab", [3, 7, 300, 70_000])
def test_retrieval_equals_a_naive_scan_with_appended_documents(vocab):
    rng = random.Random(vocab)
    for _ in range(12):
        documents = random_corpus(rng, vocab)
        if not any(documents):
            continue
        datastore = Datastore.build(documents, vocab_size=vocab)
        appended = random_corpus(rng, vocab)[:2]
        for doc in appended:
            datastore.append(doc)
        everything = documents + appended
        for _ in range(25):
            context = random_context(rng, everything, vocab)
            n_max, m = rng.randrange(1, 20), rng.randrange(1, 12)
            retrieval = datastore.retrieve(context, n_max=n_max, m=m, max_matches=10**9)
            length, continuations = naive_retrieve(everything, context, n_max, m)
            assert (retrieval.match_length, sorted(retrieval.continuations)) == (length, continuations)
            assert retrieval.occurrences == len(continuations)


def test_max_matches_reads_an_even_spread_of_the_occurrences():
    # "1 2" occurs 100 times; the occurrences are ordered by the token before them, which here
    # also decides what follows, so the first ten alone would all continue with 10.
    documents = [[3 + i // 20, 1, 2, 10 + i // 20] for i in range(100)]
    retrieval = Datastore.build(documents, vocab_size=20).retrieve([0, 1, 2], max_matches=10)
    assert (retrieval.match_length, retrieval.occurrences) == (2, 100)
    assert sorted(retrieval.continuations) == [[10 + i // 2] for i in range(10)]


def test_continuations_stop_at_the_document_end_and_backoff_skips_matches_without_one():
    datastore = Datastore.build([[5, 6, 7, 8], [9, 6, 7]], vocab_size=10)
    # "9 6 7" ends its document: nothing follows it there, so the match backs off to "6 7".
    retrieval = datastore.retrieve([9, 6, 7], m=5)
    assert (retrieval.match_length, retrieval.continuations) == (2, [[8]])
    assert datastore.retrieve([5, 6], m=5).continuations == [[7, 8]]
    assert datastore.retrieve([8], m=5).match_length == 0
    # Ids the datastore cannot hold end the query instead of failing.
    assert datastore.retrieve([5, 6, 7, 10**12], m=5).match_length == 0


def test_drafter_keeps_the_most_frequent_continuations_within_budget():
    datastore = Datastore.build([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 5, 6], [7, 2, 3, 9]], vocab_size=10)
    drafter = RESTDrafter(datastore, n_max=4, m=3)
    drafter.start(DraftContext([], [], 10))
    tree = drafter.propose([0, 1, 2], budget=3)
    # After "1 2": "3" twice, then "4" twice, then "5" once; "3 9" follows "7 2", not "1 2". A corpus
    # match is weak evidence (REST_MATCH_PRIORS), so each token deeper costs more than a rarer sibling.
    assert (tree.tokens, tree.parents, tree.sources) == ([3, 5, 4], [-1, -1, 0], ["rest"] * 3)
    assert tree.scores[0] > tree.scores[1] > tree.scores[2]
    assert len(drafter.propose([0, 1, 2], budget=0)) == 0
    assert len(drafter.propose([8], budget=5)) == 0


# --- files ----------------------------------------------------------------------------------


def test_save_and_memory_mapped_load_round_trip(store_dir, tokenizer):
    texts = ["the quick brown fox", "jumps over the lazy dog", "the quick brown cat"]
    datastore = Datastore.from_texts(texts, tokenizer)
    assert datastore.num_tokens == sum(map(len, texts)) and datastore.num_documents == 3
    datastore.save(store_dir)
    header = json.loads((store_dir / "datastore.json").read_text())
    assert header["format_version"] == datastore_format.FORMAT_VERSION
    assert header["tokenizer_fingerprint"] == tokenizer_fingerprint(tokenizer)
    assert (header["vocab_size"], header["documents"], header["tokens"]) == (len(tokenizer), 3, datastore.num_tokens)
    assert all(len(spec["sha256"]) == 64 for spec in header["arrays"].values())

    loaded = Datastore.load(store_dir, tokenizer)
    assert isinstance(loaded._main.tokens.base, np.memmap) and isinstance(loaded._main.ends.base, np.memmap)
    context = tokenizer.encode("over the quick")
    assert loaded.retrieve(context) == datastore.retrieve(context)
    assert tokenizer.decode(loaded.retrieve(context, m=6).continuations[0]) == " brown"
    with pytest.raises(ValueError):
        loaded._main.tokens[1] = 0  # read-only mapping: a datastore on disk is never written through


def test_tokenizer_mismatch_is_refused(store_dir, tokenizer):
    Datastore.from_texts(["some text"], tokenizer).save(store_dir)
    other = char_tokenizer()
    other.add_special_tokens({"additional_special_tokens": ["<tool>"]})
    assert tokenizer_fingerprint(other) != tokenizer_fingerprint(tokenizer) == tokenizer_fingerprint(char_tokenizer())
    with pytest.raises(DatastoreError, match="another tokenizer.*rebuild"):
        Datastore.load(store_dir, other)


@pytest.mark.parametrize("name", ["tokens", "ends"])
def test_truncated_array_is_detected(store_dir, name):
    small_store()[0].save(store_dir)
    file = store_dir / f"{name}.npy"
    file.write_bytes(file.read_bytes()[:-40])
    with pytest.raises(DatastoreError, match=f"{name}.npy is truncated.*rebuild"):
        Datastore.load(store_dir, verify=False)


def test_flipped_byte_fails_the_checksum(store_dir):
    small_store()[0].save(store_dir)
    file = store_dir / "ends.npy"
    data = bytearray(file.read_bytes())
    data[-7] ^= 0x10
    file.write_bytes(bytes(data))
    with pytest.raises(DatastoreError, match="ends.npy does not match its checksum.*rebuild"):
        Datastore.load(store_dir)


def test_missing_corrupt_or_newer_header_is_detected(store_dir):
    store_dir.mkdir()
    with pytest.raises(DatastoreError, match="not a datastore"):
        Datastore.load(store_dir)
    (store_dir / "datastore.json").write_text("{not json")
    with pytest.raises(DatastoreError, match="datastore.json is corrupt.*rebuild"):
        Datastore.load(store_dir)
    (store_dir / "datastore.json").unlink()  # a header that says nothing is not ours to replace
    small_store()[0].save(store_dir)
    header = json.loads((store_dir / "datastore.json").read_text())
    (store_dir / "datastore.json").write_text(json.dumps({**header, "format_version": 99}))
    with pytest.raises(DatastoreError, match="format version 99.*rebuild"):
        Datastore.load(store_dir)


def test_interrupted_save_leaves_the_previous_datastore_intact(store_dir, monkeypatch):
    old, old_documents = small_store()
    old.save(store_dir)
    new = Datastore.build([[1, 2, 3]], vocab_size=50)
    real_write = datastore_format._write_array

    def dies_midway(file, array):
        if file.name == "ends.npy":
            file.write_bytes(b"\x93NUMPY half")
            raise OSError("No space left on device")
        return real_write(file, array)

    monkeypatch.setattr(datastore_format, "_write_array", dies_midway)
    with pytest.raises(OSError, match="No space"):
        new.save(store_dir)
    assert sorted(p.name for p in store_dir.parent.iterdir()) == ["store"]  # no staging folder left behind
    reloaded = Datastore.load(store_dir)
    assert reloaded.num_tokens == sum(map(len, old_documents))
    assert reloaded.retrieve(old_documents[1][:20]) == old.retrieve(old_documents[1][:20])

    monkeypatch.setattr(datastore_format, "_write_array", real_write)
    new.save(store_dir)
    assert Datastore.load(store_dir).num_tokens == 3


def test_refuses_to_replace_a_folder_that_is_not_a_datastore(store_dir):
    store_dir.mkdir()
    (store_dir / "notes.txt").write_text("mine")
    with pytest.raises(DatastoreError, match="not a datastore; refusing"):
        small_store()[0].save(store_dir)
    assert (store_dir / "notes.txt").read_text() == "mine"


def test_refuses_to_replace_a_folder_whose_header_is_not_a_datastores(store_dir):
    """Only the "format" field we write makes a folder ours: a datastore.json of something else does not."""
    store_dir.mkdir()
    (store_dir / "datastore.json").write_text('{"name": "app"}')
    (store_dir / "notes.txt").write_text("mine")
    with pytest.raises(DatastoreError, match="not a datastore; refusing"):
        small_store()[0].save(store_dir)
    assert (store_dir / "notes.txt").read_text() == "mine"
    shutil.rmtree(store_dir)
    small_store()[0].save(store_dir)
    (store_dir / "notes.txt").write_text("mine")  # in a datastore of ours, it is still not ours to delete
    with pytest.raises(DatastoreError, match=r"holds files a datastore does not \(notes.txt\); refusing"):
        small_store()[0].save(store_dir)
    assert (store_dir / "notes.txt").read_text() == "mine"


def test_appended_output_is_found_and_kept_by_save(store_dir):
    datastore, documents = small_store()
    output = [40, 41, 42, 43, 44, 45, 46, 47]
    assert datastore.retrieve([40, 41, 42, 43]).match_length < 4
    datastore.append(output)
    datastore.append([])  # an empty output adds nothing
    assert datastore.num_documents == 4
    assert datastore.retrieve([40, 41, 42, 43]).continuations == [[44, 45, 46, 47]]
    datastore.save(store_dir)
    reloaded = Datastore.load(store_dir)
    assert (reloaded.num_documents, reloaded.num_tokens) == (4, 600 + len(output))
    assert reloaded.retrieve([40, 41, 42, 43]).continuations == [[44, 45, 46, 47]]
    context = documents[2][50:60]
    assert reloaded.retrieve(context) == datastore.retrieve(context)
    # Saving over the folder the datastore is memory-mapped from.
    reloaded.append([45, 46, 47, 48, 49])
    reloaded.save(store_dir)
    again = Datastore.load(store_dir)
    assert again.num_documents == 5
    assert sorted(again.retrieve([45, 46, 47]).continuations) == [[48, 49]]


# --- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("token_ids", "message"),
    [
        ([], "token_ids is empty"),
        ([[], []], "token_ids is empty"),
        ([[1, 2], [3, 100]], r"token_ids\[1\] has token id 100, outside \[0, vocab_size=100\)"),
        ([[1, -2]], r"token_ids\[0\] has token id -2"),
        ([[1.5, 2.0]], r"token_ids\[0\] must be a list of int token ids"),
        ("abc", "token_ids must be a list of documents"),
    ],
)
def test_bad_corpus_is_refused(token_ids, message):
    with pytest.raises(InvalidArgumentError, match=message):
        Datastore.build(token_ids, vocab_size=100)


def test_bad_arguments_are_refused(tokenizer):
    datastore, _ = small_store()
    for kwargs, name in (({"n_max": 0}, "n_max"), ({"m": 0}, "m"), ({"max_matches": 0}, "max_matches")):
        with pytest.raises(InvalidArgumentError, match=f"{name} must be an integer >= 1"):
            datastore.retrieve([1, 2], **kwargs)
        with pytest.raises(InvalidArgumentError, match=f"{name} must be an integer >= 1"):
            RESTDrafter(datastore, **kwargs)
    with pytest.raises(InvalidArgumentError, match="vocab_size or tokenizer"):
        Datastore.build([[1]])
    with pytest.raises(InvalidArgumentError, match="vocab_size must be"):
        Datastore.build([[1]], vocab_size=0)
    with pytest.raises(InvalidArgumentError, match="token_ids is empty"):
        Datastore.from_texts([], tokenizer)
    with pytest.raises(InvalidArgumentError, match="texts must be a list of strings"):
        Datastore.from_texts("one text", tokenizer)
    with pytest.raises(InvalidArgumentError, match="token_ids has token id 50, outside"):
        datastore.append([1, 50])
    with pytest.raises(DatastoreError, match="larger than the model's"):
        SpeculativeEngine(tiny_model("llama", vocab_size=40), tokenizer, RESTDrafter(datastore))


def test_an_engine_refuses_a_datastore_of_another_tokenizer(tokenizer):
    other = char_tokenizer("abcdefghij ")
    store = Datastore.from_texts(["abc def"], other)
    with pytest.raises(DatastoreError, match="another tokenizer"):
        SpeculativeEngine(tiny_model("llama"), tokenizer, RESTDrafter(store))


# --- through the engine ---------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_rest_drafter_is_lossless_through_the_engine(arch, tokenizer):
    model = tiny_model(arch)
    prompt = tokenizer.encode("the quick brown fox jumps over the lazy dog. the quick")
    reference = hf_greedy(model, prompt, 48)
    unrelated = tokenizer.encode("completely unrelated text about cats and hats")
    # The model's vocabulary, not the tokenizer's: a random model emits ids the tokenizer lacks.
    stores = {
        "helpful": Datastore.build([unrelated, reference], vocab_size=VOCAB),
        "unrelated": Datastore.build([unrelated], vocab_size=VOCAB),
    }
    results = {}
    for name, store in stores.items():
        engine = SpeculativeEngine(model, tokenizer, RESTDrafter(store))
        # Pinned flat costs: whether REST's cautious priors pay must not hang on a tiny model's timing noise.
        engine.cost_model = CostModel({1: 1.0, 65: 1.0}, learn=False)
        results[name] = engine.generate(prompt, max_new_tokens=48)
    for result in results.values():
        assert result.token_ids == reference
    assert results["helpful"].stats.tokens_per_forward > 2
    assert results["helpful"].stats.accepted_tokens["rest"] > 0
