"""What retrieval reads back from disk is checked before use, and a replacement killed halfway leaves
a loadable folder: every field of an index manifest, a datastore header and a phrase pool file is
checked against a schema; the arrays' invariants are checked even when an edit kept the checksums
right; the manifest's embedding model is a name, never a path to open; a process killed between
the two renames of a replacement leaves the old folder loadable, and its leftovers are removed."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import char_tokenizer

from rag_speculate import Datastore, DatastoreError
from rag_speculate.drafters.ouroboros.phrase_pool import PhrasePool, PhrasePoolError
from rag_speculate.files.cache import sha256_file
from rag_speculate.retrieval.corpus import (
    ChunkingOptions,
    CorpusIndex,
    CorpusIndexError,
    Document,
    load_embedder,
    packaged_embedding_path,
)

TESTS = Path(__file__).parents[1]  # where the payloads import conftest from
TEXTS = [
    "the cat sat on the mat and looked at the rain falling on the garden all afternoon.",
    "paris is the capital of france; the eiffel tower stands on the left bank of the seine.",
    "a violin has four strings tuned in fifths and is played with a bow of horse hair.",
]
OPTIONS = ChunkingOptions(chunk_tokens=48, chunk_overlap=8)
DELETE = object()
DEEP = "[" * 100_000 + "]" * 100_000  # parsing it recurses past Python's limit

# Run in a child process before what it replaces: the child is SIGKILLed right after it moves the
# folder at sys.argv[1] aside, before the new folder takes its place (a real kill, no cleanup runs).
KILLED_BETWEEN_RENAMES = """
import os, signal, sys
from pathlib import Path
target = Path(sys.argv[1]).absolute()

def dying(real):
    def rename(src, dst, *args, **kwargs):
        real(src, dst, *args, **kwargs)
        if Path(src).absolute() == target:
            os.kill(os.getpid(), signal.SIGKILL)
    return rename

