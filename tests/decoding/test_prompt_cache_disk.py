"""The prompt cache's disk tier through the engine: a restarted engine (a new model object, the same
weights) answers from disk exactly as from memory and as cold; a damaged, truncated or foreign block
is a miss with one log line, never another answer, and removed; an entry at a block's name that is not
ours to remove is a miss, reported once and counted; warming fills the folder; the load-or-prefill
rule skips loads that would be slower; bad options are named."""

from __future__ import annotations

import logging
import os
import stat

import pytest
from conftest import hf_greedy, tiny_model

from rag_speculate import InvalidArgumentError, SpeculativeEngine
from rag_speculate.decoding.prompt_cache import PromptCache
from rag_speculate.decoding.prompt_store import DEFAULT_BLOCK_TOKENS

pytestmark = pytest.mark.usefixtures("forward_path")
# Three full blocks and a partial one: the disk tier stores full blocks only.
PROMPT = ("the quick brown fox jumps over the lazy dog, and the lazy dog sleeps on. " * 3)[:200]
FOLLOW_UP = " then what did the fox do?"


def engine_for(folder, seed: int = 0, tokenizer=None, **options) -> SpeculativeEngine:
    """A fresh engine on a fresh model object: a restarted process, as far as the cache can tell."""
    return SpeculativeEngine(tiny_model("llama", seed=seed), tokenizer, prompt_cache_dir=folder, **options)


def blocks(folder) -> list:
    return sorted(folder.rglob("*.safetensors"))


def ask(engine: SpeculativeEngine, ids: list[int], n: int = 16):
    result = engine.generate(ids, max_new_tokens=n)
    engine.prompt_cache.store.flush()
    return result


def test_a_restarted_engine_answers_from_disk_as_from_memory_and_as_cold(tmp_path, tokenizer):
    ids = tokenizer.encode(PROMPT)
    first = engine_for(tmp_path, tokenizer=tokenizer)
    reference = hf_greedy(first.model, ids, 16)
    cold = ask(first, ids)
    assert cold.token_ids == reference and cold.stats.cached_prompt_tokens == 0
    # The prompt and its answer, in full blocks only.
    assert len(blocks(tmp_path)) == (len(ids) + 16 - 1) // DEFAULT_BLOCK_TOKENS

    again = engine_for(tmp_path, tokenizer=tokenizer)
    from_disk = ask(again, ids)
    whole_blocks = (len(ids) - 1) // DEFAULT_BLOCK_TOKENS * DEFAULT_BLOCK_TOKENS
    assert from_disk.token_ids == reference
    assert from_disk.stats.cached_prompt_tokens == from_disk.stats.disk_cached_prompt_tokens == whole_blocks
    # Promoted: the next asking is a memory hit of at least the same prefix, with the same answer.
    from_memory = ask(again, ids)
    assert from_memory.token_ids == reference and from_memory.stats.disk_cached_prompt_tokens == 0
    assert from_memory.stats.cached_prompt_tokens >= whole_blocks

    # A follow-up reads the blocks of the first answer that a third engine never computed.
    follow = ids + reference + tokenizer.encode(FOLLOW_UP)
    third = engine_for(tmp_path, tokenizer=tokenizer)
    answer = ask(third, follow)
    assert answer.token_ids == hf_greedy(third.model, follow, 16)
    assert answer.stats.disk_cached_prompt_tokens == (len(ids) + 16 - 1) // DEFAULT_BLOCK_TOKENS * DEFAULT_BLOCK_TOKENS
    stats = third.prompt_cache.stats()
    assert stats.disk_hits == 1 and stats.disk_tokens == answer.stats.disk_cached_prompt_tokens
    assert stats.disk_bytes == sum(f.stat().st_size for f in blocks(tmp_path)) and stats.disk_load_s > 0
    assert answer.stats.usage()["prompt_tokens_details"]["cached_tokens"] == answer.stats.cached_prompt_tokens


@pytest.mark.parametrize("damage", ["a flipped byte", "truncated", "another block's bytes"])
def test_a_damaged_block_is_a_miss_with_one_log_line_and_the_answer_is_unchanged(tmp_path, tokenizer, caplog, damage):
    ids = tokenizer.encode(PROMPT)
    reference = ask(engine_for(tmp_path, tokenizer=tokenizer), ids).token_ids
    files = blocks(tmp_path)
    first = SpeculativeEngine(tiny_model("llama"), tokenizer, prompt_cache_dir=tmp_path)
    chain = first.prompt_cache.store.hashes(ids)
    broken = first.prompt_cache.store.path(chain[1])  # the second block: the first still loads
    data = bytearray(broken.read_bytes())
    if damage == "a flipped byte":
        data[-5] ^= 0x01
    elif damage == "truncated":
        data = data[: len(data) // 2]
    else:
        data = bytearray(first.prompt_cache.store.path(chain[2]).read_bytes())
    broken.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="rag_speculate"):
        result = ask(first, ids)
    assert result.token_ids == reference
    assert result.stats.disk_cached_prompt_tokens == DEFAULT_BLOCK_TOKENS  # the block before the damaged one
    assert first.prompt_cache.stats().disk_blocks_rejected == 1
    assert len([r for r in caplog.records if "unusable" in r.getMessage()]) == 1
    # Removed, and written again by the answer's write-through: the next engine reads it whole.
    assert len(blocks(tmp_path)) == len(files)
    assert ask(engine_for(tmp_path, tokenizer=tokenizer), ids).stats.disk_cached_prompt_tokens == (len(ids) - 1) // 64 * 64



