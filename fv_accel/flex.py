"""One FlexAttention call shared by the block-causal attention (fv_accel/models/attention.py) and
video sparse attention (fv_accel/vsa.py): compiled on CUDA, where FlexAttention is a fused kernel;
eager elsewhere (forward only on the CPU)."""

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