os.rename, os.replace = dying(os.rename), dying(os.replace)
"""


def _run_killed(payload: str, target: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", KILLED_BETWEEN_RENAMES + payload, str(target)]
    child = subprocess.run(command, check=False, capture_output=True, text=True, cwd=TESTS)
    assert child.returncode == -signal.SIGKILL, child.stderr  # it died where the test means it to
    return child


@pytest.fixture(scope="module")
def embedder():
    return load_embedder()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, tokenizer, embedder) -> Path:
    out = tmp_path_factory.mktemp("pristine") / "index"
    documents = [Document(text, f"title {i}", f"doc-{i}", {"n": i}) for i, text in enumerate(TEXTS)]
    CorpusIndex.build(documents, out, tokenizer=tokenizer, embedder=embedder, options=OPTIONS)
    return out


@pytest.fixture
def index(pristine, tmp_path) -> Path:
    """A private copy of a built index, safe to damage."""
    copy = tmp_path / "index"
    shutil.copytree(pristine, copy)
    return copy


def _json(file: Path) -> dict:
    return json.loads(file.read_text())


def _edit(file: Path, field: str | tuple[str, ...], value: object) -> None:
    """Set (or, with DELETE, remove) `field` of a JSON file: a dotted name, or a tuple of keys where
    a key holds a dot of its own (the file names in an index manifest)."""
    data = _json(file)
    *parents, key = field.split(".") if isinstance(field, str) else field
    parent = data
    for name in parents:
        parent = parent[name]
    if value is DELETE:
        del parent[key]
    else:
        parent[key] = value
    file.write_text(json.dumps(data))


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def _rewrite(index: Path, name: str, data: bytes) -> None:
    """Replace one of the index's files and update its size and checksum in the manifest to match:
    only the invariants between the files can tell."""
    (index / name).write_bytes(data)
    manifest = _json(index / "manifest.json")
    manifest["files"][name] = {"bytes": len(data), "sha256": sha256_file(index / name)}
    (index / "manifest.json").write_text(json.dumps(manifest))


# --- the index manifest ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("embedding", DELETE),
        ("embedding.fingerprint", DELETE),
        ("embedding.dimension", "384"),
        ("embedding.query_instruction", None),
        ("options.ivf_lists", "2"),
        ("options.ivf_probe", -1),
        (("files", "vectors.faiss"), DELETE),
        (("files", "chunks.jsonl", "bytes"), "12"),
        ("tokenizer_fingerprint", 5),
        ("vocab_size", 0),
        ("documents", True),
        ("build_key", ["not", "a", "hash"]),
    ],
)
def test_a_manifest_field_missing_or_mistyped_is_refused_by_name(index, field, value):
    _edit(index / "manifest.json", field, value)
    name = field if isinstance(field, str) else ".".join(field)
    with pytest.raises(CorpusIndexError, match=f"field {re.escape(name)} ") as error:
        CorpusIndex.load(index, tokenizer=char_tokenizer())
    assert "rag-speculate index CORPUS --out" in str(error.value)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("options.chunk_overlap", 48, "chunk_overlap < chunk_tokens"),
        ("chunks", 999, "chunks.jsonl holds 6 chunks, manifest.json counts 999"),
        ("options.ivf_lists", 2, "vectors.faiss is not an IVF index of 2 lists"),
    ],
)
def test_manifest_fields_that_disagree_with_each_other_or_the_files_are_refused(index, field, value, message):
    _edit(index / "manifest.json", field, value)
    with pytest.raises(CorpusIndexError, match=message):
        CorpusIndex.load(index)


def test_a_manifest_nested_past_the_parsers_limit_is_refused(index):
    (index / "manifest.json").write_text('{"format": "rag-speculate corpus index", "format_version": 1, "x": ' + DEEP + "}")
    with pytest.raises(CorpusIndexError, match="manifest.json is not valid JSON"):
        CorpusIndex.load(index)


def test_the_embedding_name_is_never_opened_as_a_path(index, tmp_path, embedder, monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(packaged_embedding_path(), elsewhere)
    _edit(index / "manifest.json", "embedding.name", str(elsewhere))
    import sentence_transformers

    opened = []
    real = sentence_transformers.SentenceTransformer
    monkeypatch.setattr(sentence_transformers, "SentenceTransformer", lambda source, **kw: opened.append(source) or real(source, **kw))
    with pytest.raises(CorpusIndexError, match="embedding.name .* not a model name"):
        CorpusIndex.load(index)
    assert opened == []
    # The caller's own model, matched by its weights, opens the index whatever the manifest calls it.
    assert CorpusIndex.load(index, embedder=embedder).search("capital of france", 1)[0].title == "title 1"


# --- what a build may replace, and what it says when it cannot write ---------------------------


def test_only_a_folder_an_index_build_wrote_is_replaced(tmp_path, index, tokenizer, embedder):
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "manifest.json").write_text('{"name": "app"}')  # a manifest, but not one of ours
    (project / "src" / "important.txt").write_text("work")
    (index / "notes.txt").write_text("mine")  # an index of ours, holding a file of the user's
    documents = [Document("one short document")]
    for out, problem in ((project, "exists and is not a corpus index"), (index, r"holds files a corpus index does not \(notes.txt\)")):
        with pytest.raises(CorpusIndexError, match=f"{re.escape(str(out))} {problem}; refusing to replace it"):
            CorpusIndex.build(documents, out, tokenizer=tokenizer, embedder=embedder, options=OPTIONS)
    assert (project / "src" / "important.txt").read_text() == "work" and (index / "notes.txt").read_text() == "mine"
    (index / "notes.txt").unlink()
    assert CorpusIndex.build(documents, index, tokenizer=tokenizer, embedder=embedder, options=OPTIONS).manifest["documents"] == 1


def test_a_full_disk_is_one_message_and_the_old_index_survives(small_disk, tokenizer, embedder):
    out = small_disk / "index"
    CorpusIndex.build([Document(text) for text in TEXTS], out, tokenizer=tokenizer, embedder=embedder, options=OPTIONS)
    larger = [Document(f"{text} ({i})") for i in range(40) for text in TEXTS]
    with pytest.raises(CorpusIndexError, match=f"cannot write the corpus index {re.escape(str(out))}: .*(ENOSPC|disk is probably full)"):
        CorpusIndex.build(larger, out, tokenizer=tokenizer, embedder=embedder, options=OPTIONS)
    assert CorpusIndex.load(out, tokenizer=tokenizer, embedder=embedder).manifest["documents"] == len(TEXTS)
    assert os.listdir(small_disk) == ["index"]  # the failed build's staging is gone


@pytest.mark.skipif(os.name != "posix", reason="file ownership and modes are POSIX's")
@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda ix: ix.chmod(0o777), "index is writable by every user"),
        (lambda ix: (ix / "datastore" / "tokens.npy").chmod(0o666), "tokens.npy is writable by every user"),
        (lambda ix: os.chown(ix / "vectors.faiss", 4242, -1), r"vectors.faiss is owned by another user \(uid 4242\)"),
    ],
    ids=["world-writable folder", "world-writable file", "foreign file"],
)
def test_an_index_others_could_have_changed_is_refused(index, change, problem):
    try:
        change(index)
    except PermissionError:
        pytest.skip("only root may give a file to another user")
    with pytest.raises(CorpusIndexError, match=f"corpus index {re.escape(str(index))}: .*{problem}, so another user could have changed it"):
        CorpusIndex.load(index)


# --- the index's files against each other, checksums updated to match ----------------------


def _offsets(index: Path) -> np.ndarray:
    return np.load(index / "chunk_offsets.npy")


def _tokens(index: Path) -> np.ndarray:
    return np.load(index / "chunk_tokens.npy")


def _swapped(offsets: np.ndarray) -> np.ndarray:
    offsets = offsets.copy()
    offsets[[1, 2]] = offsets[[2, 1]]
    return offsets


def _chunk_rows(index: Path) -> list[dict]:
    return [json.loads(line) for line in (index / "chunks.jsonl").read_text().splitlines()]


def _write_rows(index: Path, rows: list) -> None:
    _rewrite(index, "chunks.jsonl", "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows).encode())


def _other_datastore(index: Path) -> None:
    shutil.rmtree(index / "datastore")
    Datastore.from_texts(["another corpus altogether"], char_tokenizer()).save(index / "datastore")


def _vectors_of_dimension(index: Path, dimension: int) -> bytes:
    import faiss

    vectors = faiss.IndexFlatIP(dimension)
    vectors.add(np.eye(len(_offsets(index)) - 1, dimension, dtype=np.float32))
    return faiss.serialize_index(vectors).tobytes()


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda ix: _rewrite(ix, "chunk_offsets.npy", _npy(_swapped(_offsets(ix)))), "chunk_offsets.npy .*increasing"),
        (lambda ix: _rewrite(ix, "chunk_offsets.npy", _npy(_offsets(ix) + np.eye(len(_offsets(ix)), dtype=np.int64)[-1] * 5)), "chunk_offsets.npy .*chunk_tokens.npy"),
        (lambda ix: _rewrite(ix, "chunk_offsets.npy", _npy(_offsets(ix)[:-1])), "chunk_offsets.npy"),
        (lambda ix: _rewrite(ix, "chunk_offsets.npy", _npy(_offsets(ix).astype(np.float64))), "chunk_offsets.npy .*integer"),
        (lambda ix: _rewrite(ix, "chunk_tokens.npy", _npy(_tokens(ix).astype(np.float64))), "chunk_tokens.npy .*integer"),
        (lambda ix: _rewrite(ix, "chunk_tokens.npy", _npy(_tokens(ix) + 1000)), "chunk_tokens.npy .*outside the vocabulary"),
        (lambda ix: _rewrite(ix, "chunk_tokens.npy", b"\x93NUMPY not really"), "chunk_tokens.npy is not a readable array"),
        (lambda ix: _write_rows(ix, ["{broken", *_chunk_rows(ix)[1:]]), "chunks.jsonl line 1 is not valid JSON"),
        (lambda ix: _write_rows(ix, [{**_chunk_rows(ix)[0], "text": 5}, *_chunk_rows(ix)[1:]]), "chunks.jsonl line 1 field text must be a string"),
        (lambda ix: _write_rows(ix, [{**_chunk_rows(ix)[0], "document": 99}, *_chunk_rows(ix)[1:]]), "chunks.jsonl line 1 .*document 99"),
        (lambda ix: _write_rows(ix, _chunk_rows(ix)[1:]), "chunks.jsonl holds .* chunks"),
        (lambda ix: _rewrite(ix, "vectors.faiss", b"not a faiss index"), "vectors.faiss is not a FAISS index"),
        (lambda ix: _rewrite(ix, "vectors.faiss", _vectors_of_dimension(ix, 8)), "vectors.faiss holds"),
        (_other_datastore, "datastore .*disagree"),
    ],
)
def test_files_that_disagree_are_refused_even_with_matching_checksums(index, damage, message):
    damage(index)
    with pytest.raises(CorpusIndexError, match=message) as error:
        CorpusIndex.load(index)
    assert "rag-speculate index CORPUS --out" in str(error.value)


# --- the datastore header and arrays --------------------------------------------------------


@pytest.fixture
def store(tmp_path) -> Path:
    path = tmp_path / "store"
    Datastore.build([[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9, 7, 8]], vocab_size=50).save(path)
    return path


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("vocab_size", "50"),
        ("documents", -3),
        ("tokens", 1.5),
        ("tokenizer_fingerprint", 7),
        ("arrays.tokens.bytes", "x"),
        ("arrays.ends.sha256", None),
        ("arrays.ends", DELETE),
        ("arrays.tokens.shape", [[15]]),
    ],
)
def test_a_datastore_header_field_missing_or_mistyped_is_refused_by_name(store, field, value):
    _edit(store / "datastore.json", field, value)
    with pytest.raises(DatastoreError, match=f"field {field}.*rebuild"):
        Datastore.load(store)


def test_a_datastore_header_nested_past_the_parsers_limit_is_refused(store):
    (store / "datastore.json").write_text('{"format": "rag-speculate-datastore", "x": ' + DEEP + "}")
    with pytest.raises(DatastoreError, match="datastore.json is corrupt"):
        Datastore.load(store)


def _rewrite_array(store: Path, name: str, array: np.ndarray) -> None:
    """Replace one array and update the header to match it: only the arrays' invariants can tell."""
    file = store / f"{name}.npy"
    file.write_bytes(_npy(array))
    header = _json(store / "datastore.json")
    header["arrays"][name].update(shape=list(array.shape), bytes=file.stat().st_size, sha256=sha256_file(file))
    (store / "datastore.json").write_text(json.dumps(header))


