"""The LTX-Video family: `LTXVideoTransformer3DModel` (Lightricks/LTX-Video 0.9.x, diffusers layout).

Training calls the transformer as the pipeline class the repo's model_index.json names does
(`repo_pipeline`): LTXPipeline (0.9.0 to 0.9.5 in diffusers' conversions) or LTXConditionPipeline
(0.9.7), text-to-video.

What differs from the contract's view, and where it is handled:
- `forward`: the transformer takes packed tokens [B, S, C * pt * p * p] (`LTXPipeline._pack_latents`,
  frame-major: S = T/pt * H/p * W/p) plus the latent grid (`num_frames`, `height`, `width`) and
  returns packed tokens, unpacked with `LTXPipeline._unpack_latents`.
- `forward` (`positions`): under LTXPipeline the grid's rotary positions are scaled by
  `rope_interpolation_scale = (temporal VAE factor / frame rate, spatial factor, spatial factor)`
  (latent frame f at 8f / 25); under LTXConditionPipeline they are its `video_coords` (latent frame f
  at pixel frame max(0, 8f - 7), over the frame rate: 0, 0.04, 0.36, ...), both at the pipelines'
  default frame rate 25.
- Text: T5 hidden states of the caption as the repo's pipeline class encodes a prompt (LTXPipeline:
  128 tokens, the encoder run without a mask; LTXConditionPipeline: 256 tokens, with the mask), with
  their attention mask in the transformer (`encoder_attention_mask`).
- `forward`: timesteps are [B] or one per token [B, S] (its AdaLN runs per token); a per-frame [B, T]
  becomes per token by repeating each frame's value over its H/p * W/p tokens. Values are
  sigma * 1000, as LTXPipeline feeds `scheduler.timesteps`, and the output is the flow velocity
  eps - x0 (the pipeline steps `FlowMatchEulerDiscreteScheduler` with it): neither is converted.
- `latent_statistics`: latents are normalised as LTXPipeline does, (x - latents_mean) * scaling_factor
  / latents_std, with the VAE's `latents_mean`/`latents_std` *buffers* (in its safetensors file).
- Training shift (the generic student's): the repo's scheduler shifts by resolution
  (`use_dynamic_shifting`), mu from the token count, the same sigma map as a static shift exp(mu).
- `install_causal_attention`: block-causal self-attention uses fv_accel.models.attention's rule and
  backends through LTX's own rotary embedding and attention projections (LTXCausal* below).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from diffusers import LTXVideoTransformer3DModel

from fv_accel.models.base import Capabilities, Conditioning, register_family
from fv_accel.models.encoders import TEXT, EncodingSpec, FamilyEncoder
from fv_accel.models.student import DiffusersStudent

logger = logging.getLogger(__name__)

# The pipeline classes an LTX-Video repo's model_index.json may name. diffusers' conversion script
# (scripts/convert_ltx_to_diffusers.py) writes LTXPipeline for 0.9.0, 0.9.1 and 0.9.5 and
# LTXConditionPipeline for 0.9.7; a repo without model_index.json (an inline config) is an LTXPipeline one.
LTX_PIPELINE = "LTXPipeline"
LTX_CONDITION_PIPELINE = "LTXConditionPipeline"
LTX_PIPELINES = (LTX_PIPELINE, "LTXImageToVideoPipeline", LTX_CONDITION_PIPELINE)


def pipeline_default(pipeline: str, name: str) -> Any:
    """The default of argument `name` of the diffusers pipeline class `pipeline`'s `__call__`."""
    import inspect

    import diffusers

    return inspect.signature(getattr(diffusers, pipeline).__call__).parameters[name].default


# The pipelines' default `frame_rate` (25 in both): with the VAE's 8x time compression it sets the
# temporal positions of their samples' latent frames; training uses them whatever the clips' frame rate.
LTX_FRAME_RATE = pipeline_default(LTX_PIPELINE, "frame_rate")


def repo_pipeline(model: Optional[str], revision: Optional[str] = None) -> str:
    """The LTX pipeline class a repo's model_index.json names (LTXPipeline without one)."""
    from fv_accel.models.loading import fetch_config

    if model is None:
        return LTX_PIPELINE
    index = fetch_config(model, None, revision=revision, required=False, filename="model_index.json") or {}
    name = index.get("_class_name") or LTX_PIPELINE
    return name if name in LTX_PIPELINES else LTX_PIPELINE


