"""The package's floors, read from the code's own imports: each part imports only from below it, no
module imports itself back through others, and the CPU kernels load only for a model on the CPU."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "rag_speculate"
# Bottom up: the ground (errors, files, fingerprints, devices), the parts of speculative decoding, the
# drafters, the optional CPU kernels and CUDA graphs, quantized layers, models by name, the engine,
# retrieval, the entrances, and the package's public names. docs/design.md draws the same floors.
FLOORS = {
    "errors": 0, "files": 0, "fingerprint": 0, "devices": 1,
    "decoding": 2,
    "drafters": 3,
    "cpu": 4, "cuda": 4,
    "quantization": 5,
    "models": 6,
    "engine": 7,
    "retrieval": 8,
    "entrypoints": 9,
    "__init__": 10, "__main__": 10,
}  # fmt: skip
KERNEL_MODULES = ("rag_speculate.cpu.kernels", "rag_speculate.cpu.linear", "rag_speculate.cpu.attention", "rag_speculate.cpu.build")


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every rag_speculate module `path` imports, at its top, inside functions and under TYPE_CHECKING alike."""
    module = _module(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    modules = {_module(p) for p in PACKAGE.rglob("*.py")}
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from package import module` takes that module; `from module import name`, the module.
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
    return {name for name in found if name in modules and name != module}


def _room(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def _graph() -> dict[str, set[str]]:
    return {_module(path): _imports(path) for path in PACKAGE.rglob("*.py")}


def test_every_module_has_a_floor():
    assert {_room(module) for module in _graph()} == set(FLOORS)


def test_imports_only_go_down_a_floor():
    upward = [
        f"{module} -> {target}"
        for module, targets in _graph().items()
        for target in targets
        if _room(module) != _room(target) and FLOORS[_room(target)] >= FLOORS[_room(module)]
    ]
    assert not upward, "imports from a floor to one not below it:\n" + "\n".join(sorted(upward))


def test_no_module_imports_itself_back():
    graph, circles = _graph(), []

    def visit(module: str, path: list[str]) -> None:
        for target in graph[module]:
            if target in path:
                circles.append(" -> ".join([*path[path.index(target) :], target]))
            elif target not in seen:
                seen.add(target)
                visit(target, [*path, target])

    seen: set[str] = set()
    for module in graph:
        if module not in seen:
            seen.add(module)
            visit(module, [module])
    assert not circles, "import circles:\n" + "\n".join(circles)


def _loaded_after(code: str) -> set[str]:
    probe = f"import sys\n{code}\nprint(' '.join(m for m in sys.modules if m.startswith('rag_speculate')))"
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True, timeout=300).stdout
    return set(out.split())


def test_importing_the_package_the_engine_and_the_drafters_loads_no_kernel_module():
    loaded = _loaded_after("import rag_speculate, rag_speculate.drafters, rag_speculate.engine, rag_speculate.retrieval.corpus")
    assert "rag_speculate.engine.engine" in loaded and "rag_speculate.drafters.ouroboros.drafter" in loaded
    assert not loaded & set(KERNEL_MODULES)


def test_an_engine_without_the_cpu_kernels_never_loads_them():
    code = (
        "import torch\n"
        "from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast\n"
        "from tokenizers import Tokenizer, models\n"
        "from rag_speculate import SpeculativeEngine\n"
        "torch.manual_seed(0)\n"
        "model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,"
        " num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64))\n"
        "vocab = {chr(97 + i): i for i in range(26)} | {'<eos>': 26}\n"
        "tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token='a')), eos_token='<eos>')\n"
        "engine = SpeculativeEngine(model, tokenizer, fast_kernels=False)\n"
        "assert engine.generate([1, 2, 3, 1, 2], max_new_tokens=4).token_ids\n"
    )
    assert not _loaded_after(code) & set(KERNEL_MODULES)
