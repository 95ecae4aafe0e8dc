"""`rag-speculate index`, `ask` and `demo` end to end on the small packaged model and the packaged embeddings."""

from __future__ import annotations

import pytest
from packaged_fixtures import MODEL

from rag_speculate.entrypoints.cli import main

COMMON = ["--model", MODEL, "--threads", "1"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    (folder / "reading.txt").write_text(
        "Reading Football Club is owned by Dai Yongge and Dai Xiu Li, who bought the club in 2017.", encoding="utf-8"
    )
    (folder / "violin.md").write_text("The violin has four strings tuned in perfect fifths.", encoding="utf-8")
    (folder / "broken.txt").write_bytes(b"\xff\xfe not utf-8 \x80")
    return folder


@pytest.fixture(scope="module")
def index(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("built") / "index"
    with pytest.warns(RuntimeWarning, match=r"skipped 1 unreadable entries.*broken.txt"):
        assert main(["index", str(corpus), "--out", str(out), *COMMON]) == 0
    return out


def test_index_reports_what_it_built_and_rebuilds_nothing_the_second_time(index, corpus, capsys):
    with pytest.warns(RuntimeWarning, match="skipped 1"):
        assert main(["index", str(corpus), "--out", str(index), *COMMON]) == 0
    captured = capsys.readouterr()
    assert f"Index {index}: 2 documents, 2 chunks" in captured.out
    assert f"{index} is up to date" in captured.err


def test_ask_answers_with_sources_and_stats(index, capsys):
    assert main(["ask", str(index), "Who owns Reading Football Club?", "-k", "1", "--max-new-tokens", "24", *COMMON]) == 0
    out = capsys.readouterr().out
    assert "Answer:\n" in out
    assert "Sources:\n  [1] " in out and ": 'Reading Football Club is owned" in out
    assert "tokens/forward" in out


def test_ask_with_a_draft_model_gives_the_same_answer(index, capsys):
    question = ["ask", str(index), "Who owns Reading Football Club?", "-k", "1", "--max-new-tokens", "24", *COMMON]
    answers = []
    for extra in ([], ["--draft-model", MODEL]):
        assert main([*question, *extra]) == 0
        out = capsys.readouterr().out
        answers.append(out.split("Answer:\n")[1].split("\n\nSources:")[0])
    assert answers[0] == answers[1] and answers[0].strip()


def test_an_index_built_with_a_folder_embedder_is_asked_with_that_folder(corpus, tmp_path, capsys):
    from rag_speculate.retrieval.embedding import packaged_embedding_path

    folder, out = str(packaged_embedding_path()), tmp_path / "index"
    with pytest.warns(RuntimeWarning, match="skipped 1"):
        assert main(["index", str(corpus), "--out", str(out), "--embedding-model", folder, *COMMON]) == 0
    question = ["ask", str(out), "Who owns Reading Football Club?", "-k", "1", "--max-new-tokens", "4", *COMMON]
    assert main(question) == 1  # the manifest names a path, which an index never opens
    assert "never opens a path" in capsys.readouterr().err
    assert main([*question, "--embedding-model", folder]) == 0
    assert ": 'Reading Football Club is owned" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["ask", "{index}", "  "], "query is empty"),
        (["ask", "{index}", "q", "-k", "0"], "k must be an integer >= 1"),
        (["ask", "{missing}", "q"], "no corpus index at"),
        (["index", "{missing}", "--out", "{missing}x"], "does not exist"),
        (["ask", "{index}", "q", "--device", "cpu", "--cuda-graphs"], "cuda_graphs=True, but the model is on cpu"),
    ],
)
def test_bad_input_is_named_and_fails_the_command(index, tmp_path, capsys, argv, message):
    argv = [a.format(index=index, missing=tmp_path / "missing") for a in argv]
    assert main([*argv, *COMMON]) == 1
    assert message in capsys.readouterr().err


