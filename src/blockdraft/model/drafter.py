"""The DFlash drafter: Qwen3-style layers whose keys/values also cover the projected target context (KV injection).

Parameter names are exactly the export format's (`fc`, `hidden_norm`, `layers.{i}.…`, `norm`; a DFlash2 drafter adds
`layers.{i}.attention_conv.…`, `layers.{i}.mlp_conv.…` and `candidate_selector.…`), so `state_dict()` is the export
tensor set. One class for both architectures: `spec.dflash2` adds DFlash2's modules (`blockdraft.model.dflash2`) to the
same forward, which training and the cached draft step share. Shapes: b = batch, S = context length, Q = block (query)
length, H = hidden size, K = number of target feature layers, h/g = query/KV heads, d = head dim.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from blockdraft.errors import ArtifactError, SpecError
from blockdraft.model.attention import FULL_ATTENTION, SLIDING_ATTENTION, layer_masks
from blockdraft.model.block_sparse import AnchorLayout, sparse_attention
from blockdraft.model.dflash2 import CandidateSelector, GroupedDynamicCausalConv
from blockdraft.model.rope import apply_rope, rope_cos_sin, rope_tables
from blockdraft.model.spec import DrafterSpec

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: statistics in fp32, scale applied in the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """Block queries attend to [injected context K/V ; block K/V]; q_norm/k_norm per head, RoPE, GQA."""

    def __init__(self, spec: DrafterSpec) -> None:
        super().__init__()
        h, g, d, hidden = spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim, spec.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = h, g, d
        self.q_proj = nn.Linear(hidden, h * d, bias=False)
        self.k_proj = nn.Linear(hidden, g * d, bias=False)
        self.v_proj = nn.Linear(hidden, g * d, bias=False)
        self.o_proj = nn.Linear(h * d, hidden, bias=False)
        self.q_norm = RMSNorm(d, spec.rms_norm_eps)
        self.k_norm = RMSNorm(d, spec.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n_heads: int) -> torch.Tensor:
        """[b, n, heads*d] -> [b, heads, n, d]."""
        b, n, _ = x.shape
        return x.view(b, n, n_heads, self.head_dim).transpose(1, 2)

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K (k_norm, RoPE) and V [b, g, n, d] of x [b, n, H]; the same for context and block entries."""
        k = apply_rope(self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads)), cos, sin)
        return k, self._heads(self.v_proj(x), self.num_kv_heads)

    def forward(
        self,
        x: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | BlockMask | None,
    ) -> torch.Tensor:
        """x [b, Q, H] (already input_layernorm'd), ctx_k/ctx_v [b, g, S, d], mask [b, 1, Q, S+Q] bool, None (see
        everything) or a FlexAttention BlockMask (the block-sparse training path) -> [b, Q, H]."""
        q = apply_rope(self.q_norm(self._heads(self.q_proj(x), self.num_heads)), cos, sin)
        k, v = self.key_value(x, cos, sin)
        k = torch.cat((ctx_k, k), dim=2)
        v = torch.cat((ctx_v, v), dim=2)
        out = attend(q, k, v, mask)
        b, _, n, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, n, self.num_heads * self.head_dim))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | BlockMask | None) -> torch.Tensor:
    """q [b, h, Q, d], k/v [b, g, K, d] (g divides h) -> [b, h, Q, d]: FlexAttention for a BlockMask, else SDPA with the
    dense mask [b, 1, Q, K] bool or None. Grouped K/V heads are read in place, except in the one case noted below."""
    if isinstance(mask, BlockMask):
        return sparse_attention(q, k, v, mask)
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and mask is not None and q.device.type == "cuda":
        # CUDA's fused SDPA kernels take grouped K/V only without a mask; with one, enable_gqa would fall back to the
        # unfused kernel that stores every score, so a masked call gets K/V per query head instead.
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])


