"""langchain-tests' standard chat model suites on ChatSpeculativeHF with the small packaged model."""

from __future__ import annotations

from typing import Any

from langchain_rag_speculate import ChatSpeculativeHF
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from .conftest import DTYPE, MODEL

PARAMS = {"model": MODEL, "dtype": DTYPE}


class _Features:
    """What a local text-only model cannot do, switched off explicitly (the suites then skip those tests)."""

    @property
    def chat_model_class(self) -> type[ChatSpeculativeHF]:
        return ChatSpeculativeHF

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return PARAMS

    has_tool_calling = False
    has_tool_choice = False
    has_structured_output = False
    supports_json_mode = False
    supports_image_inputs = False
    supports_image_urls = False
    supports_pdf_inputs = False
    supports_audio_inputs = False
    supports_video_inputs = False
    supports_image_tool_message = False
    supports_pdf_tool_message = False
    supports_anthropic_inputs = False
    supports_model_override = False  # one engine holds one model; a per-call `model=` is refused
    returns_usage_metadata = True
    enable_vcr_tests = False  # nothing goes over HTTP to record


class TestChatSpeculativeHFUnit(_Features, ChatModelUnitTests):
    @property
    def standard_chat_model_params(self) -> dict[str, Any]:
        # A local model has no API key, request timeout or retries; the constructor refuses unknown
        # settings rather than ignoring them, so the suite's remote-API ones are left out.
        params = super().standard_chat_model_params
        for remote_only in ("api_key", "timeout", "max_retries"):
            params.pop(remote_only)
        return params


class TestChatSpeculativeHFIntegration(_Features, ChatModelIntegrationTests):
    @property
    def chat_model_params(self) -> dict[str, Any]:
        # Short answers keep the suite fast; these tests never set max_tokens themselves.
        return {**PARAMS, "max_tokens": 12}
