"""A Llama-family decoder's forward in fewer calls, through the model's own modules: `LeanForward`.

On a CPU, a one-token forward through transformers spends a large share of its time in Python
around many small operators (a module call per layer, attention and MLP; the attention dispatch;
mask and cache bookkeeping; the kernel mode's dispatch of every operator) rather than in the
linear layers. This forward calls the model's own embedding, rotary, norm and activation modules,
its mask and attention functions and its linear layers, in the order the model's forward does,
with the same arguments: each operator gets the same inputs, so it returns the same bits (torch
picks an attention kernel by the mask and the key/value layout, so on CUDA even an equivalent
call of its own changed them). Three things it does otherwise, none
changing a value: the products that share an input (queries, keys and values; gate and up) run as
one where the layers can fuse (`fused`, each output row still computed alone); the CPU kernels,
when given, are called directly rather than through their mode; and the norms and the rotary
embedding run in one C call each where the kernels give the model's own bits (checked per module).

`lean_forward` checks it on a probe before anyone uses it: for the target (`exact`), every logit
must equal the model's own forward's bit for bit, so the output cannot change; a draft model's
only needs to agree closely, its drafts being checked anyway. Models of another shape (sliding
windows, normalised queries and keys, no gated MLP) keep their own forward.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .kv_cache import cache_keyword, sliding_window
from .probe import probe_ids
from .tree import DraftTree, tree_attention_mask

# Of the largest logit, in float32, for a draft model: rounding differences only (bf16 rounds more).
_PROBE_TOLERANCE = 1e-3


class Kernels(NamedTuple):
    """The functions a forward's dense products, attention, norms and rotary embedding run through:
    torch's and the model's own, or the CPU kernels' (`cpu.kernels`, which fall back to torch's
    where they do not serve the arguments; their attention takes `F.scaled_dot_product_attention`'s)."""

    linear: Callable[..., torch.Tensor] = F.linear
    # None: the function the model's attention layers call (transformers' for its attention
    # implementation), which picks torch's kernel by device and mask as the model's forward does.
    attention: Callable[..., torch.Tensor] | None = None
    # For a norm module, its forward through a kernel that gives its bits, or None to keep the
    # module (`cpu.norm.norm_for`); None here: every norm its own module.
    norm_for: Callable[[torch.nn.Module], Callable[[torch.Tensor], torch.Tensor] | None] | None = None
    # Likewise for the model's rotary function and its heads' dims (`cpu.rotary.rotary_for`).
    rotary_for: Callable[[Callable, int], Callable | None] | None = None


TORCH = Kernels()


