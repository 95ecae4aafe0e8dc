"""A draft model's forward without transformers' per-module overhead, for Llama-family decoders.

Through transformers, a small draft model's forward over one token on a CPU spends much of its
time in Python around its many small operators (module calls, attention dispatch, mask and cache
bookkeeping) rather than in its linear layers. Drafting runs that forward once per sentence-draft phrase,
so the draft model's cost bounds every method that drafts with it. This forward computes the
same operators on the same modules and KV cache in fewer calls, with logits that match the
model's own (tests/test_lean_forward.py checks tiny Llama, Qwen2 and Mistral models, in fp32
and int8).

Only for drafting: the target always runs its own forward, so a mistake here could only cost
accepted tokens, never change the output. Even so, `lean_forward` uses it only for models whose
layers have the shape it computes and whose own forward it matches on a probe.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel

from ...decoding.kv_cache import cache_keyword, sliding_window
from ...decoding.tree import DraftTree, tree_attention_mask
from .int8 import Int8Linear

# Of the largest logit, in float32: rounding differences only (a bf16 model rounds more).
_PROBE_TOLERANCE = 1e-3


class LeanForward:
    """Logits of a Llama-family decoder (Llama, Qwen2, Mistral without sliding windows), computed
    from its own modules; takes the arguments `TreeForward` gives a model's forward, the KV cache as `cache`."""

    def __init__(self, model: PreTrainedModel):
        inner = model.model
        self._embed, self._rotary, self._norm = inner.embed_tokens, inner.rotary_emb, inner.norm
        self._layers = [
            (
                layer.input_layernorm, _fused_qkv(layer.self_attn), _linear(layer.self_attn.o_proj), layer.post_attention_layernorm,
                _linear(layer.mlp.gate_proj), _linear(layer.mlp.up_proj), _linear(layer.mlp.down_proj), layer.mlp.act_fn,
            )
            for layer in inner.layers
        ]  # fmt: skip
        self._lm_head = model.lm_head
        self._head = _linear(model.lm_head)
        self._head_rows: Callable[[torch.Tensor], Callable[[torch.Tensor], torch.Tensor]] | None = None
        self._head_groups: dict[bytes, Callable[[torch.Tensor], torch.Tensor]] = {}  # by their ids, in column order
        attention = inner.layers[0].self_attn
        self._heads = model.config.num_attention_heads
        self._kv_heads = model.config.num_key_value_heads
        self._head_dim = attention.head_dim
        self._scaling = attention.scaling

    @torch.inference_mode()
    def __call__(
        self,
        input_ids: torch.Tensor,
        cache: DynamicCache,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        logits_to_keep: int | None = None,
    ) -> torch.Tensor:
        """Logits [1, rows, vocab] for `input_ids` [1, q] after the cache, which gains their keys and
        values; a restricted head gives one column per id it scores (`restrict_head`)."""
        q = input_ids.shape[1]
        past = cache.get_seq_length()
        h = self._embed(input_ids)
        if position_ids is None:
            position_ids = torch.arange(past, past + q, device=h.device)[None]
        # A prefill attends causally; a chain after cached tokens needs the mask to say so.
        causal = attention_mask is None and q > 1 and past == 0
        if attention_mask is None and q > 1 and past:
            attention_mask = tree_attention_mask(DraftTree.chain([0] * (q - 1)), past, h.dtype, h.device)
        cos, sin = (t.unsqueeze(1) for t in self._rotary(h, position_ids))
        heads, kv_heads = self._heads, self._kv_heads
        for i, (norm1, qkv, o_proj, norm2, gate, up, down, act) in enumerate(self._layers):
            x = _rms_norm(h, norm1)
            projected = qkv(x).view(1, q, heads + 2 * kv_heads, self._head_dim).transpose(1, 2)
            rotated = _rotate(projected[:, : heads + kv_heads], cos, sin)
            key, value = cache.update(rotated[:, heads:], projected[:, heads + kv_heads :], i)
            mixed = F.scaled_dot_product_attention(rotated[:, :heads], key, value, attn_mask=attention_mask, is_causal=causal, scale=self._scaling, enable_gqa=True)
            h = h + o_proj(mixed.transpose(1, 2).reshape(1, q, -1))
            x = _rms_norm(h, norm2)
            h = h + down(act(gate(x)) * up(x))
        rows = logits_to_keep or q
        return self._head(_rms_norm(h[:, -rows:], self._norm))

    def restrict_head(self, *groups: torch.Tensor) -> None:
        """From now on, logits only for the token ids of `groups`, side by side (column j: token j of
        their concatenation); no groups: every id.

        A small draft model's output head is a large part of its weights (the 0.5B Qwen's is
        151,936 x 896) and mostly scores tokens an answer rarely uses; its drafts are only checked,
        so a head over fewer tokens costs accepted tokens where the target needs another one, never
        the output. Each group's product is built once and kept until a call with groups names other
        ids, since repacking many rows of the head is slow while a prompt's few hundred ids are cheap.
        The first call keeps a copy of the head's weights to build groups from."""
        if not groups:
            self._head = _linear(self._lm_head)
            return
        if self._head_rows is None:
            self._head_rows = _row_products(self._lm_head)  # unpacked once
        built, products = self._head_groups, []
        self._head_groups = {}
        for ids in groups:
            key = ids.numpy().tobytes()
            self._head_groups[key] = built.get(key) or self._head_groups.get(key) or self._head_rows(ids)
            products.append(self._head_groups[key])
        self._head = products[0] if len(products) == 1 else lambda x: torch.cat([p(x) for p in products], dim=-1)


