"""`SpeculativeHFLLM`: a text-completion LangChain LLM on the speculative engine (in place of `HuggingFacePipeline`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseLLM, LangSmithParams
from langchain_core.outputs import Generation, GenerationChunk, LLMResult

from rag_speculate import GenerationResult, GenerationStream
from rag_speculate.entrypoints.prompt import prepare

from ._common import MODEL_CONFIG, SpeculativeHFParams


class SpeculativeHFLLM(SpeculativeHFParams, BaseLLM):
    """A local Hugging Face model as a LangChain LLM, accelerated by lossless speculative decoding.

    The prompt is completed as plain text (use `ChatSpeculativeHF` for the chat template). The drafters
    draft from the prompt, so stuffed RAG context already speeds generation up; pass the retrieved
    documents with `llm.bind(documents=docs)` (or build the chain with `create_rag_chain`) to draft from
    them even where the prompt template trimmed or reordered them.

        llm = SpeculativeHFLLM.from_model_id("qwen2.5-coder-1.5b-instruct", max_tokens=128)
        llm.invoke("The capital of France is", stop=["\\n"])
    """

    model_config = MODEL_CONFIG

    @property
    def _llm_type(self) -> str:
        return "rag-speculate"

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        return self._ls_params(super()._get_ls_params(stop=stop, **kwargs), stop, kwargs)

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids from the model's own tokenizer (LangChain's default would be GPT-2's)."""
        return self.get_engine().tokenizer.encode(text)

    def _start(self, prompt: str, stop: list[str] | None, kwargs: dict[str, Any]) -> GenerationStream:
        engine = self.get_engine()
        return engine.stream_request(prepare(engine, prompt, chat=False, **self._generation_kwargs(stop, kwargs)).request)

    def _generation(self, result: GenerationResult) -> Generation:
        return Generation(text=result.text, generation_info=self._result_info(result))

    def _llm_result(self, results: list[GenerationResult]) -> LLMResult:
        usage = [r.stats.usage() for r in results]
        total = {key: sum(u[key] for u in usage) for key in ("prompt_tokens", "completion_tokens", "total_tokens")}
        total["prompt_tokens_details"] = {"cached_tokens": sum(u["prompt_tokens_details"]["cached_tokens"] for u in usage)}
        return LLMResult(
            generations=[[self._generation(r)] for r in results],
            llm_output={"token_usage": total, "model_name": self.model},
        )

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        # Every prompt started before any is read: the engine runs them together.
        streams = [self._start(p, stop, kwargs) for p in prompts]
        return self._llm_result([stream.collect() for stream in streams])

    async def _agenerate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        streams = [self._start(p, stop, kwargs) for p in prompts]
        return self._llm_result([await stream.acollect() for stream in streams])

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        stream = self._start(prompt, stop, kwargs)
        try:
            for delta in stream:
                chunk = GenerationChunk(text=delta)
                if run_manager:
                    run_manager.on_llm_new_token(delta, chunk=chunk)
                yield chunk
        finally:
            stream.close()  # a consumer that stops early frees the engine at once
        yield GenerationChunk(text="", generation_info=self._result_info(stream.result))

    async def _astream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        stream = self._start(prompt, stop, kwargs)
        async for delta in stream:
            chunk = GenerationChunk(text=delta)
            if run_manager:
                await run_manager.on_llm_new_token(delta, chunk=chunk)
            yield chunk
        yield GenerationChunk(text="", generation_info=self._result_info(stream.result))
