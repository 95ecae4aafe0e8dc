"""benchmarks/gpu_check.py, the one command for a GPU machine, run end to end on the CPU with --quick."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from packaged_fixtures import MODEL, installed

REPO = Path(__file__).resolve().parents[2]
TABLES = ("tests.md", "forward_cost.md", "step_overhead.md", "real_weights.md", "real_weights_fp32.md", "forward_graphs.md",
          "throughput.md", "replayed.md")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("gpu_check")
    command = [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--quick", "--out", str(out)]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    return proc, out


def test_quick_run_exits_zero_and_writes_every_table(quick_run):
    proc, out = quick_run
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    for name in TABLES:
        assert (out / name).read_text().startswith("# "), name
    results = json.loads((out / "gpu_check.json").read_text())
    assert results["environment"]["device"] == "cpu" and results["environment"]["dtype"] == "float32"
    assert {"torch", "transformers", "device_name"} <= set(results["environment"])
    assert "errors" not in results


def test_summary_is_printed_last(quick_run):
    proc, out = quick_run
    # Progress goes to stderr: stdout is the summary alone, ending with where the files are.
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("== gpu_check summary")
    assert lines[-1].startswith("results:") and str(out) in lines[-1]
    summary = "\n".join(lines)
    assert "tests: " in summary and " 0 failed" in summary
    assert "t(64)/t(1) tiny-a" in summary and "t(64)/t(1) tiny-b" in summary
    assert "step overhead tiny-a" in summary


def test_forward_cost_covers_every_size_mode_and_context(quick_run):
    _, out = quick_run
    costs = json.loads((out / "gpu_check.json").read_text())["forward_cost"]
    assert set(costs) == {"tiny-a", "tiny-b"}
    for by_context in costs.values():
        assert set(by_context) == {"32", "64"}
        for modes in by_context.values():
            for mode in ("chain", "tree"):
                assert list(modes[mode]) == ["1", "2", "4", "8", "16", "32", "64", "128"]
                assert all(seconds > 0 for seconds in modes[mode].values())


def test_step_overhead_counts_every_step(quick_run):
    _, out = quick_run
    for name, row in json.loads((out / "gpu_check.json").read_text())["step_overhead"].items():
        assert row["steps"] > 0 and row["forward_s"] > 0, name
        # The forwards are part of decode time: what is left over is the engine's own.
        assert row["forward_s"] <= row["decode_s"], name


@pytest.mark.skipif(not installed(MODEL), reason="the packaged SmolLM2-135M is not installed (bash scripts/setup.sh test installs it)")
def test_real_weight_outputs_are_identical_to_greedy(quick_run):
    _, out = quick_run
    section = json.loads((out / "gpu_check.json").read_text())["real_weights"]
    assert section["status"] == "ran", section.get("note")
    assert {"hf-greedy", "hf-pld", "ours-trie"} <= set(section["table"])
    for method, groups in section["table"].items():
        if method.startswith("ours"):
            assert groups["all"]["identical"] == groups["all"]["items"] == 3, method
            assert groups["all"]["decode_tokens_per_s"] > 0
    assert "identical" in (out / "real_weights.md").read_text()


@pytest.fixture
def gpu_check(monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_pytest_counts_read_pytests_last_line(gpu_check):
    stdout = "..F.s\nFAILED tests/test_x.py::test_passed_before - assert 1 passed\n1 failed, 12 passed, 2 skipped, 1 xfailed, 1 error, 3 deselected in 4.2s\n"
    assert gpu_check.pytest_counts(stdout) == {"passed": 12, "failed": 1, "skipped": 2, "errors": 1, "deselected": 3}


def test_speed_table_gives_each_method_its_ratio_to_each_peer(gpu_check):
    def rows(tokens_per_s: list[float], identical: list[bool]) -> list[dict]:
        return [{"category": category, "decode_s": 1.0, "decode_tokens": rate, "identical": same}
                for category, rate, same in zip(("qa", "rag"), tokens_per_s, identical)]

    table = gpu_check.speed_table({"hf-greedy": rows([10, 20], [True, True]),
                                   "hf-static-compiled": rows([40, 40], [True, False]),
                                   "ours-trie": rows([20, 80], [True, True])})
    ours = table["ours-trie"]
    assert ours["qa"]["speedup"] == 2.0 and ours["rag"]["vs_compiled"] == 2.0
    assert ours["all"]["decode_tokens_per_s"] == 50.0
    assert ours["all"]["speedup"] == 50 / 15 and ours["all"]["vs_compiled"] == 50 / 40
    assert table["hf-static-compiled"]["all"]["identical"] == 1
    # Without the compiled peer (a CPU run), no ratio to it.
    assert "vs_compiled" not in gpu_check.speed_table({"hf-greedy": rows([10, 20], [True, True])})["hf-greedy"]["all"]


def test_graph_forward_table_marks_graphs_absent_off_cuda(gpu_check):
    contexts = {32: {"capacity": 64, "eager": {1: 0.002, 2: 0.004}, "graphs": None, "graph_count": 0, "graph_bytes": 0}}
    section = {"cuda": False, "copy_bytes": 2**24, "bandwidth_bytes_per_s": 1e9,
               "archs": {"tiny": {"weight_bytes": 10**6, "contexts": contexts}}}
    table = gpu_check.graph_forward_markdown(section, gpu_check.torch.float32, "a CPU")
    assert "CUDA graphs: not on this device" in table
    # q 2: eager 4 ms, twice t(1), four times the 1 ms floor (1 MB at 1 GB/s); no graph columns.
    assert "| 2 | 0.00400 | - | - | 2.00 | 4.0 |" in table


def test_replayed_tables_say_so_and_set_replayed_beside_achieved(gpu_check):
    runs = {name: [{"category": "rag", "decode_s": 1.0, "decode_tokens": rate, "identical": True}]
            for name, rate in (("hf-greedy", 10), ("ours-replayed", 15))}
    counts = {"replayed": 0.57, "steps": 9, "drawn_per_step": 0.6, "planned_per_step": 0.5, "accepted_per_step": 0.5}
    acceptance = {"ours-replayed": {"rag": counts}}
    arch = {"status": "ran", "max_new_tokens": 16, "context": 32, "notes": ["a note"], "runs": runs,
            "table": gpu_check.speed_table(runs), "acceptance": acceptance}
    section = {"budget": 16, "source": "acceptance_fp32.json", "measured_said": "rag 1.57", "context": 32, "n": 1,
               "archs": {"tiny-a": arch, "tiny-b": arch}}
    table = gpu_check.replayed_markdown(section, gpu_check.torch.float32)
    headings = [line for line in table.splitlines() if line.startswith("#")]
    assert len(headings) == 3 and all("eplayed acceptance" in line for line in headings)
    assert "| ours-replayed | rag | 1 | 1/1 | 15.0 | 1.50 |" in table
    assert "| ours-replayed | rag | 9 | 0.57 | 0.60 | 0.50 | 0.50 |" in table
