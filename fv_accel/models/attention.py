"""Block-causal self-attention for diffusers Wan-family transformers (REFERENCE.md section 5).

Attention is bidirectional inside a block of `block_size` latent frames and causal across blocks:
a query in block k sees the keys of every frame before the end of block k. Optionally the keys
are limited to a sliding window of the last `local_attn_size` frames (counted from the block's
end) plus the first `sink_size` frames ("attention sinks"), which stay visible.

A student whose first `prefix_frames` latent frames are a clean condition (Wan2.2-TI2V-5B
image-to-video: the first frame) makes them a block of their own, and the blocks of `block_size`
start after them: [0, p), [p, p + B), [p + B, p + 2B), ... The noise chunks of diffusion forcing
are drawn over the frames after the condition (fv_accel/methods), so each noise chunk is one
attention block: no frame sees a frame of a later chunk, and the condition frame sees only itself.

Installed as a diffusers attention processor on the self-attention (`attn1`) of every block of a
`WanTransformer3DModel` or `SkyReelsV2Transformer3DModel`; cross-attention is left unchanged.
Visibility depends only on (query frame, key frame), so every rule is a small frame-level boolean
matrix `[F_q, F_k]`; no token-level `[L, L]` mask is ever built outside the test reference.
Backends:

- `chunked`: for each group of query frames with the same visible frames (a block), plain SDPA of
  those queries over the visible keys, sliced out of K/V. No mask tensor at all, so fused flash
  kernels apply on GPU; works with gradients everywhere.
- `flex`: PyTorch FlexAttention with a `BlockMask` built once per token grid and cached. Its
  per-tile structure is derived exactly from the frame matrix (a tile is empty, full or partial
  according to the frame rectangle it covers), so building it costs O(tiles), never O(L^2).
  torch 2.13 runs it forward on CPU (unfused) but has no CPU backward.
- `auto`: flex on CUDA, chunked elsewhere.
- `dense` (reference for tests): SDPA with the expanded boolean `[L, L]` mask.

Three token layouts reach the processors, carried by the rotary embedding tuple the transformer
passes to each block (so gradient checkpointing recomputes with the layout of the forward):

- `sequence`: the plain video, frames 0..T-1;
- `teacher_forcing`: [clean frames 0..T-1 | noisy frames 0..T-1] (2T frames, both halves at the
  same positions): the clean half is block-causal among itself; noisy block b sees its own noisy
  block and the clean copies of blocks < b (TeacherForcingSFTMethod);
- `kv_cache`: one block of frames at absolute offset s, attending to cached keys/values of the
  finished frames (the autoregressive rollout in `fv_accel.rollout`).
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

from fv_accel.attention_ops import apply_wan_rotary, flex_attention

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "flex", "chunked", "dense")
LAYOUTS = ("sequence", "teacher_forcing", "kv_cache")
FLEX_BLOCK_SIZE = 128  # FlexAttention's default tile, in tokens


# A saved causal student says so in its transformer's config.json under this private key:
# diffusers passes `_`-prefixed keys to no constructor argument (so the folder loads unchanged, with
# full attention) but keeps them in `model.config`, where fv_accel reads it back to warn when a
# recipe would lose the causal mask.
SAVED_ATTENTION_KEY = "_fv_accel_attention"


def attention_record(spec: Optional["CausalSpec"]) -> Optional[dict]:
    """The JSON description of a student's self-attention (None: full, diffusers' own)."""
    if spec is None:
        return None
    return {
        "causal": True,
        "block_size": spec.block_size,
        "local_attn_size": spec.local_attn_size,
        "sink_size": spec.sink_size,
        "note": "block-causal self-attention over latent frames; plain diffusers loads these weights with "
        "full attention: load with fv_accel (models.student.causal: true, method.chunk_size: block_size)",
    }


def mark_saved_attention(config_path, record: Optional[dict]) -> None:
    """Write a saved transformer's attention record into its config.json; for full attention, drop
    a record inherited from the base model's config (a causal base fine-tuned bidirectionally)."""
    import json
    import os
    from pathlib import Path

    path = Path(config_path)
    config = json.loads(path.read_text(encoding="utf-8"))
    if record is None:
        if SAVED_ATTENTION_KEY not in config:
            return
        del config[SAVED_ATTENTION_KEY]
    else:
        config[SAVED_ATTENTION_KEY] = record
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def saved_attention_mismatch(saved: Optional[dict], spec: Optional["CausalSpec"], model_id: str) -> Optional[str]:
    """A warning when the recipe's attention differs from the one the weights were trained with."""
    if not saved or not saved.get("causal"):
        return None
    trained = (
        f"block-causal attention (block size {saved.get('block_size')}, local_attn_size "
        f"{saved.get('local_attn_size', -1)}, sink_size {saved.get('sink_size', 0)})"
    )
    if spec is None:
        return (
            f"model '{model_id}' was trained with {trained} but is loaded here with full attention: "
            f"set models.student.causal: true and method.chunk_size: {saved.get('block_size')} to keep it causal"
        )
    if (spec.block_size, spec.local_attn_size, spec.sink_size) != (
        saved.get("block_size"), saved.get("local_attn_size", -1), saved.get("sink_size", 0)
    ):
        return (
            f"model '{model_id}' was trained with {trained}; this run uses block size {spec.block_size}, "
            f"local_attn_size {spec.local_attn_size}, sink_size {spec.sink_size}"
        )
    return None