def test_index_never_replaces_a_folder_it_did_not_write(corpus, tmp_path, capsys):
    """A project folder that happens to hold a manifest.json, and a file, named by --out: refused in
    one line naming them, and left as they were."""
    project = tmp_path / "p"
    (project / "src").mkdir(parents=True)
    (project / "manifest.json").write_text('{"name": "app"}')
    (project / "src" / "important.txt").write_text("work")
    file = tmp_path / "notes.txt"
    file.write_text("mine")
    for out, problem in ((project, "exists and is not a corpus index; refusing"), (file, "is not a folder; refusing")):
        with pytest.warns(RuntimeWarning, match="skipped 1"):
            assert main(["index", str(corpus), "--out", str(out), *COMMON]) == 1
        error = capsys.readouterr().err.splitlines()[-1]
        assert error == f"rag-speculate index: {out} {problem} to replace it (choose another --out)"
    assert (project / "src" / "important.txt").read_text() == "work" and (project / "manifest.json").exists()
    assert file.read_text() == "mine"


def test_demo_indexes_the_shipped_corpus_and_answers_identically(tmp_path, capsys):
    # Both cores: embedding the shipped corpus is most of this test.
    argv = ["demo", "--index-dir", str(tmp_path / "nq"), "--max-new-tokens", "24", "--model", MODEL, "--threads", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Question: who got the first nobel prize in physics" in out
    assert "List of Nobel laureates in Physics" in out  # the gold passage is retrieved
    assert "identical output: True" in out


def test_serve_answers_over_http_and_retrieves_from_its_index(index, tmp_path):
    """`rag-speculate serve --index` as users start it: its own process, uvicorn, a port on 127.0.0.1."""
    import subprocess
    import sys
    import time

    import httpx

    from rag_speculate.entrypoints.openai.background import free_port

    port = free_port()
    command = [sys.executable, "-m", "rag_speculate", "serve", "--index", str(index), "--port", str(port),
               "--dtype", "float32", "--device", "cpu", *COMMON]
    log = (tmp_path / "serve.log").open("w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Who owns Reading Football Club?"}],
                "max_tokens": 16, "temperature": 0, "retrieve": 1}
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120).json()
        assert answer["choices"][0]["message"]["content"]
        assert answer["sources"][0]["text"].startswith("Reading Football Club")
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


@pytest.fixture
def bad_gguf(tmp_path):
    """The packaged model's GGUF file cut to its first 4 KiB: its tensor table claims far more than is there."""
    from rag_speculate.models.gguf_file import gguf_path

    path = tmp_path / "BAD.gguf"
    with gguf_path(MODEL).open("rb") as file:
        path.write_bytes(file.read(4096))
    return path


@pytest.mark.parametrize(
    ("command", "quantization"),
    [("serve", []), ("serve", ["--quantization", "gguf"]), ("serve", ["--ray"]), ("ask", []), ("ask", ["--quantization", "int8"])],
)
def test_a_bad_model_file_is_one_line_naming_it_and_fails_the_command(index, bad_gguf, command, quantization):
    """As users run it, its own process: the error the loader raises, printed once, no traceback."""
    import subprocess
    import sys

    where = ["ask", str(index), "Who owns Reading Football Club?"] if command == "ask" else ["serve"]
    argv = [sys.executable, "-m", "rag_speculate", *where, "--model", str(bad_gguf), "--device", "cpu", *quantization]
    child = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert child.returncode == 1 and child.stdout == ""
    assert "Traceback" not in child.stderr
    # Importing torch and its extensions may log lines of their own first: the command's are counted.
    ours = [line for line in child.stderr.splitlines() if line.startswith("rag-speculate")]
    assert ours == [child.stderr.splitlines()[-1]]
    assert ours[0].startswith(f"rag-speculate {command}: {bad_gguf} is not a usable GGUF file: truncated or damaged")


def test_demo_with_a_bad_model_file_fails_in_one_line_naming_it(bad_gguf, tmp_path, capsys):
    assert main(["demo", "--index-dir", str(tmp_path / "nq"), "--model", str(bad_gguf), "--threads", "1"]) == 1
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 1 and errors[0].startswith(f"rag-speculate demo: {bad_gguf} is not a usable GGUF file")