def condition_video_coords(
    batch: int, latent_grid: tuple[int, int, int], patch: tuple[int, int], vae_factors: tuple[int, int],
    frame_rate: float, device: torch.device,
) -> torch.Tensor:
    """[B, 3, S] token coordinates as LTXConditionPipeline builds its `video_coords` for a latent grid
    (T, H, W) without conditions: latent frame f at pixel frame max(0, 8f - 7) over `frame_rate`, rows
    and columns at 32 pixels per latent (the VAE's (spatial, temporal) factors), by the pipeline's
    own `_prepare_video_ids` / `_scale_video_ids`."""
    from diffusers import LTXConditionPipeline

    p, pt = patch
    spatial, temporal = vae_factors
    ids = LTXConditionPipeline._prepare_video_ids(batch, *latent_grid, patch_size=p, patch_size_t=pt, device=device)
    ids = LTXConditionPipeline._scale_video_ids(ids, scale_factor=spatial, scale_factor_t=temporal, frame_index=0, device=device)
    coords = ids.float()
    coords[:, 0] = coords[:, 0] * (1.0 / frame_rate)
    return coords
# AutoencoderKLLTXVideo's defaults (Lightricks/LTX-Video 0.9.0).
DEFAULT_VAE_CONFIG = {"patch_size": 4, "patch_size_t": 1, "spatio_temporal_scaling": [True, True, True, False]}


def vae_compression(vae_config: Optional[dict]) -> tuple[int, int]:
    """(spatial, temporal) compression of an `AutoencoderKLLTXVideo` config, as its __init__ derives it."""
    config = {**DEFAULT_VAE_CONFIG, **(vae_config or {})}
    downsamplings = sum(bool(s) for s in config["spatio_temporal_scaling"])
    spatial = config.get("spatial_compression_ratio") or int(config["patch_size"]) * 2**downsamplings
    temporal = config.get("temporal_compression_ratio") or int(config["patch_size_t"]) * 2**downsamplings
    return int(spatial), int(temporal)


def rope_interpolation_scale(spatial: int, temporal: int, frame_rate: float = LTX_FRAME_RATE) -> tuple[float, float, float]:
    """LTXPipeline's `rope_interpolation_scale` for a VAE of these factors at `frame_rate`."""
    return (temporal / frame_rate, float(spatial), float(spatial))


def pack_latents(latents: torch.Tensor, patch_size: int, patch_size_t: int) -> torch.Tensor:
    """[B, C, T, H, W] -> packed tokens [B, S, C * pt * p * p], frame-major (LTXPipeline's layout)."""
    from diffusers import LTXPipeline

    return LTXPipeline._pack_latents(latents, patch_size, patch_size_t)


def unpack_latents(tokens: torch.Tensor, grid: tuple[int, int, int], patch_size: int, patch_size_t: int) -> torch.Tensor:
    """Packed tokens [B, S, D] on a (T/pt, H/p, W/p) grid -> [B, C, T, H, W]."""
    from diffusers import LTXPipeline

    return LTXPipeline._unpack_latents(tokens, *grid, patch_size, patch_size_t)


def token_timesteps(t: torch.Tensor, grid: tuple[int, int, int], patch_size_t: int) -> torch.Tensor:
    """The transformer's timestep input: [B] as is; per latent frame [B, T] -> per token [B, S].

    Tokens are frame-major, so each (temporal patch of) frame(s) repeats its value over its H/p * W/p
    tokens. Frames sharing a temporal patch must share their timestep.
    """
    if t.ndim == 1:
        return t
    if t.ndim != 2:
        raise ValueError(f"timesteps must be [B] or per latent frame [B, T], got {tuple(t.shape)}")
    frames, height, width = grid
    b = t.shape[0]
    if t.shape[1] != frames * patch_size_t:
        raise ValueError(f"{t.shape[1]} per-frame timesteps for {frames * patch_size_t} latent frames")
    per_patch = t.reshape(b, frames, patch_size_t)
    if patch_size_t > 1 and not torch.equal(per_patch, per_patch[:, :, :1].expand_as(per_patch)):
        raise ValueError(f"frames inside one temporal patch ({patch_size_t} frames) must share a timestep")
    return per_patch[:, :, 0].repeat_interleave(height * width, dim=1)