def _array(store: Path, name: str) -> np.ndarray:
    return np.load(store / f"{name}.npy").copy()


def _set(array: np.ndarray, position: int, value: int) -> np.ndarray:
    array[position] = value
    return array


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda s: _rewrite_array(s, "ends", _set(_array(s, "ends"), 0, 10_000)), "ends.npy .*outside"),
        (lambda s: _rewrite_array(s, "ends", _set(_array(s, "ends"), 0, -4)), "ends.npy .*outside"),
        (lambda s: _rewrite_array(s, "ends", _set(_array(s, "ends"), 0, 9)), "ends.npy .*separator"),
        (lambda s: _rewrite_array(s, "tokens", _set(_array(s, "tokens"), 1, 60)), "tokens.npy .*vocab_size"),
        (lambda s: _rewrite_array(s, "tokens", _set(_array(s, "tokens"), 4, -1)), "tokens.npy .*2 documents"),
        (lambda s: _rewrite_array(s, "tokens", np.concatenate([_array(s, "tokens"), [1, -1]]).astype(np.int32)), "tokens.npy .*header"),
    ],
)
def test_datastore_arrays_that_disagree_are_refused_even_with_matching_checksums(store, damage, message):
    damage(store)
    with pytest.raises(DatastoreError, match=message):
        Datastore.load(store)