class DecoderLayer(nn.Module):
    """Pre-norm residual layer; the context enters only as extra K/V of the attention.

    DFlash2: inside each residual branch a grouped dynamic causal convolution runs over the block slots before and after
    the sublayer (`attention_conv`, `mlp_conv`); the residual itself and the context are untouched."""

    def __init__(self, spec: DrafterSpec) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec.hidden_size, spec.intermediate_size)
        self.attention_conv: GroupedDynamicCausalConv | None = None
        self.mlp_conv: GroupedDynamicCausalConv | None = None
        if spec.dflash2 is not None:
            taps, group = spec.dflash2.conv_kernel_size, spec.dflash2.conv_group_size
            self.attention_conv = GroupedDynamicCausalConv(spec.hidden_size, taps, group, spec.block_size)
            self.mlp_conv = GroupedDynamicCausalConv(spec.hidden_size, taps, group, spec.block_size)

    def forward(self, hidden, ctx_k, ctx_v, cos, sin, mask):
        """hidden [b, Q, H] -> [b, Q, H]; ctx_k/ctx_v [b, g, S, d] this layer's context K/V; cos/sin [b, Q, d]."""
        x = self.input_layernorm(hidden)
        if self.attention_conv is None:
            hidden = hidden + self.self_attn(x, ctx_k, ctx_v, cos, sin, mask)
            return hidden + self.mlp(self.post_attention_layernorm(hidden))
        assert self.mlp_conv is not None  # built together
        x, after = self.attention_conv.prepare(x)
        hidden = hidden + self.attention_conv.finish(self.self_attn(x, ctx_k, ctx_v, cos, sin, mask), after)
        x, after = self.mlp_conv.prepare(self.post_attention_layernorm(hidden))
        return hidden + self.mlp_conv.finish(self.mlp(x), after)