class LTXCausalRotaryEmbedding(torch.nn.Module):
    """Wraps an LTX transformer's `rope`: the (cos, sin) pair per token layout, tagged with the layout
    for the block-causal processors (fv_accel.models.attention's `CausalRotary`).

    LTX's rope takes the latent grid (num_frames, height, width) instead of a 5-D tensor; positions
    for a layout come from the wrapped module itself: teacher forcing gives both halves frames
    0..T-1, the KV cache a block frames s..s+n-1 (the first s + n frames' table, sliced).
    """

    def __init__(self, rope: torch.nn.Module, controller: Any, coords_for_grid: Any = None):
        super().__init__()
        self.inner = rope
        self.controller = controller
        # (batch, token grid (T, H, W), device) -> `video_coords` [B, 3, S], for a student that passes
        # coordinates (LTXConditionPipeline's): the positions of other frame counts come from it.
        self.coords_for_grid = coords_for_grid

    def forward(self, hidden_states, num_frames=None, height=None, width=None, rope_interpolation_scale=None, video_coords=None):
        from fv_accel.models.attention import CausalRotary, TokenLayout

        if num_frames is None:
            raise ValueError("block-causal LTX attention needs the latent grid (num_frames, height, width)")
        if video_coords is not None and self.coords_for_grid is None:
            raise ValueError("block-causal LTX attention got video_coords without the rule that makes them (coords_for_grid)")
        tokens_per_frame = height * width
        mode = self.controller.mode

        def table(frames: int):
            if video_coords is None:
                return self.inner(hidden_states, frames, height, width, rope_interpolation_scale)
            coords = self.coords_for_grid(hidden_states.shape[0], (frames, height, width), hidden_states.device)
            return self.inner(hidden_states, video_coords=coords)

        if mode.kind == "sequence":
            freqs = table(num_frames)
            layout = TokenLayout("sequence", num_frames, tokens_per_frame)
        elif mode.kind == "teacher_forcing":
            if num_frames % 2:
                raise ValueError(f"teacher forcing needs [clean | noisy] halves, got {num_frames} latent frames")
            freqs = tuple(torch.cat([f, f], dim=1) for f in table(num_frames // 2))
            layout = TokenLayout("teacher_forcing", num_frames, tokens_per_frame)
        else:
            start = mode.frame_offset * tokens_per_frame
            freqs = tuple(f[:, start:] for f in table(mode.frame_offset + num_frames))
            layout = TokenLayout("kv_cache", num_frames, tokens_per_frame, mode.frame_offset, mode.cache, mode.write_cache)
        return CausalRotary(freqs, layout)


class LTXCausalSelfAttnProcessor:
    """Self-attention (`attn1`) of an LTX block under the controller's block-causal rule: LTX's own
    projections, RMS norm across heads and rotary embedding (on the full width, before the heads
    split), then `CausalAttention.attend`."""

    def __init__(self, controller: Any, layer_index: int):
        self.controller = controller
        self.layer_index = layer_index

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        from diffusers.models.transformers.transformer_ltx import apply_rotary_emb

        if encoder_hidden_states is not None:
            raise RuntimeError("LTXCausalSelfAttnProcessor is for self-attention (attn1) only")
        layout = getattr(image_rotary_emb, "layout", None)
        if layout is None:
            raise RuntimeError("block-causal attention needs the transformer's rope wrapped by install_ltx_causal_attention()")
        query = attn.norm_q(attn.to_q(hidden_states))
        key = attn.norm_k(attn.to_k(hidden_states))
        value = attn.to_v(hidden_states)
        query = apply_rotary_emb(query, image_rotary_emb)
        key = apply_rotary_emb(key, image_rotary_emb)
        # [B, L, H * D] -> [B, H, L, D] for the controller (SDPA / FlexAttention layout).
        query, key, value = (x.unflatten(2, (attn.heads, -1)).transpose(1, 2) for x in (query, key, value))
        out = self.controller.attend(query, key, value, layout, self.layer_index)
        out = out.transpose(1, 2).flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


def install_ltx_causal_attention(transformer: torch.nn.Module, spec: Any, backend: str = "auto", coords_for_grid: Any = None) -> Any:
    """Make an `LTXVideoTransformer3DModel` block-causal over latent frames; returns the controller
    (fv_accel.models.attention.CausalAttention: rule, backends, layouts, KV cache). `coords_for_grid`:
    the student's `video_coords` rule, when it passes coordinates."""
    from fv_accel.models.attention import CausalAttention

    if int(transformer.config.patch_size_t) != 1:
        raise ValueError("block-causal attention over latent frames needs a temporal patch size of 1")
    if isinstance(transformer.rope, LTXCausalRotaryEmbedding):
        raise RuntimeError("block-causal attention is already installed on this transformer")
    controller = CausalAttention(spec, backend)
    transformer.rope = LTXCausalRotaryEmbedding(transformer.rope, controller, coords_for_grid)
    for index, block in enumerate(transformer.transformer_blocks):
        block.attn1.set_processor(LTXCausalSelfAttnProcessor(controller, index))
    transformer.causal_attention = controller
    return controller


def _vae_weights_file(model: str, revision: Optional[str], subfolder: str = "vae") -> Path:
    """The VAE's safetensors file holding `latents_mean`/`latents_std` (single or sharded), in
    `subfolder` (LTX-2's audio VAE: audio_vae)."""
    local = Path(model)
    name = "diffusion_pytorch_model.safetensors"

    def fetch(filename: str) -> Optional[Path]:
        if local.exists():
            path = local / subfolder / filename
            return path if path.is_file() else None
        from huggingface_hub import hf_hub_download
        from huggingface_hub import errors as hf_errors

        from fv_accel.hub_access import offline_unless_hub_answers

        local_only = offline_unless_hub_answers()
        try:
            return Path(hf_hub_download(model, filename, subfolder=subfolder, revision=revision, local_files_only=local_only))
        except hf_errors.EntryNotFoundError:
            return None

    single = fetch(name)
    if single is not None:
        return single
    index = fetch(name + ".index.json")
    if index is None:
        from fv_accel.models.loading import ModelLoadError

        raise ModelLoadError(f"model '{model}': {subfolder}/ holds no {name} (safetensors weights expected)")
    shard = json.loads(index.read_text())["weight_map"]["latents_mean"]
    path = fetch(shard)
    if path is None:
        from fv_accel.models.loading import ModelLoadError

        raise ModelLoadError(f"model '{model}': {subfolder}/{shard} (named by the VAE's index) is missing")
    return path


class LTXVideoEncoder(FamilyEncoder):
    """LTX-Video's VAE (`AutoencoderKLLTXVideo`) and T5 text encoder, eval mode, no grad."""

    def __init__(
        self,
        model: str,
        *,
        device: Optional[torch.device] = None,
        dtype: torch.dtype = torch.float32,
        revision: Optional[str] = None,
        vae_tiling: bool = False,
        spec: Optional[EncodingSpec] = None,
    ):
        from transformers import T5EncoderModel

        from fv_accel.models.loading import load_text_encoder

        self.model = model
        self.revision = revision
        self.device = device or torch.device("cpu")
        self.dtype = dtype
        self.spec = spec or LTXVideoStudent.encoding_spec(model, revision)
        self.vae = LTXVideoStudent.load_vae(model, revision=revision, torch_dtype=dtype)
        self.vae.to(self.device).eval().requires_grad_(False)
        if vae_tiling:
            self.vae.enable_tiling()
        self.tokenizer, self.text_encoder = load_text_encoder(model, revision=revision, torch_dtype=dtype, encoder_class=T5EncoderModel)
        self.text_encoder.to(self.device).eval().requires_grad_(False)
        # The repo's own pipeline class encodes prompts (its T5 length, with or without the mask).
        import diffusers

        self.pipeline = repo_pipeline(model, revision)
        self.text_pipeline = getattr(diffusers, self.pipeline)(
            scheduler=None, vae=None, text_encoder=self.text_encoder, tokenizer=self.tokenizer, transformer=None
        )
        self.text_max_length = int(pipeline_default(self.pipeline, "max_sequence_length"))

    @torch.no_grad()
    def encode_video(self, frames: np.ndarray) -> torch.Tensor:
        """uint8 [F, H, W, 3] -> raw latent [C, T, H/32, W/32] (the posterior's mode), fp32 on the CPU."""
        video = torch.from_numpy(np.ascontiguousarray(frames)).permute(3, 0, 1, 2)[None]
        video = video.to(self.device, torch.float32) / 127.5 - 1.0
        latent = self.vae.encode(video.to(self.dtype)).latent_dist.mode()
        return latent[0].float().cpu()

    @torch.no_grad()
    def encode_caption(self, caption: str) -> dict[str, torch.Tensor]:
        """{"text_embedding": [L, D]}: T5 hidden states of the caption's real tokens, computed by the
        repo's pipeline class's own `encode_prompt` at its default length (LTXPipeline: 128 tokens,
        the encoder run without a mask; LTXConditionPipeline: 256 tokens, with the mask)."""
        embeds, mask, _, _ = self.text_pipeline.encode_prompt(
            caption, do_classifier_free_guidance=False, max_sequence_length=self.text_max_length, device=self.device
        )
        length = int(mask[0].sum())
        return {"text_embedding": embeds[0, :length].float().cpu()}

    def encode_frames_conditioning(self, frames: np.ndarray) -> dict[str, torch.Tensor]:
        return {}  # text-to-video only

    def latent_statistics(self) -> tuple[list, list]:
        return LTXVideoStudent.latent_statistics(self.model, self.revision)


@register_family
class LTXVideoStudent(DiffusersStudent):
    """LTX-Video 0.9.x text-to-video: FineTune, DFSFT (per-token timesteps) and causal DFSFT
    (`models.student.causal`: block-causal self-attention, block = method.chunk_size)."""

    family = "ltx_video"
    vae_class_names = ("AutoencoderKLLTXVideo",)
    transformer_classes = {"ltx_video": LTXVideoTransformer3DModel}
    pipeline_class_names = LTX_PIPELINES
    capabilities = Capabilities(per_frame_timesteps=True, causal_attention=True, image_conditioning=False)
    lora_target_modules = ("to_q", "to_k", "to_v", "to_out.0")
    comfyui_lora = True
    frame_rate = LTX_FRAME_RATE
    # The pipeline class the repo's model_index.json names (`configure`): training calls the
    # transformer as that pipeline does.
    pipeline = LTX_PIPELINE

    @classmethod
    def lora_pipeline_class(cls, kind: str) -> type:
        from diffusers import LTXPipeline

        return LTXPipeline

    # Original LTX-Video names (ComfyUI's LTXV model, its LoRA files) of the diffusers modules that
    # differ; every other module (attention projections, feed-forward, caption projection, proj_out)
    # keeps its name. diffusers' single-file converter renames these the other way.
    COMFYUI_RENAMES = {"proj_in": "patchify_proj", "time_embed": "adaln_single", "norm_q": "q_norm", "norm_k": "k_norm"}

    @classmethod
    def comfyui_module_name(cls, module: str) -> str:
        """diffusers module name -> ComfyUI's (LoRA keys `diffusion_model.<name>.lora_down.weight`)."""
        return ".".join(cls.COMFYUI_RENAMES.get(part, part) for part in module.split("."))

    # ---- preprocessing / validation ----
    @classmethod
    def encoding_spec(cls, model: str, revision: Optional[str] = None) -> EncodingSpec:
        from fv_accel.models.loading import fetch_config

        vae = fetch_config(model, "vae", revision=revision, required=True)
        transformer = fetch_config(model, "transformer", revision=revision, required=False) or {}
        spatial, temporal = vae_compression(vae)
        p, pt = int(transformer.get("patch_size", 1)), int(transformer.get("patch_size_t", 1))
        return EncodingSpec(
            conditioning=(TEXT,),
            z_dim=int(vae.get("latent_channels", 128)),
            scale_factor_spatial=spatial,
            scale_factor_temporal=temporal,
            patch_size=(pt, p, p),
        )

    @classmethod
    def make_encoder(cls, model: str, *, device=None, dtype=torch.float32, revision=None, vae_tiling=False, spec=None):
        return LTXVideoEncoder(model, device=device, dtype=dtype, revision=revision, vae_tiling=vae_tiling, spec=spec)

    @classmethod
    def latent_statistics(cls, model: str, revision: Optional[str] = None) -> tuple[list[float], list[float]]:
        """(mean, std) with x_norm = (x - mean) / std: the VAE's `latents_mean` and
        `latents_std / scaling_factor` (LTXPipeline's `_normalize_latents`), read from its weights
        file without loading the VAE."""
        from safetensors import safe_open

        from fv_accel.models.loading import fetch_config

        config = fetch_config(model, "vae", revision=revision, required=True)
        scaling = float(config.get("scaling_factor", 1.0))
        with safe_open(str(_vae_weights_file(model, revision)), framework="pt") as f:
            mean = f.get_tensor("latents_mean").float()
            std = f.get_tensor("latents_std").float()
        return [float(v) for v in mean], [float(v) / scaling for v in std]

    @classmethod
    def load_vae(cls, model: str, *, revision: Optional[str] = None, torch_dtype: torch.dtype = torch.float32):
        from diffusers import AutoencoderKLLTXVideo

        from fv_accel.models.loading import explain_load_error, fetch_config

        fetch_config(model, "vae", revision=revision, required=True)
        try:
            return AutoencoderKLLTXVideo.from_pretrained(
                model, subfolder="vae", revision=revision, torch_dtype=torch_dtype, use_safetensors=True
            )
        except (OSError, ValueError) as err:
            raise explain_load_error(model, "VAE (subfolder 'vae')", err, revision=revision) from None

    @classmethod
    def decode(cls, vae: torch.nn.Module, raw_latents: torch.Tensor) -> torch.Tensor:
        """Raw latents -> [B, 3, F, H, W] in [-1, 1]; a timestep-conditioned decoder (0.9.1 on) at
        LTXPipeline's default decode timestep 0 (no decode noise)."""
        timestep = None
        if vae.config.timestep_conditioning:
            timestep = torch.zeros(raw_latents.shape[0], device=raw_latents.device, dtype=raw_latents.dtype)
        return vae.decode(raw_latents, timestep, return_dict=False)[0]

    def configure(self, config: Any) -> None:
        st = self.student_config
        self.pipeline = repo_pipeline(st.init_from, st.revision)
        self.frame_rate = pipeline_default(self.pipeline, "frame_rate")

    def install_causal_attention(self, cfg: Any) -> None:
        """Block-causal self-attention (fv_accel/models/attention.py's rule and backends, LTX's own
        rotary embedding and projections), block size = method.chunk_size."""
        from fv_accel.config import parse_chunk_size
        from fv_accel.models.attention import CausalSpec

        st = self.student_config
        self.causal_block_size = parse_chunk_size(cfg.method.chunk_size)
        spec = CausalSpec(self.causal_block_size, st.local_attn_size, st.sink_size)
        coords = self.video_coords if self.pipeline == LTX_CONDITION_PIPELINE else None
        self.causal_attention = install_ltx_causal_attention(
            self.transformer, spec, st.causal_attention_backend, coords_for_grid=coords
        )

    # ---- geometry ----
    def _vae_factors(self) -> tuple[int, int]:
        if getattr(self, "_factors", None) is None:
            from fv_accel.models.loading import fetch_config

            st = self.student_config
            config = None
            if st.init_from is not None:
                config = fetch_config(st.init_from, "vae", revision=st.revision, required=False)
            self._factors = vae_compression(config)
        return self._factors

    @property
    def rope_interpolation_scale(self) -> tuple[float, float, float]:
        spatial, temporal = self._vae_factors()
        return rope_interpolation_scale(spatial, temporal, self.frame_rate)

    def _patch(self) -> tuple[int, int]:
        config = self.transformer.config
        return int(config.patch_size), int(config.patch_size_t)

    def video_coords(self, batch: int, grid: tuple[int, int, int], device: torch.device) -> torch.Tensor:
        """LTXConditionPipeline's `video_coords` [B, 3, S] for a token grid (T/pt, H/p, W/p)."""
        p, pt = self._patch()
        latent_grid = (grid[0] * pt, grid[1] * p, grid[2] * p)
        return condition_video_coords(batch, latent_grid, (p, pt), self._vae_factors(), self.frame_rate, device)

    def positions(self, batch: int, grid: tuple[int, int, int], device: torch.device) -> dict[str, Any]:
        """The transformer's position input as the repo's pipeline passes it: LTXConditionPipeline's
        `video_coords`, LTXPipeline's `rope_interpolation_scale` (with the grid, passed by `forward`)."""
        if self.pipeline == LTX_CONDITION_PIPELINE:
            return {"video_coords": self.video_coords(batch, grid, device)}
        return {"rope_interpolation_scale": self.rope_interpolation_scale}

    # ---- training ----
    def forward(self, x_t: torch.Tensor, t: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """The velocity eps - x0 for x_t [B, C, T, H, W] at t ([B] or per latent frame [B, T])."""
        p, pt = self._patch()
        _, _, frames, height, width = x_t.shape
        if frames % pt or height % p or width % p:
            raise ValueError(f"latents {tuple(x_t.shape)} do not split into patches of {pt}x{p}x{p}")
        grid = (frames // pt, height // p, width // p)
        dtype = self.input_dtype
        mask = cond.text_mask
        if mask is None:
            mask = torch.ones(cond.text.shape[:2], device=cond.text.device)
        out = self.transformer(
            hidden_states=pack_latents(x_t, p, pt).to(dtype),
            encoder_hidden_states=cond.text.to(dtype),
            timestep=token_timesteps(t, grid, pt),
            encoder_attention_mask=mask,
            num_frames=grid[0],
            height=grid[1],
            width=grid[2],
            return_dict=False,
            **self.positions(x_t.shape[0], grid, x_t.device),
        )[0]
        return unpack_latents(out, grid, p, pt)

    # ---- sample videos ----
    def sample_latents(
        self,
        vae: torch.nn.Module,
        cond: Conditioning,
        negative: Optional[Conditioning],
        *,
        height: int,
        width: int,
        num_frames: int,
        num_inference_steps: int,
        guidance_scale: float,
        scheduler: Any,
        generator: torch.Generator,
        first_frame: Any = None,
    ) -> torch.Tensor:
        """Normalised latents [1, C, T, h, w] through the repo's pipeline class (LTXPipeline or
        LTXConditionPipeline, text-to-video) around the live transformer, stepping with `scheduler`
        (by default the repo's: resolution-dependent shift, terminal stretch), prompt embeddings and
        masks precomputed."""
        import diffusers

        from fv_accel.sampling import pipeline_latents

        if first_frame is not None:
            raise ValueError("the LTX-Video family samples text-to-video only (no first frame)")
        pipeline_class = getattr(diffusers, self.pipeline if self.pipeline == LTX_CONDITION_PIPELINE else LTX_PIPELINE)
        pipe = pipeline_class(scheduler=scheduler, vae=vae, text_encoder=None, tokenizer=None, transformer=self.transformer)

        def mask_of(c: Conditioning) -> torch.Tensor:
            return c.text_mask if c.text_mask is not None else torch.ones(c.text.shape[:2], device=c.text.device)

        use_negative = negative is not None and guidance_scale > 1.0
        latents = pipeline_latents(
            pipe,
            cond.text,
            negative.text if use_negative else None,
            height=height,
            width=width,
            num_frames=num_frames,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            generator=generator,
            prompt_attention_mask=mask_of(cond),
            negative_prompt_attention_mask=mask_of(negative) if use_negative else None,
            frame_rate=self.frame_rate,
        )
        if self.pipeline == LTX_CONDITION_PIPELINE:
            return latents  # LTXConditionPipeline's latent output is unpacked already
        spatial, temporal = self._vae_factors()
        p, pt = self._patch()
        grid = ((num_frames - 1) // temporal + 1, height // spatial, width // spatial)
        return unpack_latents(latents, (grid[0] // pt, grid[1] // p, grid[2] // p), p, pt)