# --- the phrase pool ------------------------------------------------------------------------


@pytest.fixture
def pool_file(tmp_path, tokenizer) -> Path:
    pool = PhrasePool(W=3, beta=4)
    pool.fill_from(tokenizer.encode("the quick brown fox jumps over the lazy dog"))
    path = tmp_path / "pool.json"
    pool.save(path, tokenizer)
    return path


def _with_phrases(file: Path, phrases: list) -> None:
    data = _json(file)
    digest = hashlib.sha256(json.dumps(phrases, separators=(",", ":")).encode()).hexdigest()
    file.write_text(json.dumps({**data, "phrases": phrases, "count": len(phrases), "phrases_sha256": digest}))


@pytest.mark.parametrize(
    ("damage", "field"),
    [
        (lambda f: _edit(f, "W", "3"), "W"),
        (lambda f: _edit(f, "tokenizer_fingerprint", 5), "tokenizer_fingerprint"),
        (lambda f: _edit(f, "count", "1"), "count"),
        (lambda f: _with_phrases(f, [[3, True]]), r"phrases\[0\]\[1\]"),
        (lambda f: _with_phrases(f, [3]), r"phrases\[0\]"),
    ],
)
def test_a_pool_field_missing_or_mistyped_is_refused_by_name(pool_file, tokenizer, damage, field):
    damage(pool_file)
    with pytest.raises(PhrasePoolError, match=f"field {field} .*pool.save"):
        PhrasePool.load(pool_file, tokenizer)