@pytest.mark.parametrize("kind", ["a FIFO", "another user's block"])
def test_an_entry_not_ours_to_remove_is_a_miss_reported_once_and_counted(tmp_path, tokenizer, caplog, kind):
    if kind == "another user's block" and os.getuid() != 0:
        pytest.skip("giving a file to another user takes root")
    ids = tokenizer.encode(PROMPT)
    reference = ask(engine_for(tmp_path, tokenizer=tokenizer), ids).token_ids
    engine = SpeculativeEngine(tiny_model("llama"), tokenizer, prompt_cache_dir=tmp_path)
    store = engine.prompt_cache.store
    left = store.path(store.hashes(ids)[1])  # the second block: the first still loads
    if kind == "a FIFO":
        left.unlink()
        os.mkfifo(left, 0o600)
    else:
        os.chown(left, 12345, 12345)
    with caplog.at_level(logging.WARNING, logger="rag_speculate"):
        for again in (False, True):  # the disk tier asked twice: the memory tier cleared in between
            engine.prompt_cache.clear()
            result = ask(engine, ids)
            assert result.token_ids == reference
            # The block before it (the second time, loading may be predicted slower than prefilling).
            assert again or result.stats.disk_cached_prompt_tokens == DEFAULT_BLOCK_TOKENS
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("rag_speculate")]
    assert len(lines) == 1 and str(left) in lines[0]
    assert engine.prompt_cache.stats().disk_entries_refused == 1
    assert (stat.S_ISFIFO if kind == "a FIFO" else stat.S_ISREG)(left.lstat().st_mode)  # left as it was

def test_another_models_blocks_are_never_read(tmp_path, tokenizer):
    ids = tokenizer.encode(PROMPT)
    ask(engine_for(tmp_path, tokenizer=tokenizer), ids)
    other = engine_for(tmp_path, seed=1, tokenizer=tokenizer)
    result = ask(other, ids)
    assert result.stats.cached_prompt_tokens == 0 and result.token_ids == hf_greedy(other.model, ids, 16)
    # Filed apart: one folder per model identity.
    assert len({f.parent.parent for f in blocks(tmp_path)}) == 2


def test_warming_fills_the_folder_for_the_next_engine(tmp_path, tokenizer):
    warmer = engine_for(tmp_path, tokenizer=tokenizer)
    prefilled = warmer.prompt_cache.warm([PROMPT])
    ids = tokenizer.encode(PROMPT)
    assert prefilled == len(ids) and blocks(tmp_path)
    assert warmer.prompt_cache.warm([PROMPT]) == 1  # cached: only the last token, fed for its logits
    result = ask(engine_for(tmp_path, tokenizer=tokenizer), ids)
    assert result.stats.disk_cached_prompt_tokens == (len(ids) - 1) // 64 * 64
    with pytest.raises(InvalidArgumentError, match="list of prompts"):
        warmer.prompt_cache.warm(PROMPT)


def test_loads_predicted_slower_than_prefilling_are_skipped(tmp_path, tokenizer):
    ids = tokenizer.encode(PROMPT)
    reference = ask(engine_for(tmp_path, tokenizer=tokenizer), ids).token_ids
    engine = engine_for(tmp_path, tokenizer=tokenizer)
    assert ask(engine, ids).stats.disk_cached_prompt_tokens > 0  # measures the disk
    engine.prompt_cache.clear()
    engine.prompt_cache.observe_prefill(10**9, 1e-3)  # a device that prefills a trillion tokens a second
    result = ask(engine, ids)
    assert result.token_ids == reference and result.stats.cached_prompt_tokens == 0
    assert engine.prompt_cache.stats().disk_loads_skipped == 1


def test_bad_disk_options_are_named(tmp_path, tokenizer):
    model = tiny_model("llama")
    a_file = tmp_path / "file"
    a_file.write_text("not a folder")
    for options, argument in [
        ({"prompt_cache_dir": a_file}, "prompt_cache_dir"),
        ({"prompt_cache_dir": 3}, "prompt_cache_dir"),
        ({"prompt_cache_disk_bytes": 1 << 20}, "prompt_cache_disk_bytes"),
        ({"prompt_cache_dir": tmp_path, "prompt_cache_disk_bytes": -1}, "prompt_cache_disk_bytes"),
    ]:
        with pytest.raises(InvalidArgumentError) as raised:
            SpeculativeEngine(model, tokenizer, **options)
        assert raised.value.argument == argument, options
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(InvalidArgumentError, match="writable by every user"):
        PromptCache.for_model(model, folder=shared)