class LeanForward:
    """Logits of a Llama-family decoder (Llama, Qwen2, Mistral without sliding windows), computed
    from its own modules; takes the arguments a model's forward takes, the KV cache as `cache`."""

    def __init__(self, model: PreTrainedModel, kernels: Kernels = TORCH):
        inner, self._config = model.model, model.config
        self._causal_mask = sys.modules[type(inner).__module__].create_causal_mask
        self._kernels = kernels
        self._embed, self._rotary, self._norm = inner.embed_tokens, inner.rotary_emb, self._normed(inner.norm)
        attention = inner.layers[0].self_attn
        # The model's own functions, so queries and keys turn, and attend, exactly as in its attention.
        module = sys.modules[type(attention).__module__]
        own_rotary = module.apply_rotary_pos_emb
        self._apply_rotary = (kernels.rotary_for and kernels.rotary_for(own_rotary, attention.head_dim)) or own_rotary
        own = ALL_ATTENTION_FUNCTIONS.get_interface(model.config._attn_implementation, module.eager_attention_forward)
        self._attend = own if kernels.attention is None else self._kernel_attention
        # The CPU kernels compute each row as if alone, so a row's result cannot depend on which
        # others are computed beside it; torch's may pick another kernel for fewer rows.
        self._rows_alone = kernels.attention is not None
        self._layers = [
            (
                self._normed(layer.input_layernorm), self._products(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
                layer.self_attn, self._product(layer.self_attn.o_proj), self._normed(layer.post_attention_layernorm),
                self._products(layer.mlp.gate_proj, layer.mlp.up_proj), self._product(layer.mlp.down_proj), layer.mlp.act_fn,
            )
            for layer in inner.layers
        ]  # fmt: skip
        self.head = self._product(model.lm_head)  # a draft model's may score fewer ids
        self._heads, self._kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
        self._head_dim, self._scaling = attention.head_dim, attention.scaling

    @torch.inference_mode()
    def __call__(
        self,
        input_ids: torch.Tensor,
        cache: DynamicCache,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        logits_to_keep: int | None = None,
        use_cache: bool = True,
    ) -> torch.Tensor:
        """Logits [batch, rows, vocab] for `input_ids` [batch, q] after the cache, which gains their
        keys and values (`use_cache` is accepted for the model's signature; the cache is always used)."""
        batch, q = input_ids.shape
        past = cache.get_seq_length()
        h = self._embed(input_ids)
        if position_ids is None:
            position_ids = torch.arange(past, past + q, device=h.device)[None]
        # The model's own mask (a 4D one, as the engine's trees have, passes as it is): its kind and
        # dtype decide which of torch's attention kernels runs, and so the bits.
        attention_mask = self._causal_mask(config=self._config, inputs_embeds=h, attention_mask=attention_mask,
                                           cache=cache, position_ids=position_ids)  # fmt: skip
        cos, sin = self._rotary(h, position_ids)
        dims, rows, last = self._head_dim, logits_to_keep or q, len(self._layers) - 1
        for i, (norm1, qkv, attention, o_proj, norm2, gate_up, down, act) in enumerate(self._layers):
            query, key, value = (t.view(batch, q, -1, dims).transpose(1, 2) for t in qkv(norm1(h)))
            query, key = self._apply_rotary(query, key, cos, sin)
            key, value = cache.update(key, value, i)
            if i == last and rows < q and self._rows_alone and ((attention_mask is None and rows == 1) or torch.is_tensor(attention_mask)):
                # Past the last layer's keys and values, only the rows whose logits are kept count
                # (a prefill's last): the rest of that layer is skipped, as llama.cpp does.
                query, h = query[:, :, -rows:], h[:, -rows:]
                attention_mask = None if attention_mask is None else attention_mask[..., -rows:, :]
            mixed, _ = self._attend(attention, query, key, value, attention_mask, dropout=0.0, scaling=self._scaling)
            h = h + o_proj(mixed.reshape(batch, query.shape[2], -1))
            gate, up = gate_up(norm2(h))
            h = h + down(act(gate) * up)
        return self.head(self._norm(h[:, -rows:]))

    def _kernel_attention(
        self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        attention_mask: torch.Tensor | None, dropout: float, scaling: float,
    ) -> tuple[torch.Tensor, None]:  # fmt: skip
        """The kernels' attention in the shape of transformers' attention functions: [batch, q, heads, dims] out."""
        causal = attention_mask is None and query.shape[2] > 1
        mixed = self._kernels.attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout, is_causal=causal,
                                        scale=scaling, enable_gqa=self._heads != self._kv_heads)  # fmt: skip
        return mixed.transpose(1, 2), None

    def _products(self, *layers: torch.nn.Module) -> Callable[[torch.Tensor], tuple[torch.Tensor, ...]]:
        """The layers' products of one input, as a tuple: one product where the layers fuse (their
        class's `fused`, e.g. `QuantizedLinear`'s, takes them), else one call each (a dense layer
        through the kernels' linear)."""
        kind = type(layers[0])
        if len(layers) > 1 and all(type(m) is kind for m in layers) and hasattr(kind, "fused"):
            try:
                fused = kind.fused(layers)
            except ValueError:  # layers that do not fuse (a GGUF file's q4 beside q8, say): one call each
                pass
            else:
                sizes = [m.out_features for m in layers]
                return lambda x: fused(x).split(sizes, dim=-1)
        products = [self._product(m) for m in layers]
        return lambda x: tuple(p(x) for p in products)

    def _normed(self, norm: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        own = self._kernels.norm_for(norm) if self._kernels.norm_for is not None else None
        return own or norm

    def _product(self, layer: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        if type(layer) is torch.nn.Linear:
            linear, weight, bias = self._kernels.linear, layer.weight, layer.bias
            return lambda x: linear(x, weight, bias)
        return layer


def lean_forward(
    model: PreTrainedModel, kernels: Kernels = TORCH, *, exact: bool,
    context: Callable[[], AbstractContextManager] = contextlib.nullcontext, kind: type[LeanForward] = LeanForward,
) -> tuple[LeanForward | None, str]:  # fmt: skip
    """The lean forward (`kind`) for `model`, or None and why: its layers are not the shape computed
    here, or its logits differ from the model's own forward (run inside `context`, as the engine
    runs it) on a probe: at all where `exact`, else beyond rounding."""
    reason = _unlike_llama(model)
    if reason:
        return None, reason
    try:
        lean = kind(model, kernels)
    except Exception as exc:  # noqa: BLE001 - a layer the lean forward cannot take keeps the model's own
        return None, f"the lean forward cannot take the model's layers: {type(exc).__name__}: {exc}"
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.tensor([probe_ids(vocab, 7)], device=model.device)
    tree = DraftTree([5 % vocab, 6 % vocab], [-1, 0])
    with torch.inference_mode():
        try:
            # A prefill, a chain and a tree on top of the cache: the shapes decoding runs. In the
            # same chunks for both, as an int8 draft quantizes each forward's activations together.
            ours, theirs = DynamicCache(config=model.config), DynamicCache(config=model.config)
            # The prefill keeps its last row's logits, as the engine's prefills do.
            keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
            chunks = [{"input_ids": ids[:, :4], **keep}, {"input_ids": ids[:, 4:]},
                      {"input_ids": torch.tensor([[4 % vocab, *tree.tokens]], device=model.device),
                       "attention_mask": tree_attention_mask(tree, 7, next(model.parameters()).dtype, model.device)}]  # fmt: skip
            got = [lean(cache=ours, **chunk) for chunk in chunks]
            keyword = cache_keyword(model)
            with context():
                want = [model(**chunk, **{keyword: theirs}).logits for chunk in chunks]
        except Exception as exc:  # noqa: BLE001 - any failure means the lean forward does not fit this model
            return None, f"the lean forward failed on a probe: {type(exc).__name__}: {exc}"
    got, want = torch.cat(got, dim=1).float(), torch.cat(want, dim=1).float()
    tolerance = 0.0 if exact else max(_PROBE_TOLERANCE, 8 * torch.finfo(model.dtype).eps)
    if (got - want).abs().max().item() > tolerance * (want.abs().max().item() + 1e-6):
        return None, "the lean forward's logits differ from the model's own on a probe"
    return lean, ""


def _unlike_llama(model: PreTrainedModel) -> str:
    """How `model`'s layers differ from the Llama-family shape the lean forward computes ("" where they do not)."""
    inner = getattr(model, "model", None)
    parts = ("embed_tokens", "rotary_emb", "norm", "layers")
    if inner is None or not hasattr(model, "lm_head") or not all(hasattr(inner, p) for p in parts):
        return f"{type(model).__name__} is not a Llama-family decoder (model.embed_tokens, layers, norm, rotary_emb, lm_head)"
    if not hasattr(sys.modules[type(inner).__module__], "create_causal_mask"):
        return "its model's module has no create_causal_mask"
    for layer in inner.layers:
        attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if not all(hasattr(attention, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")):
            return "its attention layers are not Llama's (q_proj, k_proj, v_proj, o_proj)"
        if any(hasattr(attention, p) for p in ("q_norm", "k_norm", "sinks")) or getattr(attention, "sliding_window", None):
            return "its attention normalises queries and keys, has sinks or a sliding window"
        functions = ("apply_rotary_pos_emb", "eager_attention_forward")
        if not all(hasattr(sys.modules[type(attention).__module__], f) for f in functions):
            return "its attention's module has no apply_rotary_pos_emb or eager_attention_forward"
        if not all(hasattr(mlp, p) for p in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            return "its MLP layers are not gated (gate_proj, up_proj, down_proj)"
        norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
        if not all(hasattr(n, "weight") and hasattr(n, "variance_epsilon") for n in norms):
            return "its layers lack RMS norms before attention and MLP"
    if sliding_window(DynamicCache(config=model.config)) is not None:
        return "it has sliding-window attention layers"
    return ""
