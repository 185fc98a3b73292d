"""Attention pieces shared by the block-causal processors (fv_accel/models/attention.py) and video
sparse attention (fv_accel/vsa.py): one FlexAttention call (compiled on CUDA, where FlexAttention is
a fused kernel; eager elsewhere, forward only on the CPU) and Wan's rotary embedding."""

from __future__ import annotations

import warnings

import torch

_compiled_flex = None


def flex_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask) -> torch.Tensor:
    """FlexAttention of [B, heads, L, D] tensors under `block_mask`."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention as _flex

    if query.is_cuda:
        if _compiled_flex is None:
            _compiled_flex = torch.compile(_flex, dynamic=False)
        return _compiled_flex(query, key, value, block_mask=block_mask)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return _flex(query, key, value, block_mask=block_mask)


def apply_wan_rotary(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary embedding on interleaved pairs, as diffusers' WanAttnProcessor applies it
    (computed in the rotary tables' precision)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = freqs_cos[..., 0::2], freqs_sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)