class DFlashDrafter(nn.Module):
    """The drafter. Its embeddings and LM head are the target's (see `blockdraft.model.target.TargetHead`)."""

    def __init__(self, spec: DrafterSpec) -> None:
        super().__init__()
        self.spec = spec
        k, hidden = spec.num_target_features, spec.hidden_size
        self.fc = nn.Linear(k * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, spec.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.num_layers))
        self.norm = RMSNorm(hidden, spec.rms_norm_eps)
        self.candidate_selector: CandidateSelector | None = None
        if spec.dflash2 is not None:
            self.candidate_selector = CandidateSelector(hidden, spec.vocab_size, spec.dflash2.selector_rank,
                                                        spec.dflash2.selector_top_k)
        # fp32 on the CPU and not a buffer: no dtype cast of the module degrades it, and state_dict stays the export set
        self.rope_inv_freq, self.rope_attention_factor = rope_tables(
            spec.head_dim, spec.rope_theta, spec.rope_scaling, spec.max_position_embeddings
        )
        # train.activation_checkpointing (the trainer sets it): in a forward with gradients each layer keeps only its
        # inputs and runs again in backward, trading compute for activation memory
        self.checkpoint_layers: bool = False

    def project_context(self, target_features: torch.Tensor) -> torch.Tensor:
        """Target features [b, S, K*H] -> context C [b, S, H] (fc, then hidden_norm)."""
        return self.hidden_norm(self.fc(target_features))

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(positions, self.rope_inv_freq, self.rope_attention_factor, dtype)

    def context_key_values(
        self, context: torch.Tensor, positions: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's K/V [b, g, S, d] of context C [b, S, H] at positions [b, S]; C enters k/v_proj as it is."""
        cos, sin = self._rope(positions, context.dtype)
        return [cast(DecoderLayer, layer).self_attn.key_value(context, cos, sin) for layer in self.layers]

    def run_block(
        self,
        block_hidden: torch.Tensor,
        block_positions: torch.Tensor,
        context_kv: list[tuple[torch.Tensor, torch.Tensor]],
        attention_mask: torch.Tensor | AnchorLayout | None = None,
        context_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Block embeddings [b, Q, H] at positions [b, Q] with per-layer context K/V -> hidden [b, Q, H] after `norm`.

        attention_mask [b, 1, Q, S+Q] bool is the full-attention layers' mask (None: see everything); a sliding layer
        sees that AND its causal window over positions (context_positions [b, S], None: 0..S-1, the draft cache's).
        An `AnchorLayout` (the packed training batch) runs the block-sparse path instead: the same pattern as a
        BlockMask. DFlash2: the block embeddings are scaled by `input_embedding_scale` first, and the convolutions take
        the slots as blocks of `block_size` back to back (a shorter Q is one block)."""
        if self.spec.dflash2 is not None and self.spec.dflash2.input_embedding_scale != 1.0:
            block_hidden = block_hidden * self.spec.dflash2.input_embedding_scale
        cos, sin = self._rope(block_positions, block_hidden.dtype)
        if isinstance(attention_mask, AnchorLayout):
            masks = self._block_masks(attention_mask)
        else:
            masks = self._layer_masks(attention_mask, block_positions, context_kv[0][0].shape[2], context_positions)
        hidden = block_hidden
        recompute = self.checkpoint_layers and torch.is_grad_enabled()
        for layer, kind, (ctx_k, ctx_v) in zip(self.layers, self.spec.layer_types, context_kv, strict=True):
            if recompute:
                from torch.utils.checkpoint import checkpoint

                hidden = checkpoint(layer, hidden, ctx_k, ctx_v, cos, sin, masks[kind], use_reentrant=False)
            else:
                hidden = layer(hidden, ctx_k, ctx_v, cos, sin, masks[kind])
        return self.norm(hidden)

    def _block_masks(self, layout: AnchorLayout) -> dict[str, BlockMask]:
        """One BlockMask per distinct layer kind, built once per forward and shared by the layers of that kind."""
        window = {FULL_ATTENTION: None, SLIDING_ATTENTION: self.spec.sliding_window}
        causal = self.spec.dflash2 is None  # DFlash2's sliding layers are not causal
        return {kind: layout.block_mask(window[kind], causal) for kind in set(self.spec.layer_types)}

    def _layer_masks(
        self, base: torch.Tensor | None, block_positions: torch.Tensor, context_len: int,
        context_positions: torch.Tensor | None
    ) -> dict[str, torch.Tensor | None]:
        """One mask per distinct layer kind; only sliding layers need the key positions."""
        if not self.spec.has_sliding:
            return {FULL_ATTENTION: base}
        if context_positions is None:
            b = block_positions.shape[0]
            context_positions = torch.arange(context_len, device=block_positions.device).expand(b, context_len)
        keys = torch.cat((context_positions, block_positions), dim=1)
        return layer_masks(self.spec.layer_types, base, block_positions, keys, self.spec.sliding_window,
                           self.spec.dflash2 is None)

    def forward(
        self,
        block_hidden: torch.Tensor,
        context: torch.Tensor,
        block_positions: torch.Tensor,
        context_positions: torch.Tensor,
        attention_mask: torch.Tensor | AnchorLayout | None = None,
    ) -> torch.Tensor:
        """block_hidden [b, Q, H], context C [b, S, H] (from `project_context`), positions [b, Q] / [b, S] long,
        attention_mask [b, 1, Q, S+Q] bool (True = may attend; keys are context then block), None (see everything) or
        the batch's AnchorLayout (block-sparse) -> hidden [b, Q, H] after the final norm. Sliding layers narrow the mask
        to their causal window (`run_block`)."""
        context_kv = self.context_key_values(context, context_positions)
        return self.run_block(block_hidden, block_positions, context_kv, attention_mask, context_positions)

    @classmethod
    def from_pretrained(
        cls, path: str | Path, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> DFlashDrafter:
        """Load the export format (config.json + model.safetensors); strict: every tensor present, nothing extra.

        `dtype` None keeps the stored dtype."""
        path = Path(path)
        config_path = path / CONFIG_NAME
        if not config_path.is_file():
            raise ArtifactError(f"no {CONFIG_NAME} in {path}; pass a drafter folder in the export format")
        spec = DrafterSpec.from_export_config(json.loads(config_path.read_text()))
        model = cls(spec)
        state = load_file(str(path / WEIGHTS_NAME))
        expected = model.state_dict()
        missing = sorted(set(expected) - set(state))
        extra = sorted(set(state) - set(expected))
        if missing or extra:
            raise SpecError(f"{path / WEIGHTS_NAME} does not match its config: missing {missing[:3]}, unexpected "
                            f"{extra[:3]}")
        wrong = [n for n, t in state.items() if t.shape != expected[n].shape]
        if wrong:
            raise SpecError(f"{path / WEIGHTS_NAME}: tensor {wrong[0]} has shape {tuple(state[wrong[0]].shape)}, "
                            f"config needs {tuple(expected[wrong[0]].shape)}")
        model.load_state_dict(state, strict=True)
        # keep the stored precision unless asked otherwise (load_state_dict copied it into fp32 parameters)
        return model.to(device=device, dtype=dtype or state["fc.weight"].dtype)

    def save_pretrained(self, path: str | Path, dtype: torch.dtype | None = None) -> list[Path]:
        """Write config.json + model.safetensors (the export format); returns the two paths.

        `dtype` None stores the parameters' own dtype; else every tensor is cast to it on the way out (the module
        itself, e.g. fp32 master weights, is left as it is), and config.json's "dtype" names it."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {name: t.detach().to(device="cpu", dtype=dtype).contiguous() for name, t in self.state_dict().items()}
        config = self.spec.to_export_config()
        config["dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
        weights = path / WEIGHTS_NAME
        save_file(state, str(weights), metadata={"format": "pt"})
        config_path = path / CONFIG_NAME
        config_path.write_text(json.dumps(config, indent=2) + "\n")
        return [config_path, weights]


class DraftCache:
    """Per-layer context K/V [b, g, length, d] (after k_norm and RoPE). Holds context entries only, never block K/V."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    @property
    def length(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def append(self, new_kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if not self.keys:
            self.keys = [k for k, _ in new_kv]
            self.values = [v for _, v in new_kv]
            return
        self.keys = [torch.cat((old, k), dim=2) for old, (k, _) in zip(self.keys, new_kv, strict=True)]
        self.values = [torch.cat((old, v), dim=2) for old, (_, v) in zip(self.values, new_kv, strict=True)]

    def crop(self, n: int) -> None:
        """Keep the first n context positions."""
        self.keys = [k[:, :, :n] for k in self.keys]
        self.values = [v[:, :, :n] for v in self.values]

    def layer_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return list(zip(self.keys, self.values, strict=True))


@torch.no_grad()
def draft_step(
    drafter: DFlashDrafter,
    cache: DraftCache,
    new_target_features: torch.Tensor,
    block_hidden: torch.Tensor,
    start: int,
) -> torch.Tensor:
    """One draft: new context features [b, n, K*H] for positions cache.length..start-1, block embeddings [b, B, H] at
    positions start..start+B-1 -> hidden [b, B, H] after `norm`. A full-attention layer's block sees all cached context
    and the whole block; a sliding layer's query at q sees positions q-W+1..q (cached context and block, causal).
    The cache keeps every context position; afterwards it holds context 0..start-1 only."""
    b, n, _ = new_target_features.shape
    if cache.length + n != start:
        raise ValueError(f"draft_step: cache holds {cache.length} positions + {n} new != start {start}")
    device = block_hidden.device
    if n:
        positions = torch.arange(cache.length, start, device=device).expand(b, n)
        cache.append(drafter.context_key_values(drafter.project_context(new_target_features), positions))
    block_len = block_hidden.shape[1]
    block_positions = torch.arange(start, start + block_len, device=device).expand(b, block_len)
    hidden = drafter.run_block(block_hidden, block_positions, cache.layer_kv())
    cache.crop(start)
    return hidden