# --------------------------------------------------------------------------------------------
# What is visible: frame-level rules
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CausalSpec:
    """Block-causal attention over latent frames (`models.student.*` keys)."""

    block_size: int
    local_attn_size: int = -1  # frames; -1 = every earlier frame
    sink_size: int = 0  # first frames always visible (with a window)
    prefix_frames: int = 0  # leading clean condition frames: a block of their own (module docstring)

    def __post_init__(self) -> None:
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"causal block size (method.chunk_size) must be an integer >= 1, got {self.block_size!r}")
        largest = max(self.block_size, self.prefix_frames)
        if self.local_attn_size != -1 and self.local_attn_size < largest:
            raise ValueError(
                f"models.student.local_attn_size must be -1 (no window) or >= the block size "
                f"{largest} (a block always sees itself), got {self.local_attn_size}"
            )
        if self.sink_size < 0:
            raise ValueError(f"models.student.sink_size must be >= 0, got {self.sink_size}")
        if self.prefix_frames < 0:
            raise ValueError(f"causal prefix frames must be >= 0, got {self.prefix_frames}")

    def block_index(self, frame: torch.Tensor) -> torch.Tensor:
        """The attention block of each frame index (the prefix is block 0 when there is one)."""
        p = self.prefix_frames
        if not p:
            return frame // self.block_size
        return torch.where(frame < p, torch.zeros_like(frame), 1 + (frame - p).clamp_min(0) // self.block_size)

    def block_end(self, frame: torch.Tensor, num_frames: int) -> torch.Tensor:
        """One past the last frame of each frame's block (within `num_frames`)."""
        p = self.prefix_frames
        end = p + (self.block_index(frame) - (1 if p else 0) + 1) * self.block_size
        if p:
            end = torch.where(frame < p, torch.full_like(frame, p), end)
        return end.clamp(max=num_frames)

    def block_length(self, start: int) -> int:
        """Frames of the block starting at frame index `start`."""
        return self.prefix_frames if start < self.prefix_frames else self.block_size

    def block_start(self, frame: int) -> bool:
        """Whether a block starts at frame index `frame`."""
        p = self.prefix_frames
        return frame == 0 or (frame >= p and (frame - p) % self.block_size == 0)

    def visible_from_end(self, block_end: torch.Tensor, key_frame: torch.Tensor) -> torch.Tensor:
        """Whether key frame `key_frame` is visible to a query whose block ends at `block_end`."""
        visible = key_frame < block_end
        if self.local_attn_size > 0:
            visible = visible & ((key_frame >= block_end - self.local_attn_size) | (key_frame < self.sink_size))
        return visible


def sequence_visibility(spec: CausalSpec, num_frames: int) -> torch.Tensor:
    """[T, T] bool: query frame f sees key frame g (plain block-causal video)."""
    frames = torch.arange(num_frames)
    return spec.visible_from_end(spec.block_end(frames, num_frames)[:, None], frames[None, :])


def teacher_forcing_visibility(spec: CausalSpec, num_frames: int) -> torch.Tensor:
    """[2T, 2T] bool for [clean 0..T-1 | noisy 0..T-1]."""
    clean_to_clean = sequence_visibility(spec, num_frames)
    block = spec.block_index(torch.arange(num_frames))
    noisy_to_clean = clean_to_clean & (block[None, :] < block[:, None])
    noisy_to_noisy = block[None, :] == block[:, None]
    top = torch.cat([clean_to_clean, torch.zeros_like(clean_to_clean)], dim=1)
    bottom = torch.cat([noisy_to_clean, noisy_to_noisy], dim=1)
    return torch.cat([top, bottom], dim=0)


def frame_visibility(spec: CausalSpec, layout: str, num_frames: int) -> torch.Tensor:
    """The frame-level rule for a layout; `num_frames` counts every frame of the forward."""
    if layout == "sequence":
        return sequence_visibility(spec, num_frames)
    if layout == "teacher_forcing":
        if num_frames % 2:
            raise ValueError(f"teacher forcing needs [clean | noisy] halves, got {num_frames} frames")
        return teacher_forcing_visibility(spec, num_frames // 2)
    raise ValueError(f"no frame matrix for layout {layout!r}")


def _runs(flags: list[bool]) -> list[tuple[int, int]]:
    """Maximal [start, end) runs of True."""
    out: list[tuple[int, int]] = []
    start = None
    for i, flag in enumerate(list(flags) + [False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            out.append((start, i))
            start = None
    return out


def chunk_plan(visibility: torch.Tensor) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """Group consecutive query frames with identical rows: [(q_start, q_end, [(k_start, k_end)])]."""
    rows = visibility.tolist()
    plan = []
    start = 0
    for f in range(1, len(rows) + 1):
        if f == len(rows) or rows[f] != rows[start]:
            plan.append((start, f, _runs(rows[start])))
            start = f
    return plan


def dense_token_mask(visibility: torch.Tensor, tokens_per_frame: int) -> torch.Tensor:
    """The [L, L] boolean mask (reference only: ~1 GB at 21 frames of 480x832)."""
    return visibility.repeat_interleave(tokens_per_frame, 0).repeat_interleave(tokens_per_frame, 1)


def build_block_mask(
    visibility: torch.Tensor, tokens_per_frame: int, device: torch.device | str, tile: int = FLEX_BLOCK_SIZE
):
    """A FlexAttention `BlockMask` for a frame rule, built tile by tile (no [L, L] tensor).

    A (query tile, key tile) pair covers every (query frame, key frame) pair of the frame
    rectangle its token ranges span, so it is full when that rectangle is all visible, empty when
    none of it is, and partial (decided per token by the mask function) otherwise.
    """
    from torch.nn.attention.flex_attention import BlockMask

    num_q_frames, num_k_frames = visibility.shape
    s = tokens_per_frame
    len_q, len_k = num_q_frames * s, num_k_frames * s
    n_q, n_k = math.ceil(len_q / tile), math.ceil(len_k / tile)

    def frame_spans(n_tiles: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        first_token = torch.arange(n_tiles) * tile
        last_token = torch.clamp(first_token + tile, max=length) - 1
        return first_token // s, last_token // s

    q_first, q_last = frame_spans(n_q, len_q)
    k_first, k_last = frame_spans(n_k, len_k)
    # 2-D prefix sums count the visible frame pairs of each tile's rectangle.
    prefix = torch.zeros(num_q_frames + 1, num_k_frames + 1, dtype=torch.long)
    prefix[1:, 1:] = visibility.long().cumsum(0).cumsum(1)
    qa, qb = q_first[:, None], q_last[:, None] + 1
    ka, kb = k_first[None, :], k_last[None, :] + 1
    visible_pairs = prefix[qb, kb] - prefix[qa, kb] - prefix[qb, ka] + prefix[qa, ka]
    area = (qb - qa) * (kb - ka)
    full = visible_pairs == area
    partial = (visible_pairs > 0) & ~full

    def ordered(selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counts = selected.sum(-1, dtype=torch.int32)
        # Stable sort puts the selected tiles first, in increasing key order.
        indices = torch.argsort((~selected).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return counts[None, None].to(device), indices[None, None].contiguous().to(device)

    kv_num, kv_idx = ordered(partial)
    full_num, full_idx = ordered(full)
    # The mask function reads the frame matrix, padded so that padded tokens index in bounds.
    padded = torch.zeros(math.ceil(n_q * tile / s), math.ceil(n_k * tile / s), dtype=torch.bool)
    padded[:num_q_frames, :num_k_frames] = visibility
    padded = padded.to(device)

    def mask_mod(b, h, q_idx, kv_idx):
        return padded[q_idx // s, kv_idx // s]

    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=tile, mask_mod=mask_mod, seq_lengths=(len_q, len_k)
    )


def block_mask_nbytes(block_mask) -> int:
    """Bytes held by a BlockMask's tensors (its tile tables and the frame matrix it reads)."""
    total = sum(t.numel() * t.element_size() for t in block_mask.as_tuple() if isinstance(t, torch.Tensor))
    for cell in getattr(block_mask.mask_mod, "__closure__", None) or ():
        if isinstance(cell.cell_contents, torch.Tensor):
            total += cell.cell_contents.numel() * cell.cell_contents.element_size()
    return total


# --------------------------------------------------------------------------------------------
# Runtime: layouts, the KV cache, the rotary wrapper
# --------------------------------------------------------------------------------------------


@dataclass
class KVCache:
    """Keys/values of finished frames, per self-attention layer, as [start_frame, k, v] segments."""

    segments: dict[int, list[tuple[int, torch.Tensor, torch.Tensor]]] = field(default_factory=dict)

    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for segs in self.segments.values() for _, k, _ in segs)


@dataclass(frozen=True)
class TokenLayout:
    """How the tokens of one transformer forward are arranged (see the module docstring)."""

    kind: str
    num_frames: int  # frames in this forward (2T for teacher forcing)
    tokens_per_frame: int
    frame_offset: int = 0  # kv_cache: absolute index of the first frame
    cache: Optional[KVCache] = None
    write_cache: bool = False
    # The cache's segments per layer as this forward sees them, fixed when the layout is made: a
    # forward recomputed later (activation checkpointing) attends to what the first pass attended
    # to, whatever the cache has gained since.
    visible: Optional[dict] = None

    def __post_init__(self) -> None:
        if self.cache is not None and self.visible is None:
            object.__setattr__(self, "visible", {layer: list(segs) for layer, segs in self.cache.segments.items()})


class CausalRotary(tuple):
    """The (cos, sin) pair the transformer hands to each block, carrying the token layout."""

    layout: TokenLayout

    def __new__(cls, freqs: tuple[torch.Tensor, torch.Tensor], layout: TokenLayout):
        obj = super().__new__(cls, tuple(freqs))
        obj.layout = layout
        return obj


class CausalRotaryEmbedding(torch.nn.Module):
    """Wraps the transformer's `rope`: positions per layout, and the layout for the processors.

    Positions come from the wrapped diffusers module itself, evaluated on a shape-only (meta)
    tensor of the needed frame count: teacher forcing gives both halves positions 0..T-1, the KV
    cache gives a block positions s..s+n-1.
    """

    def __init__(self, rope: torch.nn.Module, controller: "CausalAttention"):
        super().__init__()
        self.inner = rope
        self.controller = controller

    def _freqs_for_frames(self, hidden_states: torch.Tensor, num_frames: int):
        b, c, _, h, w = hidden_states.shape
        p_t = self.inner.patch_size[0]
        return self.inner(torch.empty((b, c, num_frames * p_t, h, w), device="meta"))

    def forward(self, hidden_states: torch.Tensor):
        _, _, frames, height, width = hidden_states.shape
        p_t, p_h, p_w = self.inner.patch_size
        num_frames, tokens_per_frame = frames // p_t, (height // p_h) * (width // p_w)
        mode = self.controller.mode
        if mode.kind == "sequence":
            freqs = self.inner(hidden_states)
            layout = TokenLayout("sequence", num_frames, tokens_per_frame)
        elif mode.kind == "teacher_forcing":
            if num_frames % 2:
                raise ValueError(f"teacher forcing needs [clean | noisy] halves, got {num_frames} latent frames")
            half = self._freqs_for_frames(hidden_states, num_frames // 2)
            freqs = tuple(torch.cat([f, f], dim=1) for f in half)
            layout = TokenLayout("teacher_forcing", num_frames, tokens_per_frame)
        else:
            full = self._freqs_for_frames(hidden_states, mode.frame_offset + num_frames)
            freqs = tuple(f[:, mode.frame_offset * tokens_per_frame :] for f in full)
            layout = TokenLayout(
                "kv_cache", num_frames, tokens_per_frame, mode.frame_offset, mode.cache, mode.write_cache
            )
        return CausalRotary(freqs, layout)


@dataclass(frozen=True)
class _Mode:
    kind: str = "sequence"
    frame_offset: int = 0
    cache: Optional[KVCache] = None
    write_cache: bool = False


# --------------------------------------------------------------------------------------------
# The processor
# --------------------------------------------------------------------------------------------


class CausalSelfAttnProcessor:
    """Self-attention of a Wan / SkyReels-V2 block under the controller's block-causal rule.

    Under context parallelism (`_parallel_config`, set by diffusers' `enable_parallelism`) the
    block holds a slice of the tokens; the attention goes through diffusers' Ulysses all-to-all,
    which gives it every token for a share of the heads, and there applies the rotary tables (left
    whole by fv_accel.models.context_parallel.causal_cp_plan) and the block-causal rule unchanged.
    """

    _parallel_config = None

    def __init__(self, controller: "CausalAttention", layer_index: int):
        self.controller = controller
        self.layer_index = layer_index

    def __call__(
        self,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,  # a model's own dense mask; replaced by ours
        rotary_emb: Optional[CausalRotary] = None,
    ) -> torch.Tensor:
        del attention_mask
        if encoder_hidden_states is not None:
            raise RuntimeError("CausalSelfAttnProcessor is for self-attention (attn1) only")
        layout = getattr(rotary_emb, "layout", None)
        if layout is None:
            raise RuntimeError(
                "block-causal attention needs the transformer's rope wrapped by install_causal_attention()"
            )
        if getattr(attn, "fused_projections", False):
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        query, key = attn.norm_q(query), attn.norm_k(key)
        query, key, value = (x.unflatten(2, (attn.heads, -1)) for x in (query, key, value))
        if self._parallel_config is not None:
            out = self._attend_context_parallel(query, key, value, rotary_emb, layout)
            out = attn.to_out[0](out.flatten(2, 3).type_as(query))
            return attn.to_out[1](out)
        query = apply_wan_rotary(query, *rotary_emb)
        key = apply_wan_rotary(key, *rotary_emb)
        # [B, L, H, D] -> [B, H, L, D] for SDPA / FlexAttention.
        query, key, value = (x.transpose(1, 2) for x in (query, key, value))
        out = self.controller.attend(query, key, value, layout, self.layer_index)
        out = out.transpose(1, 2).flatten(2, 3).type_as(query)
        out = attn.to_out[0](out)
        return attn.to_out[1](out)

    def _attend_context_parallel(self, query, key, value, rotary_emb, layout: TokenLayout) -> torch.Tensor:
        """[B, L/cp, H, D] -> [B, L/cp, H, D] through diffusers' Ulysses attention, with an attention
        function over the whole sequence (recomputed with autograd for the backward, as diffusers'
        native SDPA backward does)."""
        from diffusers.models.attention_dispatch import _templated_context_parallel_attention

        if layout.kind == "kv_cache":
            raise RuntimeError("block-causal attention with a KV cache does not run under context parallelism")
        if rotary_emb[0].shape[1] != layout.num_frames * layout.tokens_per_frame:
            raise RuntimeError("under context parallelism the rotary tables must stay whole (causal_cp_plan)")
        controller, layer = self.controller, self.layer_index

        def attend_whole(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            q, k = apply_wan_rotary(q, *rotary_emb), apply_wan_rotary(k, *rotary_emb)
            out = controller.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), layout, layer)
            return out.transpose(1, 2)

        def forward_op(ctx, q, k, v, *args, _save_ctx: bool = True, **kwargs):
            if _save_ctx:
                ctx.save_for_backward(q, k, v)
            return attend_whole(q, k, v)

        def backward_op(ctx, grad_out, *args, **kwargs):
            with torch.enable_grad():
                q, k, v = (x.detach().requires_grad_(True) for x in ctx.saved_tensors)
                return torch.autograd.grad(attend_whole(q, k, v), (q, k, v), grad_out)

        return _templated_context_parallel_attention(
            query, key, value, None, 0.0, False, None, False, False,
            forward_op=forward_op, backward_op=backward_op, _parallel_config=self._parallel_config,
        )


# --------------------------------------------------------------------------------------------
# The controller
# --------------------------------------------------------------------------------------------


def _gather_frames(x: torch.Tensor, runs: list[tuple[int, int]], tokens_per_frame: int) -> torch.Tensor:
    """The tokens of frame runs [(a, b)] of x [B, H, L, D]; a view when there is one run."""
    s = tokens_per_frame
    parts = [x[:, :, a * s : b * s] for a, b in runs]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


class CausalAttention:
    """The block-causal attention of one transformer: rule, backend, caches and the current layout."""

    def __init__(self, spec: CausalSpec, backend: str = "auto"):
        if backend not in BACKENDS:
            raise ValueError(f"models.student.causal_attention_backend must be one of {BACKENDS}, got {backend!r}")
        self.spec = spec
        self.backend = backend
        self.mode = _Mode()
        self._block_masks: dict[tuple, object] = {}
        self._plans: dict[tuple, list] = {}
        self._visibility: dict[tuple, torch.Tensor] = {}

    # ---- layouts ----
    @contextlib.contextmanager
    def _use(self, mode: _Mode) -> Iterator[None]:
        previous, self.mode = self.mode, mode
        try:
            yield
        finally:
            self.mode = previous

    def teacher_forcing(self):
        """Forwards inside run on [clean | noisy] latents (2T frames)."""
        return self._use(_Mode("teacher_forcing"))

    def kv_cache(self, cache: KVCache, frame_offset: int, *, write: bool = False):
        """Forwards inside run one block at `frame_offset` over `cache`; `write` appends its K/V."""
        if not self.spec.block_start(frame_offset):
            raise ValueError(f"a cached block must start on a block boundary, got frame {frame_offset}")
        return self._use(_Mode("kv_cache", frame_offset, cache, write))

    def set_window(self, local_attn_size: int) -> None:
        """Attend to (and cache) only the last `local_attn_size` frames counted from each block's end,
        plus the spec's sink frames: a window for generation past the trained length."""
        import dataclasses

        self.spec = dataclasses.replace(self.spec, local_attn_size=local_attn_size)
        self._block_masks.clear()
        self._plans.clear()
        self._visibility.clear()

    # ---- cached structures ----
    def visibility(self, layout: str, num_frames: int) -> torch.Tensor:
        key = (layout, num_frames)
        if key not in self._visibility:
            self._visibility[key] = frame_visibility(self.spec, layout, num_frames)
        return self._visibility[key]

    def block_mask(self, layout: str, num_frames: int, tokens_per_frame: int, device: torch.device | str):
        """The FlexAttention BlockMask for a token grid, built once per (layout, T, H*W, device)."""
        key = (layout, num_frames, tokens_per_frame, str(torch.device(device)))
        if key not in self._block_masks:
            self._block_masks[key] = build_block_mask(self.visibility(layout, num_frames), tokens_per_frame, device)
        return self._block_masks[key]

    def plan(self, layout: str, num_frames: int) -> list:
        key = (layout, num_frames)
        if key not in self._plans:
            self._plans[key] = chunk_plan(self.visibility(layout, num_frames))
        return self._plans[key]

    def resolve_backend(self, device: torch.device) -> str:
        if self.backend == "auto":
            return "flex" if device.type == "cuda" else "chunked"
        return self.backend

    # ---- attention ----
    def attend(self, query, key, value, layout: TokenLayout, layer: int) -> torch.Tensor:
        s = layout.tokens_per_frame
        if query.shape[2] != layout.num_frames * s:
            raise RuntimeError(
                f"{query.shape[2]} tokens do not match a grid of {layout.num_frames} frames x {s} tokens"
            )
        if layout.kind == "kv_cache":
            return self._attend_cached(query, key, value, layout, layer)
        backend = self.resolve_backend(query.device)
        if backend == "flex":
            mask = self.block_mask(layout.kind, layout.num_frames, s, query.device)
            return flex_attention(query, key, value, mask)
        if backend == "dense":
            mask = dense_token_mask(self.visibility(layout.kind, layout.num_frames), s).to(query.device)
            return F.scaled_dot_product_attention(query, key, value, attn_mask=mask)
        outs = []
        for q0, q1, key_runs in self.plan(layout.kind, layout.num_frames):
            k, v = _gather_frames(key, key_runs, s), _gather_frames(value, key_runs, s)
            outs.append(F.scaled_dot_product_attention(query[:, :, q0 * s : q1 * s], k, v))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    def _attend_cached(self, query, key, value, layout: TokenLayout, layer: int) -> torch.Tensor:
        """One block of frames [s, e) over the visible cached frames plus itself."""
        s = layout.tokens_per_frame
        start, end = layout.frame_offset, layout.frame_offset + layout.num_frames
        block = self.spec.block_length(start)
        if layout.num_frames > block:
            raise ValueError(f"a cached forward holds one block ({block} frames), got {layout.num_frames}")
        cache = layout.cache
        segments = layout.visible.get(layer, []) if layout.visible is not None else []
        keys, values = [], []
        for seg_start, k, v in segments:
            frames = torch.arange(seg_start, seg_start + k.shape[2] // s)
            flags = self.spec.visible_from_end(torch.tensor(end), frames).tolist()
            for a, b in _runs(flags):
                keys.append(k[:, :, a * s : b * s])
                values.append(v[:, :, a * s : b * s])
        out = F.scaled_dot_product_attention(query, torch.cat(keys + [key], dim=2), torch.cat(values + [value], dim=2))
        if layout.write_cache:
            segments = cache.segments.get(layer, [])
            if segments and segments[-1][0] + segments[-1][1].shape[2] // s != start:
                raise ValueError(f"the KV cache ends before frame {start}: blocks must be written in order")
            kept = [seg for seg in segments if self._may_be_seen(seg, s, end)]
            cache.segments[layer] = kept + [(start, key.detach(), value.detach())]
        return out

    def _may_be_seen(self, segment, tokens_per_frame: int, written_end: int) -> bool:
        """Whether a later block (ending after `written_end`) can still see a cached segment."""
        if self.spec.local_attn_size < 0:
            return True
        seg_start, k, _ = segment
        seg_end = seg_start + k.shape[2] // tokens_per_frame
        return seg_start < self.spec.sink_size or seg_end > written_end + 1 - self.spec.local_attn_size


# --------------------------------------------------------------------------------------------
# Installation
# --------------------------------------------------------------------------------------------


def install_causal_attention(transformer: torch.nn.Module, spec: CausalSpec, backend: str = "auto") -> CausalAttention:
    """Make a diffusers Wan / SkyReels-V2 transformer block-causal; returns its controller."""
    kind = type(transformer).__name__
    if kind not in ("WanTransformer3DModel", "SkyReelsV2Transformer3DModel"):
        raise ValueError(f"block-causal attention supports Wan and SkyReels-V2 transformers, not {kind}")
    if int(transformer.config.patch_size[0]) != 1:
        raise ValueError("block-causal attention over latent frames needs a temporal patch size of 1")
    if isinstance(transformer.rope, CausalRotaryEmbedding):
        raise RuntimeError("block-causal attention is already installed on this transformer")
    controller = CausalAttention(spec, backend)
    if kind == "SkyReelsV2Transformer3DModel" and transformer.config.num_frame_per_block > 1:
        # Its own block mask is a dense [L, L] tensor; ours replaces it.
        logger.info(
            "SkyReels-V2: num_frame_per_block=%d set to 1 (its dense mask is replaced by block-causal attention)",
            transformer.config.num_frame_per_block,
        )
        transformer.register_to_config(num_frame_per_block=1)
    transformer.rope = CausalRotaryEmbedding(transformer.rope, controller)
    for index, block in enumerate(transformer.blocks):
        block.attn1.set_processor(CausalSelfAttnProcessor(controller, index))
    transformer.causal_attention = controller
    return controller
