"""Video sparse attention (VSA): trainable sparse self-attention over video tokens.

VSA ("Faster Video Diffusion with Trainable Sparse Attention", 2025) is FastVideo's attention for
its Wan models (the FastWan checkpoints). The semantics here are those of FastVideo's
`fastvideo_kernel.video_sparse_attn` and its attention backend `VideoSparseAttentionImpl`:

- Tiles. The tokens of a `(T, H, W)` grid (raster order, w fastest) are grouped into tiles of
  4 x 4 x 4 tokens, ordered t-tile, h-tile, w-tile; inside a tile the tokens keep raster order.
  A side that does not divide by 4 ends in a smaller tile. Each tile occupies 64 slots of a
  tile-major buffer, its valid tokens first; the padding slots hold zeros and are never attended.
- Coarse branch. q, k and v are averaged over each tile's valid tokens (a sum in float32 divided by
  the tile's token count, cast back to the input dtype); `scores = q_c k_c^T / sqrt(D)` over all
  tiles (there are no padding tiles), `out_c = softmax(scores) v_c`, broadcast to every token of
  the query tile.
- Selection. Each query tile keeps the `k = clamp(ceil((1 - sparsity) * tiles), 1, tiles)` key
  tiles of highest coarse score (per batch element and head), computed with Python's `math.ceil`
  on the float product exactly as FastVideo does (so sparsity 0.7 over 10 tiles keeps 4).
- Fine branch. Token attention of each query token over the valid tokens of its selected tiles.
- Output. `out_fine + out_c * gate`; without a gate the coarse branch is added with weight 1.

Backends (`backend=`), all returning the same numbers up to floating-point summation order:

- `kernel`: FastVideo's CUDA kernel (`fastvideo-kernel`, the optional extra `fv_accel[vsa]`),
  called on the tile-major padded buffer as FastVideo's own backend calls it. CUDA, bf16 (its
  Triton path computes in bf16), head dim 64 or 128.
- `flex`: PyTorch FlexAttention on the tile-major buffer with a `BlockMask` of block size 64 (one
  tile) built from the selected tiles; padding slots are masked by a `mask_mod` on edge tiles only.
  Compiled on CUDA. torch 2.13 has no FlexAttention backward on CPU: there it runs forward only.
- `gathered`: per query tile, SDPA over the selected key tiles gathered from the tile-major buffer,
  query tiles in chunks. Gradients on every device. On CPU a custom autograd function over torch's
  fused CPU attention kernels gathers into reused buffers and gathers again in the backward, so
  the memory kept for the backward is O(L * D); elsewhere plain SDPA under autograd keeps the
  gathered keys/values, `(1 - sparsity) * L^2 * D / 32` elements per head.
- `reference`: SDPA in raster order with the dense `[B, heads, L, L]` token mask of the selection
  (tests and small checks only).
- `auto`: `kernel` on CUDA when importable and the dtype and head size suit it, else `flex` on
  CUDA; `gathered` on every other device (it has a backward where FlexAttention has none).

`enable_vsa(transformer, sparsity)` installs VSA on the self-attention of a registered diffusers
transformer family (Wan 2.1/2.2 and SkyReels-V2 here; `register_vsa_family` declares another) and
adds the gate `to_gate_compress` (a zero-initialised Linear(dim, dim)) to each self-attention
module, so that the state dict carries it. See docs/sparse-attention.md.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Union

import torch
import torch.nn.functional as F

from fv_accel.attention_ops import apply_wan_rotary, flex_attention

logger = logging.getLogger(__name__)

TILE_SIZE = (4, 4, 4)
TILE_TOKENS = math.prod(TILE_SIZE)
BACKENDS = ("auto", "kernel", "flex", "gathered", "reference")
KERNEL_HEAD_DIMS = (64, 128)  # FastVideo's VideoSparseAttentionBackend.get_supported_head_sizes
# The gathered backend gathers the keys and values of its query tiles in chunks of at most this many
# elements (32 MB in float32: small enough for the allocator to reuse from chunk to chunk).
GATHER_CHUNK_ELEMENTS = 1 << 23


def topk_tiles(sparsity: float, num_tiles: int) -> int:
    """Key tiles kept per query tile (FastVideo's `_compute_cur_topk`)."""
    return max(1, min(math.ceil((1 - sparsity) * num_tiles), num_tiles))


def check_sparsity(sparsity: Any, what: str = "sparsity") -> float:
    if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not 0.0 <= float(sparsity) <= 1.0:
        raise ValueError(f"{what} must be a number in [0, 1], got {sparsity!r}")
    return float(sparsity)


def ramp_sparsity(step: int, sparsity: float, decay_rate: float = 0.0, decay_interval_steps: int = 0) -> float:
    """The training sparsity of optimizer step `step` (1-based, as logged): `sparsity` throughout
    when `decay_rate` is 0, else `min(sparsity, decay_rate * floor(step / decay_interval_steps))`,
    the ramp of FastVideo's VSA docs. It depends on the step alone, so a resumed run continues it."""
    if decay_rate <= 0:
        return float(sparsity)
    return float(min(sparsity, decay_rate * (int(step) // int(decay_interval_steps))))


@dataclass(frozen=True)
class VSAMetadata:
    """What a training forward attends with under VSA (the methods' `attn_metadata_vsa`): the
    token grid, the tiles along t, h, w and the step's sparsity."""

    grid: tuple[int, int, int]
    tiles: tuple[int, int, int]
    sparsity: float

    @classmethod
    def of(cls, latent_shape: Any, patch_size: tuple[int, int, int], sparsity: float) -> "VSAMetadata":
        """From a latent shape [B, C, T, H, W] and the transformer's (t, h, w) patch."""
        grid = tuple(int(n) // int(p) for n, p in zip(tuple(latent_shape)[2:], patch_size))
        tiles = tuple(math.ceil(g / t) for g, t in zip(grid, TILE_SIZE))
        return cls(grid, tiles, float(sparsity))  # type: ignore[arg-type]


def check_backend(backend: Any) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"VSA backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    return backend


# --------------------------------------------------------------------------------------------
# Tiles
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class TileLayout:
    """Where each token of a grid sits in the tile-major buffer (FastVideo's tile metadata); one
    object per (grid, device) (`tile_layout`), compared by identity."""

    grid: tuple[int, int, int]
    tiles: tuple[int, int, int]  # tiles along t, h, w
    slot: torch.Tensor  # [L] long: raster token -> slot of the tile-major buffer (tile * 64 + rank)
    token_of_slot: torch.Tensor  # [tiles * 64] long: slot -> raster token (0 in padding slots)
    tile_of_token: torch.Tensor  # [L] long: raster token -> its tile
    sizes: torch.Tensor  # [n] int32: valid tokens per tile (FastVideo's variable_block_sizes)
    valid: torch.Tensor  # [n, 64] bool: slot holds a token
    full: torch.Tensor  # [n] bool: tile has 64 tokens

    @property
    def num_tiles(self) -> int:
        return self.sizes.numel()

    @property
    def num_tokens(self) -> int:
        return self.slot.numel()

    @property
    def all_full(self) -> bool:
        return all(g % t == 0 for g, t in zip(self.grid, TILE_SIZE))


def _check_grid(grid: Any) -> tuple[int, int, int]:
    try:
        dims = tuple(int(g) for g in grid)
    except (TypeError, ValueError):
        dims = ()
    if len(dims) != 3 or min(dims) < 1 or any(int(g) != g for g in grid):
        raise ValueError(f"VSA grid must be three positive integers (T, H, W), got {grid!r}")
    return dims  # type: ignore[return-value]


@functools.lru_cache(maxsize=32)
def tile_layout(grid: tuple[int, int, int], device: Union[str, torch.device] = "cpu") -> TileLayout:
    """The tile layout of a token grid, built once per (grid, device)."""
    t, h, w = _check_grid(grid)
    tiles = tuple(math.ceil(g / s) for g, s in zip((t, h, w), TILE_SIZE))
    coords = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"), -1)
    coords = coords.reshape(-1, 3)  # raster order
    tile_xyz = coords // torch.tensor(TILE_SIZE)
    tile_of_token = (tile_xyz[:, 0] * tiles[1] + tile_xyz[:, 1]) * tiles[2] + tile_xyz[:, 2]
    # Inside a tile the tokens keep raster order, so a stable sort by tile gives tile-major order
    # and each token's rank inside its tile.
    order = torch.sort(tile_of_token, stable=True).indices
    sizes = torch.bincount(tile_of_token, minlength=math.prod(tiles))
    starts = torch.cumsum(sizes, 0) - sizes
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel()) - starts[tile_of_token[order]]
    slot = tile_of_token * TILE_TOKENS + rank
    valid = torch.arange(TILE_TOKENS)[None, :] < sizes[:, None]
    token_of_slot = torch.zeros(sizes.numel() * TILE_TOKENS, dtype=torch.long)
    token_of_slot[slot] = torch.arange(slot.numel())
    device = torch.device(device)
    return TileLayout(
        grid=(t, h, w),
        tiles=tiles,  # type: ignore[arg-type]
        slot=slot.to(device),
        token_of_slot=token_of_slot.to(device),
        tile_of_token=tile_of_token.to(device),
        sizes=sizes.to(device=device, dtype=torch.int32),
        valid=valid.to(device),
        full=(sizes == TILE_TOKENS).to(device),
    )


def to_tiles(x: torch.Tensor, layout: TileLayout) -> torch.Tensor:
    """[B, L, heads, D] raster -> [B, heads, tiles, 64, D] tile-major, zeros in padding slots."""
    b, _, heads, d = x.shape
    x = x.transpose(1, 2)
    if layout.all_full:
        out = x.index_select(2, layout.token_of_slot)  # no padding: a permutation
    else:
        out = x.new_zeros(b, heads, layout.num_tiles * TILE_TOKENS, d).index_copy(2, layout.slot, x)
    return out.view(b, heads, layout.num_tiles, TILE_TOKENS, d)


def from_tiles(x: torch.Tensor, layout: TileLayout) -> torch.Tensor:
    """[B, heads, tiles, 64, D] tile-major -> [B, L, heads, D] raster (padding slots dropped)."""
    b, heads, n, s, d = x.shape
    return x.reshape(b, heads, n * s, d).index_select(2, layout.slot).transpose(1, 2)


# --------------------------------------------------------------------------------------------
# The coarse branch and the selection (shared by every backend but the kernel, which has its own)
# --------------------------------------------------------------------------------------------


def tile_means(xt: torch.Tensor, layout: TileLayout) -> torch.Tensor:
    """[B, heads, tiles, 64, D] -> [B, heads, tiles, D]: mean over each tile's valid tokens
    (the padding slots are zeros), accumulated in float32 and cast back as FastVideo does."""
    return (xt.float().sum(dim=3) / layout.sizes.view(1, 1, -1, 1)).to(xt.dtype)


def coarse_attention(qt, kt, vt, layout: TileLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """(out_c [B, heads, tiles, D], scores [B, heads, tiles, tiles]) of the tile-mean attention."""
    q_c, k_c, v_c = (tile_means(x, layout) for x in (qt, kt, vt))
    scores = torch.matmul(q_c, k_c.transpose(-2, -1)) / math.sqrt(q_c.shape[-1])
    return torch.matmul(torch.softmax(scores, dim=-1), v_c), scores


def select_tiles(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[B, heads, tiles, k] long: the key tiles of highest coarse score per query tile."""
    return torch.topk(scores.detach(), k, dim=-1).indices


# --------------------------------------------------------------------------------------------
# Fine branches
# --------------------------------------------------------------------------------------------


def _padding_bias(layout: TileLayout, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """[tiles, 64]: 0 on tokens, -inf on padding slots (None when no tile has padding)."""
    if layout.all_full:
        return None
    return torch.zeros(layout.valid.shape, dtype=dtype, device=layout.valid.device).masked_fill(~layout.valid, float("-inf"))


class _TileGather:
    """The fine branch's inputs, chunk by chunk of query tiles: for each chunk, the keys and values
    of every query tile's selected tiles (one contiguous row of 64 x D values per tile of the
    tile-major buffer) and the padding bias of those tiles, shaped [B*heads, chunk, k*64, D]
    with the chunk's query tiles as SDPA's head dimension. `reuse`: gather into two buffers
    reused from chunk to chunk (no autograd through them); else fresh, autograd-tracked copies."""

    def __init__(self, kt: torch.Tensor, vt: torch.Tensor, idx: torch.Tensor, bias: Optional[torch.Tensor], reuse: bool):
        b, heads, n, s, d = kt.shape
        self.k = idx.shape[-1]
        self.bh, self.n, self.s, self.d = b * heads, n, s, d
        self.key_rows, self.value_rows = kt.reshape(b * heads * n, s * d), vt.reshape(b * heads * n, s * d)
        offsets = (torch.arange(b * heads, device=idx.device) * n).view(b, heads, 1, 1)
        self.rows = (idx + offsets).reshape(b * heads, n * self.k)
        self.tiles = idx.reshape(b * heads, n * self.k)
        self.bias = bias
        self.chunk = max(1, GATHER_CHUNK_ELEMENTS // max(1, 2 * b * heads * self.k * s * d))
        self.buffers = [self.key_rows.new_empty(self.bh * self.chunk * self.k, s * d) for _ in range(2)] if reuse else None

    def _rows(self, source: torch.Tensor, picked: torch.Tensor, which: int) -> torch.Tensor:
        if self.buffers is None:
            return source.index_select(0, picked)
        out = self.buffers[which][: picked.numel()]
        return torch.index_select(source, 0, picked, out=out)

    def __iter__(self):
        """(query tiles window, picked rows, keys, values, mask or None) per chunk."""
        k, s, d = self.k, self.s, self.d
        for start in range(0, self.n, self.chunk):
            c = min(self.chunk, self.n - start)
            cols = slice(start * k, (start + c) * k)
            picked = self.rows[:, cols].reshape(-1)
            shape = (self.bh, c, k * s, d)
            keys = self._rows(self.key_rows, picked, 0).view(shape)
            values = self._rows(self.value_rows, picked, 1).view(shape)
            mask = None
            if self.bias is not None:
                mask = self.bias.index_select(0, self.tiles[:, cols].reshape(-1)).view(self.bh, c, 1, k * s)
                mask = mask.expand(self.bh, c, s, k * s)
            yield slice(start, start + c), picked, keys, values, mask


def fine_gathered(qt, kt, vt, idx: torch.Tensor, layout: TileLayout) -> torch.Tensor:
    """Per query tile, SDPA over its selected key tiles gathered from the tile-major buffer. On CPU
    through `_CpuGatheredAttention` (torch's fused CPU kernels, reused buffers, no gathered copy
    kept for the backward); elsewhere plain SDPA under autograd."""
    bias = _padding_bias(layout, qt.dtype)
    if qt.device.type == "cpu":
        return _CpuGatheredAttention.apply(qt, kt, vt, idx, bias)
    b, heads, n, s, d = qt.shape
    outs = []
    for window, _, keys, values, mask in _TileGather(kt, vt, idx, bias, reuse=False):
        query = qt[:, :, window].reshape(keys.shape[0], -1, s, d)
        outs.append(F.scaled_dot_product_attention(query, keys, values, attn_mask=mask).view(b, heads, -1, s, d))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


class _CpuGatheredAttention(torch.autograd.Function):
    """The gathered fine branch on CPU through torch's fused CPU attention kernels. The chunks'
    keys and values are gathered into reused buffers (fresh multi-megabyte allocations cost more
    than the copy) and gathered again in the backward instead of being kept: the memory saved for
    the backward is O(L * D)."""

    @staticmethod
    def forward(ctx, qt, kt, vt, idx, bias):
        b, heads, n, s, d = qt.shape
        out, lse = torch.empty_like(qt), None
        for window, _, keys, values, mask in _TileGather(kt, vt, idx, bias, reuse=True):
            query = qt[:, :, window].reshape(keys.shape[0], -1, s, d)
            o, l = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, keys, values, attn_mask=mask)
            out[:, :, window] = o.view(b, heads, -1, s, d)
            if lse is None:
                lse = l.new_empty(b * heads, n, s)
            lse[:, window] = l
        ctx.save_for_backward(qt, kt, vt, idx, out, lse)
        ctx.bias = bias
        return out

    @staticmethod
    def backward(ctx, grad_out):
        qt, kt, vt, idx, out, lse = ctx.saved_tensors
        b, heads, n, s, d = qt.shape
        grad_q = torch.empty_like(qt)
        grad_k, grad_v = torch.zeros_like(kt), torch.zeros_like(vt)
        grad_k_rows, grad_v_rows = grad_k.view(b * heads * n, s * d), grad_v.view(b * heads * n, s * d)
        grad_out = grad_out.contiguous()
        for window, picked, keys, values, mask in _TileGather(kt, vt, idx, ctx.bias, reuse=True):
            rows = keys.shape[0]
            gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad_out[:, :, window].reshape(rows, -1, s, d), qt[:, :, window].reshape(rows, -1, s, d),
                keys, values, out[:, :, window].reshape(rows, -1, s, d), lse[:, window], 0.0, False, attn_mask=mask,
            )
            grad_q[:, :, window] = gq.view(b, heads, -1, s, d)
            grad_k_rows.index_add_(0, picked, gk.reshape(-1, s * d))
            grad_v_rows.index_add_(0, picked, gv.reshape(-1, s * d))
        return grad_q, grad_k, grad_v, None, None


def _ordered_blocks(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count [..., Q], indices [..., Q, KV]) int32 with the kept blocks first, as BlockMask wants."""
    count = keep.sum(-1, dtype=torch.int32)
    indices = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return count, indices


@functools.lru_cache(maxsize=32)
def _padding_mod(layout: TileLayout) -> Callable:
    """The mask_mod of the compiled kernel, which evaluates it on partial blocks only (the selected
    edge tiles): it hides their padding slots. One function object per layout, so that the
    compiled FlexAttention is reused from call to call (a new closure would recompile it)."""
    valid = layout.valid.reshape(-1)

    def padding_mod(batch, head, q_index, kv_index):
        return valid[kv_index]

    return padding_mod


def selection_block_mask(idx: torch.Tensor, layout: TileLayout, compiled: bool):
    """The FlexAttention BlockMask (block = one tile of 64 slots) of a selection [B, heads, n, k]:
    selected full tiles are full blocks, selected edge tiles partial blocks. Compiled, the kernel
    visits only these blocks and `mask_mod` hides the padding of partial ones; eager FlexAttention
    evaluates `mask_mod` everywhere, so there it states the whole rule (selection and padding)."""
    from torch.nn.attention.flex_attention import BlockMask

    b, heads, n, _ = idx.shape
    keep = torch.zeros(b, heads, n, n, dtype=torch.bool, device=idx.device).scatter_(-1, idx, True)
    full = keep & layout.full.view(1, 1, 1, n)
    partial = keep & ~layout.full.view(1, 1, 1, n)
    if compiled:
        mask_mod = _padding_mod(layout)
    else:
        valid = layout.valid.reshape(-1)

        def mask_mod(batch, head, q_index, kv_index):
            return keep[batch, head, q_index // TILE_TOKENS, kv_index // TILE_TOKENS] & valid[kv_index]

    full_count, full_indices = _ordered_blocks(full)
    partial_count, partial_indices = _ordered_blocks(partial)
    return BlockMask.from_kv_blocks(
        partial_count, partial_indices, full_count, full_indices,
        BLOCK_SIZE=TILE_TOKENS, mask_mod=mask_mod, seq_lengths=(n * TILE_TOKENS, n * TILE_TOKENS),
    )


def fine_flex(qt, kt, vt, idx: torch.Tensor, layout: TileLayout) -> torch.Tensor:
    b, heads, n, s, d = qt.shape
    mask = selection_block_mask(idx, layout, compiled=qt.is_cuda)
    flat = [x.reshape(b, heads, n * s, d) for x in (qt, kt, vt)]
    return flex_attention(*flat, mask).view(b, heads, n, s, d)


def fine_reference(q, k, v, idx: torch.Tensor, layout: TileLayout) -> torch.Tensor:
    """[B, L, heads, D] raster: SDPA with the dense token mask of the selection."""
    b, heads, n, _ = idx.shape
    keep = torch.zeros(b, heads, n, n, dtype=torch.bool, device=idx.device).scatter_(-1, idx, True)
    tile = layout.tile_of_token
    mask = keep[:, :, tile][:, :, :, tile]  # [B, heads, L, L]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return out.transpose(1, 2)


# --------------------------------------------------------------------------------------------
# FastVideo's kernel
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _kernel_function() -> Optional[Callable]:
    try:
        from fastvideo_kernel import video_sparse_attn
    except Exception:  # absent, or present without its compiled extension / triton
        return None
    return video_sparse_attn


def kernel_available() -> bool:
    return _kernel_function() is not None


def _kernel_suits(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype == torch.bfloat16 and q.shape[-1] in KERNEL_HEAD_DIMS


def kernel_attention(q, k, v, gate, layout: TileLayout, topk: int) -> torch.Tensor:
    """FastVideo's `video_sparse_attn` on the tile-major padded buffer [B, heads, tiles * 64, D]
    (its `VideoSparseAttentionImpl` tiles q, k, v and the gate the same way), back to raster."""
    fn = _kernel_function()
    if fn is None:
        raise RuntimeError("VSA backend 'kernel' needs fastvideo-kernel: pip install 'fv_accel[vsa]' (CUDA only)")
    if not _kernel_suits(q):
        raise ValueError(
            f"VSA backend 'kernel' runs on CUDA bf16 tensors with head dim {KERNEL_HEAD_DIMS}; got "
            f"{q.device.type} {q.dtype} head dim {q.shape[-1]}: use backend 'flex' or 'auto'"
        )
    b, _, heads, d = q.shape
    n = layout.num_tiles
    flat = [to_tiles(x, layout).reshape(b, heads, n * TILE_TOKENS, d).contiguous() for x in (q, k, v)]
    kwargs: dict[str, Any] = dict(variable_block_sizes=layout.sizes, topk=topk, block_size=TILE_SIZE)
    if gate is not None:
        kwargs["compress_attn_weight"] = to_tiles(gate, layout).reshape(b, heads, n * TILE_TOKENS, d).contiguous()
    # fastvideo-kernel >= 0.3 also takes the query tiles' sizes (equal to the key tiles' here).
    if "q_variable_block_sizes" in inspect.signature(fn).parameters:
        kwargs["q_variable_block_sizes"] = layout.sizes
    out = fn(*flat, **kwargs)
    return from_tiles(out.view(b, heads, n, TILE_TOKENS, d), layout)


# --------------------------------------------------------------------------------------------
# The public function
# --------------------------------------------------------------------------------------------


def resolve_backend(backend: str, q: torch.Tensor) -> str:
    """The backend `auto` stands for on this tensor (others unchanged)."""
    check_backend(backend)
    if backend != "auto":
        return backend
    if q.is_cuda:
        return "kernel" if kernel_available() and _kernel_suits(q) else "flex"
    return "gathered"


def video_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    grid: tuple[int, int, int],
    sparsity: float,
    gate: Optional[torch.Tensor] = None,
    backend: str = "auto",
) -> torch.Tensor:
    """VSA of [B, L, heads, D] tensors in raster (t, h, w) order over the token grid `grid`
    (L = T * H * W); returns [B, L, heads, D]. `gate` ([B, L, heads, D]) weighs the coarse branch
    per token and channel (None: weight 1). See the module docstring for the semantics."""
    sparsity = check_sparsity(sparsity)
    grid = _check_grid(grid)
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape or (gate is not None and gate.shape != q.shape):
        shapes = [tuple(x.shape) for x in (q, k, v) + ((gate,) if gate is not None else ())]
        raise ValueError(f"VSA takes q, k, v (and gate) of one shape [B, L, heads, D], got {shapes}")
    if q.shape[1] != math.prod(grid):
        raise ValueError(f"VSA: {q.shape[1]} tokens do not fill the grid {grid} ({math.prod(grid)} tokens)")
    layout = tile_layout(grid, q.device)
    topk = topk_tiles(sparsity, layout.num_tiles)
    backend = resolve_backend(backend, q)
    if backend == "kernel":
        return kernel_attention(q, k, v, gate, layout, topk)
    qt, kt, vt = (to_tiles(x, layout) for x in (q, k, v))
    out_c, scores = coarse_attention(qt, kt, vt, layout)
    idx = select_tiles(scores, topk)
    if backend == "reference":
        fine = fine_reference(q, k, v, idx, layout)
    else:
        fine_of = fine_flex if backend == "flex" else fine_gathered
        fine = from_tiles(fine_of(qt, kt, vt, idx, layout), layout)
    coarse = out_c[:, :, layout.tile_of_token].transpose(1, 2)  # [B, L, heads, D]
    return fine + (coarse if gate is None else coarse * gate)


def attention_flops(
    grid: tuple[int, int, int], heads: int, head_dim: int, sparsity: Optional[float], batch: int = 1
) -> float:
    """Forward FLOPs of the attention matmuls (2 per multiply-add): dense SDPA when `sparsity` is
    None; else VSA as its kernel computes it (fine branch over 64 slots per selected tile, the
    coarse branch over tiles)."""
    tokens = math.prod(grid)
    if sparsity is None:
        return 4.0 * batch * heads * tokens * tokens * head_dim
    n = math.prod(math.ceil(g / s) for g, s in zip(grid, TILE_SIZE))
    k = topk_tiles(sparsity, n)
    fine = 4.0 * batch * heads * (n * TILE_TOKENS) * (k * TILE_TOKENS) * head_dim
    coarse = 4.0 * batch * heads * n * n * head_dim
    return fine + coarse


# --------------------------------------------------------------------------------------------
# Installation on a diffusers transformer
# --------------------------------------------------------------------------------------------

GATE_NAME = "to_gate_compress"


@dataclass(frozen=True)
class VSACall:
    """What one transformer forward attends with: captured when the forward starts and carried by
    the rotary tables to every block, so gradient checkpointing recomputes with the same settings."""

    grid: tuple[int, int, int]
    sparsity: float
    backend: str


class VSAController:
    """The VSA settings of one transformer (`transformer.vsa`), read at the start of each forward:
    changing the sparsity costs nothing (the training ramp sets it every step)."""

    def __init__(self, family: str, sparsity: float, backend: str = "auto"):
        self.family = family
        self.sparsity = check_sparsity(sparsity, "VSA sparsity")
        self.backend = check_backend(backend)

    def set_sparsity(self, sparsity: float) -> None:
        self.sparsity = check_sparsity(sparsity, "VSA sparsity")

    @contextlib.contextmanager
    def use_sparsity(self, sparsity: float) -> Iterator[None]:
        """Forwards inside run at `sparsity`; the previous value returns after."""
        previous = self.sparsity
        self.set_sparsity(sparsity)
        try:
            yield
        finally:
            self.sparsity = previous

    def dense(self):
        """The dense view FastVideo evaluates beside the sparse one: sparsity 0 on the same weights
        (every key tile kept; the gated coarse branch stays, as in FastVideo)."""
        return self.use_sparsity(0.0)

    def __repr__(self) -> str:
        return f"VSAController(family={self.family!r}, sparsity={self.sparsity}, backend={self.backend!r})"


class VSARotary(tuple):
    """A plain (cos, sin) rotary pair that carries the forward's `VSACall` as `.vsa`."""


def _with_call(freqs: Any, call: VSACall) -> Any:
    """Attach `call` to the rotary tables; a tuple subclass made by another wrapper (the causal
    attention's) keeps its own attributes."""
    if type(freqs) is tuple:
        freqs = VSARotary(freqs)
    freqs.vsa = call
    return freqs


class VSARotaryEmbedding(torch.nn.Module):
    """Wraps a transformer's `rope`: the tables are the wrapped module's, and carry the token grid
    (from the latent shape and the patch size) and the controller's current settings."""

    def __init__(self, rope: torch.nn.Module, controller: VSAController, patch_size: tuple[int, int, int]):
        super().__init__()
        self.inner = rope
        self.controller = controller
        self.patch_size = tuple(int(p) for p in patch_size)

    def forward(self, hidden_states: torch.Tensor):
        _, _, frames, height, width = hidden_states.shape
        p_t, p_h, p_w = self.patch_size
        call = VSACall((frames // p_t, height // p_h, width // p_w), self.controller.sparsity, self.controller.backend)
        return _with_call(self.inner(hidden_states), call)


class WanVSAProcessor:
    """Self-attention of a Wan / SkyReels-V2 block (`attn1`, video tokens only) through VSA: the
    stock processor's projections, q/k norms and rotary embedding, then `video_sparse_attention`
    with the gate `attn.to_gate_compress(hidden_states)` (the block's modulated input, as in
    FastVideo's WanTransformerBlock_VSA)."""

    _attention_backend = None  # set by diffusers' set_attention_backend; VSA chooses its own
    _parallel_config = None

    def __call__(
        self,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        rotary_emb: Optional[tuple] = None,
    ) -> torch.Tensor:
        if encoder_hidden_states is not None:
            raise RuntimeError("the VSA processor is for self-attention over video tokens (attn1) only")
        if attention_mask is not None:
            raise RuntimeError(
                "VSA does not combine with the model's own attention mask (SkyReels-V2 with num_frame_per_block > 1)"
            )
        if self._parallel_config is not None:
            raise RuntimeError("VSA does not run under diffusers' context parallelism")
        call = getattr(rotary_emb, "vsa", None)
        if call is None:
            raise RuntimeError("the VSA processor needs the transformer's rope wrapped by enable_vsa()")
        if getattr(attn, "fused_projections", False):
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        query, key = attn.norm_q(query), attn.norm_k(key)
        gate_layer = getattr(attn, GATE_NAME)
        # A LoRA run trains the gate in fp32 beside a low-precision base: its input follows its weight.
        gate = gate_layer(hidden_states.to(gate_layer.weight.dtype))
        query, key, value, gate = (x.unflatten(2, (attn.heads, -1)) for x in (query, key, value, gate))
        query = apply_wan_rotary(query, *rotary_emb)
        key = apply_wan_rotary(key, *rotary_emb)
        out = video_sparse_attention(
            query, key, value, grid=call.grid, sparsity=call.sparsity, gate=gate.type_as(query), backend=call.backend
        )
        out = out.flatten(2, 3).type_as(query)
        out = attn.to_out[0](out)
        return attn.to_out[1](out)


@dataclass(frozen=True)
class VSAFamily:
    """How VSA installs on one transformer class: its self-attention modules over video tokens,
    the processor that runs them, and where the rotary module and patch size live."""

    family: str
    self_attention: Callable[[torch.nn.Module], list]
    processor: Callable[[], Any] = WanVSAProcessor
    rope_attr: str = "rope"


_FAMILIES: dict[str, VSAFamily] = {}


def register_vsa_family(transformer_class: str, family: VSAFamily) -> None:
    """Declare that `enable_vsa` serves transformers of class name `transformer_class`."""
    _FAMILIES[transformer_class] = family


def vsa_family(transformer: torch.nn.Module) -> VSAFamily:
    name = type(transformer).__name__
    if name not in _FAMILIES:
        served = ", ".join(f"{f.family} ({cls})" for cls, f in _FAMILIES.items())
        raise ValueError(f"video sparse attention does not serve {name}: it serves {served}")
    return _FAMILIES[name]


def _blocks_self_attention(transformer: torch.nn.Module) -> list:
    return [block.attn1 for block in transformer.blocks]


register_vsa_family("WanTransformer3DModel", VSAFamily("Wan", _blocks_self_attention))
register_vsa_family("SkyReelsV2Transformer3DModel", VSAFamily("SkyReels-V2", _blocks_self_attention))


def _add_gate(attn: torch.nn.Module) -> bool:
    """Give a self-attention module its gate, zero-initialised (absent from stock checkpoints,
    so sparsity 0 with a new gate is dense attention); an existing gate is kept. True if added."""
    if isinstance(getattr(attn, GATE_NAME, None), torch.nn.Linear):
        return False
    ref = attn.to_out[0].weight
    gate = torch.nn.Linear(attn.to_out[0].out_features, attn.inner_dim, bias=True, device=ref.device, dtype=ref.dtype)
    with torch.no_grad():
        gate.weight.zero_()
        gate.bias.zero_()
    gate.requires_grad_(ref.requires_grad)
    setattr(attn, GATE_NAME, gate)
    return True


def enable_vsa(transformer: torch.nn.Module, sparsity: float, backend: str = "auto") -> VSAController:
    """Run the video self-attention of a stock diffusers transformer through VSA at `sparsity`,
    adding the gates `<block>.attn1.to_gate_compress` (zero-initialised where absent). Idempotent:
    on a transformer that has it, only the sparsity and backend change. Returns the controller
    (also `transformer.vsa`); its `set_sparsity` and `dense()` change the attention at run time."""
    sparsity = check_sparsity(sparsity, "VSA sparsity")
    check_backend(backend)
    controller = getattr(transformer, "vsa", None)
    if isinstance(controller, VSAController):
        controller.set_sparsity(sparsity)
        controller.backend = backend
        return controller
    family = vsa_family(transformer)
    if getattr(transformer, "causal_attention", None) is not None:
        # Its self-attention processors hold the block-causal rule, which VSA's would replace.
        raise ValueError(f"video sparse attention does not combine with block-causal attention on {type(transformer).__name__}")
    patch_size = tuple(int(p) for p in transformer.config.patch_size)
    controller = VSAController(family.family, sparsity, backend)
    added = 0
    for attn in family.self_attention(transformer):
        added += _add_gate(attn)
        attn.set_processor(family.processor())
    rope = getattr(transformer, family.rope_attr)
    setattr(transformer, family.rope_attr, VSARotaryEmbedding(rope, controller, patch_size))
    transformer.vsa = controller
    logger.info(
        "VSA on %s (%s): sparsity %s, backend %s, %d new gates",
        type(transformer).__name__, family.family, sparsity, backend, added,
    )
    return controller


def vsa_controller(transformer: torch.nn.Module) -> Optional[VSAController]:
    """The transformer's VSA controller, or None when VSA is not enabled on it."""
    controller = getattr(transformer, "vsa", None)
    return controller if isinstance(controller, VSAController) else None


# --------------------------------------------------------------------------------------------
# Gates in checkpoints (ours and FastVideo's FastWan)
# --------------------------------------------------------------------------------------------

# FastVideo's Wan with VSA (fastvideo/models/dits/wanvideo.py, WanTransformerBlock_VSA) holds the
# gate on the block, `blocks.N.to_gate_compress` (a Linear with bias); its param_names_mapping has
# no entry for it, so its diffusers-format checkpoints (FastVideo/FastWan2.1-T2V-1.3B-Diffusers)
# store `blocks.N.to_gate_compress.{weight,bias}`. Here it lives on the self-attention module.
_FASTWAN_GATE = re.compile(r"^(?P<prefix>(?:.*\.)?blocks\.\d+)\.to_gate_compress\.(?P<param>weight|bias)$")


def fastwan_key_to_ours(key: str) -> str:
    """A FastWan checkpoint key -> ours: `blocks.N.to_gate_compress.*` -> `blocks.N.attn1.to_gate_compress.*`;
    every other key is unchanged (the rest of a FastWan diffusers checkpoint is diffusers' layout)."""
    m = _FASTWAN_GATE.match(key)
    return f"{m['prefix']}.attn1.{GATE_NAME}.{m['param']}" if m else key


def is_gate_key(key: str) -> bool:
    return f".{GATE_NAME}." in key


# The prefix of transformer keys in diffusers' LoRA files (`pytorch_lora_weights.safetensors`),
# where a LoRA run with VSA keeps its trained gates beside the adapter.
LORA_FILE_PREFIX = "transformer."


def gate_key_to_ours(key: str) -> str:
    """A gate key of any checkpoint we read (ours, FastWan's, a LoRA file's) -> the transformer's."""
    if key.startswith(LORA_FILE_PREFIX):
        key = key[len(LORA_FILE_PREFIX):]
    return fastwan_key_to_ours(key)


def split_gates(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the gate entries, the rest) of a state dict: a LoRA file of a VSA run holds both."""
    gates = {k: v for k, v in state.items() if is_gate_key(k)}
    return gates, {k: v for k, v in state.items() if k not in gates}


def gate_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The gates of a transformer state dict, detached fp32 copies on the CPU (what a LoRA run
    writes beside its adapter)."""
    return {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in state.items() if is_gate_key(k)}


def read_gate_tensors(source: Union[str, Path, Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The gate tensors (our names) of a state dict, or of the safetensors files of a folder."""
    if isinstance(source, Mapping):
        return {gate_key_to_ours(k): v for k, v in source.items() if is_gate_key(k)}
    from safetensors import safe_open

    folder = Path(source)
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else [folder]
    if not files or not all(f.is_file() for f in files):
        raise FileNotFoundError(f"VSA gates: no safetensors weights at {folder}")
    out: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if is_gate_key(key):
                    out[gate_key_to_ours(key)] = f.get_tensor(key)
    return out


def load_vsa_gates(transformer: torch.nn.Module, source: Union[str, Path, Mapping[str, torch.Tensor]]) -> int:
    """Load the trained gates of a checkpoint (a transformer folder or file of safetensors, ours or
    FastWan's, or a state dict) into a transformer with VSA enabled; returns how many tensors.
    A stock `from_pretrained` drops them as unexpected keys; this puts them back. Every gate of
    the transformer must be found, or nothing is loaded."""
    if vsa_controller(transformer) is None:
        raise RuntimeError("load_vsa_gates: call enable_vsa(transformer, sparsity) first")
    gates = read_gate_tensors(source)
    own = {k: v for k, v in transformer.state_dict().items() if is_gate_key(k)}
    missing = sorted(set(own) - set(gates))
    if missing:
        where = source if not isinstance(source, Mapping) else "the state dict"
        raise KeyError(f"VSA gates: {where} has no {missing[0]} ({len(missing)} of {len(own)} gate tensors missing)")
    for key, tensor in gates.items():
        if key in own and tuple(tensor.shape) != tuple(own[key].shape):
            raise ValueError(
                f"VSA gates: {key} has shape {tuple(tensor.shape)}, the transformer's is {tuple(own[key].shape)}"
            )
    transformer.load_state_dict({k: gates[k] for k in own}, strict=False)
    return len(own)


def load_vsa_lora(
    pipe: Any,
    source: Union[str, Path],
    sparsity: float,
    *,
    backend: str = "auto",
    weight_name: Optional[str] = None,
    adapter_name: Optional[str] = None,
) -> VSAController:
    """Load the LoRA of a run trained with VSA (its adapter file holds the adapter and the trained
    gates, `transformer.blocks.N.attn1.to_gate_compress.*`) into a diffusers pipeline:
    `enable_vsa(pipe.transformer, sparsity)`, the gates, then the adapter through the transformer's
    `load_lora_adapter` with the file's adapter metadata (alpha as trained). diffusers'
    `load_lora_weights` refuses a file with keys that are not LoRA's. `source`: the file, or the
    folder holding `weight_name` (default: diffusers' `pytorch_lora_weights.safetensors`, the
    file a LoRA run writes). Returns the controller."""
    import json

    from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY, LORA_WEIGHT_NAME_SAFE
    from safetensors import safe_open

    path = Path(source)
    path = path / (weight_name or LORA_WEIGHT_NAME_SAFE) if path.is_dir() else path
    if not path.is_file():
        raise FileNotFoundError(f"load_vsa_lora: no LoRA file at {path}")
    with safe_open(str(path), framework="pt") as f:
        gates, adapter = split_gates({k: f.get_tensor(k) for k in f.keys()})
        raw = (f.metadata() or {}).get(LORA_ADAPTER_METADATA_KEY)
    if not gates:
        raise KeyError(f"load_vsa_lora: {path} holds no VSA gates (to_gate_compress): load it with load_lora_weights")
    metadata = json.loads(raw) if raw else None  # keys `transformer.<field>`, as load_lora_adapter reads them
    controller = enable_vsa(pipe.transformer, sparsity, backend)
    load_vsa_gates(pipe.transformer, gates)  # their keys, `transformer.`-prefixed, read as ours
    pipe.transformer.load_lora_adapter(adapter, prefix="transformer", metadata=metadata, adapter_name=adapter_name)
    return controller