def lean_forward(model: PreTrainedModel) -> tuple[LeanForward | None, str]:
    """The lean forward for `model`, or None and why: its layers are not the shape computed here,
    or their output differs from the model's own forward on a probe."""
    reason = _unsupported(model)
    if reason:
        return None, reason
    lean = LeanForward(model)
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.tensor([[(7 * i + 3) % vocab for i in range(6)]], device=model.device)
    with torch.inference_mode():
        try:
            # A prefill, then a step on top of the cache: both shapes drafting runs. In the same
            # chunks for both, as an int8 model quantizes each forward's activations together.
            ours, theirs = DynamicCache(config=model.config), DynamicCache(config=model.config)
            got = torch.cat([lean(ids[:, :4], ours), lean(ids[:, 4:], ours)], dim=1).float()
            keyword = cache_keyword(model)
            want = torch.cat([model(input_ids=chunk, **{keyword: theirs}).logits for chunk in (ids[:, :4], ids[:, 4:])], dim=1).float()
        except Exception as exc:  # noqa: BLE001 - any failure means the lean forward does not fit this model
            return None, f"the lean forward failed on a probe: {type(exc).__name__}: {exc}"
    tolerance = max(_PROBE_TOLERANCE, 8 * torch.finfo(model.dtype).eps)
    if (got - want).abs().max().item() > tolerance * (want.abs().max().item() + 1e-6):
        return None, "the lean forward's logits differ from the model's own on a probe"
    return lean, ""


def _unsupported(model: PreTrainedModel) -> str:
    inner = getattr(model, "model", None)
    parts = ("embed_tokens", "rotary_emb", "norm", "layers")
    if inner is None or not hasattr(model, "lm_head") or not all(hasattr(inner, p) for p in parts):
        return f"{type(model).__name__} is not a Llama-family decoder (model.embed_tokens, layers, norm, rotary_emb, lm_head)"
    for layer in inner.layers:
        attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if not all(hasattr(attention, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")):
            return "its attention layers are not Llama's (q_proj, k_proj, v_proj, o_proj)"
        if any(hasattr(attention, p) for p in ("q_norm", "k_norm", "sinks")) or getattr(attention, "sliding_window", None):
            return "its attention normalises queries and keys, has sinks or a sliding window"
        if not all(hasattr(mlp, p) for p in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            return "its MLP layers are not gated (gate_proj, up_proj, down_proj)"
        norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
        if not all(hasattr(n, "weight") and hasattr(n, "variance_epsilon") for n in norms):
            return "its layers lack RMS norms before attention and MLP"
    if sliding_window(DynamicCache(config=model.config)) is not None:
        return "it has sliding-window attention layers"
    return ""


def _fused_qkv(attention: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """Queries, keys and values side by side. In int8, from one product: the three share their input,
    and k and v are so small that a call of their own costs more than their weights (k: 128 x 896
    for the 0.5B Qwen). Each row keeps its own channel's scale, so the results are the same. The
    fused weights are a copy; the model keeps its own."""
    projections = (attention.q_proj, attention.k_proj, attention.v_proj)
    if not all(isinstance(p, Int8Linear) for p in projections):
        linears = [_linear(p) for p in projections]
        return lambda x: torch.cat([linear(x) for linear in linears], dim=-1)
    weights, biases = zip(*(p.weight_and_bias() for p in projections))
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([torch.zeros(w.shape[0]) if b is None else b for w, b in zip(weights, biases)])
    return _int8_product(torch.cat([w.int_repr() for w in weights]), torch.cat([w.q_per_channel_scales() for w in weights]),
                         torch.cat([w.q_per_channel_zero_points() for w in weights]), bias, projections[0].reduce_range)


def _row_products(module: torch.nn.Module) -> Callable[[torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]:
    """A maker of `module`'s product over chosen output rows alone: for `ids`, a copy of those rows'
    weights (int8 or fp32), each row with its own scale, so every logit is the one the whole product gives."""
    if isinstance(module, Int8Linear):
        weight, bias = module.weight_and_bias()
        ints, scales, zero_points = weight.int_repr(), weight.q_per_channel_scales(), weight.q_per_channel_zero_points()
        return lambda ids: _int8_product(ints[ids], scales[ids], zero_points[ids], None if bias is None else bias[ids], module.reduce_range)
    if type(module) is torch.nn.Linear:
        return lambda ids: _dense_product(module.weight[ids], None if module.bias is None else module.bias[ids])
    return lambda ids: lambda x: module(x)[..., ids]


def _dense_product(weight: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: F.linear(x, weight, bias)


def _int8_product(weight: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor, bias: torch.Tensor | None,
                  reduce_range: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """The int8 product with integer weights `weight` [out, in] at per-output-row `scales`."""
    packed = torch.ops.quantized.linear_prepack(torch._make_per_channel_quantized_tensor(weight, scales, zero_points, 0), bias)
    return _linear(Int8Linear(packed, reduce_range))


def _linear(module: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The module's product as one operator call: a module call costs more than the product of a
    small draft model's layer for one token (int8: `Int8Linear`, whose forward this repeats)."""
    if isinstance(module, Int8Linear):
        packed, reduce_range = module.packed, module.reduce_range
        return lambda x: torch.ops.quantized.linear_dynamic(x, packed, reduce_range=reduce_range)
    if type(module) is torch.nn.Linear:
        return _dense_product(module.weight, module.bias)
    return module


def _rms_norm(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    return F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