def test_a_pool_nested_past_the_parsers_limit_is_refused(pool_file, tokenizer):
    pool_file.write_text('{"format": "rag-speculate-phrase-pool", "phrases": ' + DEEP + "}")
    with pytest.raises(PhrasePoolError, match="truncated or corrupt"):
        PhrasePool.load(pool_file, tokenizer)


def test_a_pool_save_killed_before_its_rename_leaves_the_old_pool_and_the_next_save_cleans_up(pool_file, tokenizer):
    before = list(PhrasePool.load(pool_file, tokenizer))
    # Killed once the new file is written in full under its temporary name, before it replaces the old one.
    payload = """
from conftest import char_tokenizer
from rag_speculate.drafters.ouroboros.phrase_pool import PhrasePool
real = os.replace
def dying(src, dst):
    if Path(dst).absolute() == target:
        os.kill(os.getpid(), signal.SIGKILL)
    real(src, dst)
os.replace = dying
PhrasePool(W=2, beta=3).save(target, char_tokenizer())
"""
    _run_killed(payload, pool_file)
    assert list(PhrasePool.load(pool_file, tokenizer)) == before
    assert len(os.listdir(pool_file.parent)) == 2  # the pool and the killed save's temporary file
    PhrasePool(W=2, beta=3).save(pool_file, tokenizer)
    assert os.listdir(pool_file.parent) == ["pool.json"]


# --- a replacement killed between its two renames -------------------------------------------


def test_a_datastore_save_killed_between_renames_leaves_the_old_one_loadable(store):
    old = Datastore.load(store)
    _run_killed("from rag_speculate import Datastore\nDatastore.build([[1, 2, 3]], vocab_size=50).save(target)\n", store)
    assert Datastore.load(store).num_tokens == old.num_tokens == 13
    assert os.listdir(store.parent) == ["store"]  # the load put the old one back and removed the staging
    Datastore.build([[1, 2, 3]], vocab_size=50).save(store)
    assert Datastore.load(store).num_tokens == 3


def test_an_index_rebuild_killed_between_renames_leaves_the_old_index_loadable(index, tokenizer, embedder):
    payload = """
from conftest import char_tokenizer
from rag_speculate.retrieval.corpus import ChunkingOptions, CorpusIndex, Document
CorpusIndex.build([Document("one short document")], target, tokenizer=char_tokenizer(), options=ChunkingOptions(48, 8))
"""
    _run_killed(payload, index)
    assert len(os.listdir(index.parent)) > 1  # the killed build's leftovers
    loaded = CorpusIndex.load(index, tokenizer=tokenizer, embedder=embedder)
    assert loaded.manifest["documents"] == len(TEXTS)
    CorpusIndex.build([Document("one short document")], index, tokenizer=tokenizer, embedder=embedder, options=OPTIONS)
    assert os.listdir(index.parent) == ["index"]
    assert CorpusIndex.load(index).manifest["documents"] == 1


def test_a_live_process_staging_is_left_alone_and_a_dead_ones_removed(store):
    script = "import sys, time\nfrom pathlib import Path\nfrom rag_speculate.files.durable import sibling\n" \
        "staging = sibling(Path(sys.argv[1]), 'tmp')\nstaging.mkdir()\nprint(staging, flush=True)\ntime.sleep(600)\n"
    child = subprocess.Popen([sys.executable, "-c", script, str(store)], stdout=subprocess.PIPE, text=True)
    try:
        staging = Path(child.stdout.readline().strip())
        Datastore.load(store)
        assert staging.is_dir()  # its process may still be writing it
    finally:
        child.kill()
        child.wait()
    Datastore.load(store)
    assert not staging.exists()
