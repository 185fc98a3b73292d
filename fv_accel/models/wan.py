"""The diffusers video-transformer student: Wan 2.1/2.2 and SkyReels-V2 (same state-dict keys).

How per-frame timesteps reach the transformer (REFERENCE.md section 5):
- `WanTransformer3DModel` takes [B] or per token [B, F'*H'*W']; tokens are frame-major, so a
  per-frame [B, T] becomes per-token with `repeat_interleave(H' * W', dim=1)`.
- `SkyReelsV2Transformer3DModel` takes [B, T] with `enable_diffusion_forcing=True`.

SkyReels-V2 models whose config sets `inject_sample_info` (diffusers' conversion of
SkyReels-V2-DF-1.3B-540P) embed a frame rate: every forward passes the index the diffusion-forcing
pipelines pass at their default 24 fps (`SKYREELS_FPS_INDEX`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
from diffusers import SkyReelsV2Transformer3DModel, WanTransformer3DModel

from fv_accel.config import RunConfig, StudentConfig
from fv_accel.models.base import Capabilities, Conditioning, TrainingBatch, register_family
from fv_accel.models.loading import fetch_config
from fv_accel.models.student import DiffusersStudent, build_family_transformer

logger = logging.getLogger(__name__)

TRANSFORMER_CLASSES = {
    "wan": WanTransformer3DModel,
    "skyreels_v2": SkyReelsV2Transformer3DModel,
}
CLASS_NAME_TO_KIND = {cls.__name__: kind for kind, cls in TRANSFORMER_CLASSES.items()}


def _skyreels_sample_fps() -> int:
    """The `fps` SkyReelsV2DiffusionForcingPipeline samples at by default (its `__call__` default, 24)."""
    import inspect

    from diffusers import SkyReelsV2DiffusionForcingPipeline

    return int(inspect.signature(SkyReelsV2DiffusionForcingPipeline.__call__).parameters["fps"].default)


def skyreels_fps_index(fps: int) -> int:
    """The index of `fps` in a SkyReels-V2 transformer's 2-entry fps embedding (`inject_sample_info`), as
    the diffusion-forcing pipelines encode it: 0 for 16 fps, 1 for any other rate."""
    return 0 if fps == 16 else 1


# SkyReels-V2 models with `inject_sample_info` (SkyReels-V2-DF-1.3B-540P) take this fps index with
# every call: the pipeline's default rate, the one their samples are drawn at.
SKYREELS_FPS_INDEX = skyreels_fps_index(_skyreels_sample_fps())


def build_transformer(cfg: StudentConfig, subfolder: Optional[str] = None) -> tuple[torch.nn.Module, str]:
    """A Wan-family transformer from a Hub id / local folder, or the inline config (seeded by the caller)."""
    return build_family_transformer(WanStudent, cfg, subfolder)


MODULATED_BLOCK_PARTS = ("scale_shift_table", "norm1", "attn1", "norm2", "attn2", "norm3", "ffn")


class PerFrameTimeEmbedding:
    """Per-frame timesteps stay per frame inside a `WanTransformer3DModel`.

    Diffusers' Wan takes per-frame timesteps only per token. It then runs its time MLP (sinusoid ->
    linear -> SiLU -> linear -> 6x projection) on every token, tokens-per-frame times the same
    numbers (+11% of the training FLOPs of configs/bench_small.yaml's 4-block, width-512 model;
    about 1% at the 1.3B architecture), and every block adds its modulation table to a per-token
    [B, S, 6, D] fp32 copy of the frame's projection (at the 1.3B architecture with 21 latent
    frames of 480x832, 1.2 GB per block, read and written again by each of the 30 blocks).

    While `tokens_per_frame` is set (by `WanStudent.forward`, whose per-token timesteps are
    per-frame ones repeated):
    - hooks on the condition embedder feed it one timestep per frame; its time embedding (used once,
      by the output norm) is repeated over the frame's tokens, its 6-way block projection is not;
    - each block, given a per-frame projection [B, T, 6, D], applies shift/scale/gate broadcast over
      the frame's tokens (a [B, T, H'W', D] view of its [B, S, D] activations) instead of per token.
    The values are those of diffusers' per-token path (tests/test_step_cost.py: outputs equal,
    gradients to fp32 summation order), with the module tree and state dict unchanged. A block
    called with per-token or per-sample modulation (a pipeline, SkyReels-V2) runs diffusers' own
    forward; a transformer whose blocks lack those parts gets the embedder part only.
    """

    def __init__(self, transformer: torch.nn.Module):
        self.tokens_per_frame: Optional[int] = None
        self._repeat: Optional[int] = None
        embedder = transformer.condition_embedder
        embedder.register_forward_pre_hook(self._to_frames, with_kwargs=True)
        embedder.register_forward_hook(self._to_tokens, with_kwargs=True)
        blocks = list(getattr(transformer, "blocks", []))
        self.modulate_per_frame = bool(blocks) and all(
            all(hasattr(block, part) for part in MODULATED_BLOCK_PARTS) for block in blocks
        )
        if self.modulate_per_frame:
            for block in blocks:
                block.forward = _PerFrameBlockForward(block, block.forward)

    def _to_frames(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> Optional[tuple]:
        self._repeat = None
        k, seq_len = self.tokens_per_frame, kwargs.get("timestep_seq_len")
        if not k or not seq_len or seq_len % k or not args:
            return None
        frames = seq_len // k
        per_frame = args[0].reshape(-1, frames, k)[:, :, 0].reshape(-1)  # [B * S] -> [B * T]
        self._repeat = k
        return (per_frame, *args[1:]), {**kwargs, "timestep_seq_len": frames}

    def _to_tokens(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        k, self._repeat = self._repeat, None
        if not k:
            return None
        temb, timestep_proj, *rest = output  # [B, T, D], [B, T, 6D]; tokens are frame-major
        if not self.modulate_per_frame:
            timestep_proj = timestep_proj.repeat_interleave(k, dim=1)
        return (temb.repeat_interleave(k, dim=1), timestep_proj, *rest)


class _PerFrameBlockForward:
    """A Wan block's forward that takes its modulation per frame ([B, T, 6, D]) as well as diffusers'
    per-token ([B, S, 6, D]) and per-sample ([B, 6, D]) forms; the last two go to the original."""

    def __init__(self, block: torch.nn.Module, original: Any):
        self.block = block
        self.original = original

    def __call__(self, hidden_states, encoder_hidden_states, temb, rotary_emb):
        if temb.ndim != 4 or temb.shape[1] == hidden_states.shape[1]:
            return self.original(hidden_states, encoder_hidden_states, temb, rotary_emb)
        block = self.block
        b, s, d = hidden_states.shape
        frames = temb.shape[1]
        if s % frames:
            raise ValueError(f"{s} tokens do not split into {frames} frames of equal size")

        def framed(x: torch.Tensor) -> torch.Tensor:  # [B, S, D] -> [B, T, H'W', D]
            return x.reshape(b, frames, s // frames, d)

        def tokens(x: torch.Tensor) -> torch.Tensor:
            return x.reshape(b, s, d)

        # [B, T, 6, D] + [1, 1, 6, D] -> six [B, T, 1, D], broadcast over each frame's tokens.
        mod = (block.scale_shift_table.unsqueeze(0) + temb.float()).unsqueeze(2)
        shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = mod.unbind(3)
        x = hidden_states
        norm = tokens(framed(block.norm1(x.float())) * (1 + scale_msa) + shift_msa).type_as(x)
        attn = block.attn1(norm, None, None, rotary_emb)
        # The residual sums are taken in the [B, S, D] layout: the block's output is a tensor of its
        # own, not a reshaped view (FSDP2 hooks a wrapped block's output for its backward; an
        # in-place op on a view would lose the hook). Same elementwise operations, same values.
        x = (x.float() + tokens(framed(attn) * gate_msa)).type_as(x)
        norm = block.norm2(x.float()).type_as(x)
        x = x + block.attn2(norm, encoder_hidden_states, None, None)
        norm = tokens(framed(block.norm3(x.float())) * (1 + c_scale_msa) + c_shift_msa).type_as(x)
        ff = block.ffn(norm)
        return (x.float() + tokens(framed(ff.float()) * c_gate_msa)).type_as(x)


# diffusers module name (inside a block / at the top) -> original Wan name, the layout ComfyUI
# and most Wan LoRAs in the wild use. diffusers' `_convert_non_diffusers_wan_lora_to_diffusers`
# maps the same pairs the other way.
WAN_BLOCK_MODULES = {
    "attn1.to_q": "self_attn.q",
    "attn1.to_k": "self_attn.k",
    "attn1.to_v": "self_attn.v",
    "attn1.to_out.0": "self_attn.o",
    "attn2.to_q": "cross_attn.q",
    "attn2.to_k": "cross_attn.k",
    "attn2.to_v": "cross_attn.v",
    "attn2.to_out.0": "cross_attn.o",
    "attn2.add_k_proj": "cross_attn.k_img",
    "attn2.add_v_proj": "cross_attn.v_img",
    "ffn.net.0.proj": "ffn.0",
    "ffn.net.2": "ffn.2",
}
WAN_TOP_MODULES = {
    "condition_embedder.time_proj": "time_projection.1",
    "condition_embedder.time_embedder.linear_1": "time_embedding.0",
    "condition_embedder.time_embedder.linear_2": "time_embedding.2",
    "condition_embedder.text_embedder.linear_1": "text_embedding.0",
    "condition_embedder.text_embedder.linear_2": "text_embedding.2",
    "proj_out": "head.head",
}



def wan_comfyui_module_name(module: str) -> str:
    """diffusers module name -> original Wan name (ComfyUI's layout)."""
    from fv_accel.models.lora import original_module_name

    return original_module_name(
        module,
        blocks="blocks",
        original_blocks="blocks",
        block_modules=WAN_BLOCK_MODULES,
        top_modules=WAN_TOP_MODULES,
        naming="ComfyUI (original Wan)",
        supported="the attention projections, add_k_proj/add_v_proj, the FFN, the condition embedder and proj_out",
    )


# Expert of a two-transformer Wan 2.2 repo (A14B) -> the subfolder holding its weights.
EXPERT_SUBFOLDERS = {"high_noise": "transformer", "low_noise": "transformer_2"}
# A run of both experts writes the high-noise LoRA under the usual names and the low-noise one
# with this suffix (`pytorch_lora_weights_transformer_2.safetensors`, loaded with
# `load_lora_weights(dir, weight_name=..., load_into_transformer_2=True)`).
LORA_FILE_SUFFIX = {"high_noise": "", "low_noise": "_transformer_2"}


class WanStreamingDecoder:
    """Decodes one video's latents piece by piece with diffusers' `AutoencoderKLWan`, as its own
    `_decode` does for the whole: frame by frame through the decoder's causal convolutions, whose
    feature cache (`_feat_map`) is kept from one piece to the next instead of cleared, so the pieces
    put together equal the whole video decoded at once (the first latent frame gives 1 frame, each
    later one 4)."""

    def __init__(self, vae: torch.nn.Module):
        self.vae = vae
        self.frames_done = 0
        vae.clear_cache()

    @torch.no_grad()
    def decode(self, raw_latents: torch.Tensor) -> torch.Tensor:
        from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

        vae = self.vae
        x = vae.post_quant_conv(raw_latents)  # a 1x1x1 convolution: frame-wise
        pieces = []
        for i in range(x.shape[2]):
            vae._conv_idx = [0]
            pieces.append(
                vae.decoder(x[:, :, i : i + 1], feat_cache=vae._feat_map, feat_idx=vae._conv_idx, first_chunk=self.frames_done == 0)
            )
            self.frames_done += 1
        out = torch.cat(pieces, dim=2)
        if vae.config.patch_size is not None:
            out = unpatchify(out, patch_size=vae.config.patch_size)
        return out.clamp(-1.0, 1.0)

    def close(self) -> None:
        self.vae.clear_cache()


class ExpertPair(torch.nn.Module):
    """Both experts of a Wan 2.2 A14B repo trained together (`models.student.expert: both`). Its
    forward runs one expert by name, so an engine's wrapper around the pair sees every call."""

    def __init__(self, high: torch.nn.Module, low: torch.nn.Module):
        super().__init__()
        self.high = high
        self.low = low

    @property
    def config(self) -> Any:
        return self.high.config

    def expert(self, name: str) -> torch.nn.Module:
        return self.high if name == "high_noise" else self.low

    def enable_gradient_checkpointing(self) -> None:
        self.high.enable_gradient_checkpointing()
        self.low.enable_gradient_checkpointing()

    def forward(self, expert: str, **kwargs: Any) -> Any:
        return self.expert(expert)(**kwargs)


@dataclass(frozen=True)
class WanLayout:
    """What a Wan-family repo's `model_index.json` says about the model (defaults without one)."""

    pipeline: Optional[str] = None  # the pipeline class name
    expand_timesteps: bool = False  # Wan 2.2 TI2V: per-token timesteps, first-frame condition
    boundary_ratio: Optional[float] = None  # Wan 2.2 A14B: high-noise expert for t >= ratio * N
    two_experts: bool = False  # `transformer_2` present

    @classmethod
    def read(cls, st: StudentConfig) -> "WanLayout":
        if st.init_from is None:
            return cls()
        index = fetch_config(st.init_from, None, revision=st.revision, required=False, filename="model_index.json")
        if not index:
            return cls()
        second = index.get("transformer_2")
        return cls(
            pipeline=index.get("_class_name"),
            expand_timesteps=bool(index.get("expand_timesteps", False)),
            boundary_ratio=index.get("boundary_ratio"),
            two_experts=isinstance(second, (list, tuple)) and second[:1] != [None] and bool(second),
        )


@register_family
class WanStudent(DiffusersStudent):
    """The Wan family: Wan 2.1 T2V/I2V, Wan 2.2 TI2V-5B and A14B experts, SkyReels-V2.

    Image-to-video comes in two forms, read from the model: a 36-channel transformer takes
    [x_t, 4-channel first-frame mask, normalised latent of the first frame followed by zeros]
    (Wan 2.1 I2V, with CLIP image features; Wan 2.2 I2V-A14B), and an `expand_timesteps` model
    (Wan 2.2 TI2V-5B, `models.student.task: i2v`) sees the first latent frame clean at t = 0.
    """

    family = "wan"
    vae_class_names = ("AutoencoderKLWan",)
    transformer_classes = {"wan": WanTransformer3DModel, "skyreels_v2": SkyReelsV2Transformer3DModel}
    pipeline_class_names = ("WanPipeline", "WanImageToVideoPipeline", "WanVideoToVideoPipeline",
                            "SkyReelsV2Pipeline", "SkyReelsV2DiffusionForcingPipeline",
                            "SkyReelsV2ImageToVideoPipeline", "SkyReelsV2DiffusionForcingImageToVideoPipeline")
    capabilities = Capabilities(
        per_frame_timesteps=True, causal_attention=True, image_conditioning=False, context_parallel=True
    )
    lora_target_modules = ("to_q", "to_k", "to_v", "to_out.0")
    comfyui_lora = True
    # REFERENCE.md section 1: FastVideo's default training shift of the Wan models.
    default_flow_shift = 3.0
    latent_statistics_source = "vae/config.json"

    @classmethod
    def lora_pipeline_class(cls, kind: str) -> type:
        from diffusers import SkyReelsV2DiffusionForcingPipeline, WanPipeline

        # WanPipeline's LoRA files load into WanImageToVideoPipeline too (one Wan LoRA loader).
        return SkyReelsV2DiffusionForcingPipeline if kind == "skyreels_v2" else WanPipeline

    @classmethod
    def comfyui_module_name(cls, module: str) -> str:
        return wan_comfyui_module_name(module)

    @classmethod
    def pipeline_prompt(cls, caption: str) -> str:
        """The Wan and SkyReels-V2 pipelines' `prompt_clean` (fv_accel.models.encoders.wan_prompt_clean)."""
        from fv_accel.models.encoders import wan_prompt_clean

        return wan_prompt_clean(caption)

    # ---- preprocessing and validation ----
    @classmethod
    def encoding_spec(cls, model: str, revision: Optional[str] = None) -> Any:
        from fv_accel.models.encoders import describe_model

        return describe_model(model, revision=revision)

    @classmethod
    def make_encoder(cls, model: str, *, device=None, dtype=torch.float32, revision=None, vae_tiling=False, spec=None) -> Any:
        from fv_accel.models.encoders import TextVideoEncoder

        return TextVideoEncoder(model, device=device, dtype=dtype, revision=revision, vae_tiling=vae_tiling, spec=spec)

    @classmethod
    def latent_statistics(cls, model: str, revision: Optional[str] = None) -> Optional[tuple[list[float], list[float]]]:
        """The Wan VAE's `latents_mean`/`latents_std` (vae/config.json)."""
        vae = fetch_config(model, "vae", revision=revision, required=False)
        if vae is None or vae.get("latents_mean") is None or vae.get("latents_std") is None:
            return None
        return list(vae["latents_mean"]), list(vae["latents_std"])

    @classmethod
    def stream_decoder(cls, vae: Any) -> Optional[WanStreamingDecoder]:
        """Wan's VAE decodes frame by frame with a causal cache: it streams (not when tiled)."""
        if getattr(vae, "use_tiling", False) or type(vae).__name__ != "AutoencoderKLWan":
            return None
        return WanStreamingDecoder(vae)

    @classmethod
    def load_vae(cls, model: str, *, revision: Optional[str] = None, torch_dtype: torch.dtype = torch.float32) -> Any:
        from fv_accel.models.loading import load_vae

        return load_vae(model, revision=revision, torch_dtype=torch_dtype)

    # ---- construction ----
    def build_transformers(self, st: StudentConfig) -> tuple[torch.nn.Module, str, list[torch.nn.Module]]:
        self.layout = WanLayout.read(st)
        self.expert = self._resolve_expert(st)
        if self.expert == "both":
            high, kind = build_transformer(st, EXPERT_SUBFOLDERS["high_noise"])
            low, _ = build_transformer(st, EXPERT_SUBFOLDERS["low_noise"])
            return ExpertPair(high, low), kind, [high, low]
        transformer, kind = build_transformer(st, self._subfolder(st))
        return transformer, kind, [transformer]

    def weight_subfolders(self) -> list[Optional[str]]:
        if self.expert == "both":
            return [EXPERT_SUBFOLDERS["high_noise"], EXPERT_SUBFOLDERS["low_noise"]]
        return [self._subfolder(self.student_config) or None]

    def training_shift(self, latent_shape: torch.Size) -> float:
        """`models.student.flow_shift`, else FastVideo's Wan default (REFERENCE.md section 1)."""
        st = self.student_config
        return float(self.default_flow_shift if st.flow_shift is None else st.flow_shift)

    def describe_training_shift(self) -> Any:
        return self.training_shift(torch.Size([1, 1, 1, 1, 1]))

    def configure(self, config: Any) -> None:
        self.condition_channels = int(config.in_channels) - self.in_channels  # mask + condition latent (I2V)
        self.uses_image_features = config.get("image_dim") is not None
        # SkyReels-V2-DF-1.3B's fps embedding (diffusers' conversion sets `inject_sample_info`).
        self.injects_sample_info = bool(config.get("inject_sample_info", False))
        self.task = self._resolve_task(self.student_config)
        self.capabilities = Capabilities(
            per_frame_timesteps=True, causal_attention=True, image_conditioning=self.task == "i2v",
            context_parallel=True,
        )

    def install_causal_attention(self, cfg: RunConfig) -> None:
        """Block-causal self-attention (fv_accel/models/attention.py), block size = method.chunk_size."""
        from fv_accel.config import parse_chunk_size
        from fv_accel.models.attention import CausalSpec, install_causal_attention

        st = self.student_config
        if self.expert == "both":
            raise ValueError(
                "models.student.causal with models.student.expert: both is not supported: train a causal "
                "student one expert at a time (high_noise, low_noise)"
            )
        self.causal_block_size = parse_chunk_size(cfg.method.chunk_size)
        # A clean condition frame is a block of its own, the chunks follow it (as DFSFT's noise chunks).
        spec = CausalSpec(self.causal_block_size, st.local_attn_size, st.sink_size, prefix_frames=self.condition_frames)
        self.causal_attention = install_causal_attention(self.transformer, spec, st.causal_attention_backend)

    @property
    def condition_frames(self) -> int:
        """Leading latent frames given clean: the first frame, for image-to-video on an
        `expand_timesteps` model (Wan2.2-TI2V-5B); 0 otherwise."""
        return 1 if self.task == "i2v" and self.layout.expand_timesteps and not self.condition_channels else 0

    def input_dtype_of(self, module: torch.nn.Module) -> torch.dtype:
        # The patch embedding's dtype, not the first parameter's: diffusers keeps some tables in fp32.
        return module.patch_embedding.weight.dtype

    def after_setup(self) -> None:
        self.per_frame_time_embeddings = (
            [PerFrameTimeEmbedding(module) for module in self.modules] if self.kind == "wan" else []
        )

    # ---- variants ----
    def _resolve_expert(self, st: StudentConfig) -> Optional[str]:
        where = st.init_from or "models.student.transformer_config"
        if self.layout.two_experts and self.layout.boundary_ratio is not None:
            if st.expert is None:
                raise ValueError(
                    f"model '{where}' has two experts (transformer: high noise, transformer_2: low noise, "
                    f"boundary_ratio {self.layout.boundary_ratio}): set models.student.expert to high_noise, low_noise or both"
                )
            return st.expert
        if st.expert is not None:
            raise ValueError(
                f"models.student.expert is {st.expert!r} but model '{where}' has one transformer "
                f"(no transformer_2 and boundary_ratio in its model_index.json): remove the key"
            )
        return None

    def _subfolder(self, st: StudentConfig) -> str:
        if self.expert in (None, "both"):
            return st.subfolder
        wanted = EXPERT_SUBFOLDERS[self.expert]
        if st.subfolder not in ("transformer", wanted):
            raise ValueError(
                f"models.student.subfolder {st.subfolder!r} contradicts models.student.expert {self.expert!r} "
                f"(its weights are in {wanted!r}): remove models.student.subfolder"
            )
        return wanted

    def _resolve_task(self, st: StudentConfig) -> str:
        where = st.init_from or "models.student.transformer_config"
        if self.condition_channels:  # a channel-concat image-to-video transformer
            if self.condition_channels != 4 + self.in_channels:
                raise ValueError(
                    f"model '{where}': a transformer with in_channels {self.in_channels + self.condition_channels} "
                    f"and out_channels {self.in_channels} is neither text-to-video nor Wan image-to-video "
                    f"(in = 2 * out + 4)"
                )
            if st.task == "t2v":
                raise ValueError(f"models.student.task is t2v but model '{where}' is an image-to-video model")
            return "i2v"
        if st.task == "i2v" and not self.layout.expand_timesteps:
            raise ValueError(
                f"models.student.task is i2v but model '{where}' takes no image condition (neither a 36-channel "
                f"image-to-video transformer nor an expand_timesteps model such as Wan2.2-TI2V-5B)"
            )
        return "i2v" if st.task == "i2v" else "t2v"

    @property
    def boundary_timestep(self) -> float:
        """Timesteps >= this go to the high-noise expert (diffusers' `boundary_ratio * N`)."""
        return float(self.layout.boundary_ratio) * 1000.0

    def timestep_bounds(self) -> Optional[tuple[float, float]]:
        if self.expert in (None, "both"):
            return None
        b = self.boundary_timestep
        return (b, math.inf) if self.expert == "high_noise" else (-math.inf, b)

    def describe_timestep_bounds(self) -> str:
        return f"expert {self.expert} of boundary_ratio {self.layout.boundary_ratio}"

    # ---- set-up ----
    # ---- per step ----
    def build_conditioning(self, batch: dict) -> Conditioning:
        cond = super().build_conditioning(batch)
        if self.task != "i2v":
            return cond
        if self.condition_frames:
            cond.clean_frames = self.condition_frames  # the first latent frame is the condition itself
        else:
            first = batch.get("first_frame_latent")
            if first is None:
                raise ValueError(
                    "an image-to-video student needs the 'first_frame_latent' column (the VAE latent of the first "
                    "frame followed by zeros): preprocess the clips with this model (python -m fv_accel.preprocess "
                    "--model ...)"
                )
            # Stored normalised (FastVideo's I2V column; diffusers' prepare_latents builds the same).
            cond.condition_latent = first.to(device=self.device, dtype=torch.float32)
        if self.uses_image_features:
            image = batch.get("clip_feature")
            if image is None:
                raise ValueError(
                    "this image-to-video model takes CLIP image features: the dataset lacks the 'clip_feature' "
                    "column; preprocess the clips with this model (python -m fv_accel.preprocess --model ...)"
                )
            cond.image = image.to(device=self.device, dtype=torch.float32)
        return cond

    def model_input(self, x_t: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """x_t, or for a channel-concat image-to-video transformer [x_t, first-frame mask, condition]."""
        if not self.condition_channels:
            return x_t
        if cond.condition_latent is None:
            raise ValueError("an image-to-video transformer needs conditioning.condition_latent")
        b, _, t, h, w = x_t.shape
        mask = x_t.new_zeros(b, self.condition_channels - self.in_channels, t, h, w)
        mask[:, :, 0] = 1.0  # the latent frame that holds the given first frame
        return torch.cat([x_t, mask, cond.condition_latent.to(x_t.dtype)], dim=1)

    def timestep_input(self, timesteps: torch.Tensor, latent_shape: torch.Size) -> tuple[torch.Tensor, dict]:
        """The timestep tensor and extra kwargs the transformer needs for [B] or per-frame [B, T]."""
        if timesteps.ndim == 1:
            return timesteps, {}
        if timesteps.ndim != 2 or timesteps.shape[1] != latent_shape[2]:
            raise ValueError(
                f"per-frame timesteps must be [B, T={latent_shape[2]}], got {tuple(timesteps.shape)}"
            )
        if self.kind == "skyreels_v2":
            return timesteps, {"enable_diffusion_forcing": True}
        p_t, p_h, p_w = self.patch_size
        if p_t != 1:
            raise ValueError("per-frame timesteps need a temporal patch size of 1")
        tokens_per_frame = (latent_shape[3] // p_h) * (latent_shape[4] // p_w)
        return timesteps.repeat_interleave(tokens_per_frame, dim=1), {}

    def forward(self, x_t: torch.Tensor, t: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """The transformer's output for x_t, read as a flow velocity; [B, C, T, H, W].

        With both experts, each sample ([B] timesteps) or each frame ([B, T]) is denoised by the
        expert its timestep belongs to (high noise for t >= boundary, as diffusers' pipelines)."""
        if self.expert != "both":
            return self._expert_forward(None, x_t, t, cond)
        high = t >= self.boundary_timestep
        if bool(high.all()) or not bool(high.any()):
            return self._expert_forward("high_noise" if bool(high.all()) else "low_noise", x_t, t, cond)
        if t.ndim == 1:  # split the batch by sample
            hi, lo = high.nonzero().flatten(), (~high).nonzero().flatten()
            out = torch.cat(
                [
                    self._expert_forward("high_noise", x_t[hi], t[hi], cond.select(hi)),
                    self._expert_forward("low_noise", x_t[lo], t[lo], cond.select(lo)),
                ]
            )
            return out[torch.cat([hi, lo]).argsort()]
        # per frame: both experts see the whole clip; each frame takes its own expert's output
        out_high = self._expert_forward("high_noise", x_t, t, cond)
        out_low = self._expert_forward("low_noise", x_t, t, cond)
        return torch.where(high[:, None, :, None, None], out_high, out_low)

    def _expert_forward(self, expert: Optional[str], x_t: torch.Tensor, t: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        t_in, extra = self.timestep_input(t, x_t.shape)
        # The patch embedding's dtype, not the first parameter's: diffusers keeps some tables in fp32.
        dtype = self.input_dtype
        if cond.image is not None:
            extra["encoder_hidden_states_image"] = cond.image.to(dtype)
        if expert is not None:
            extra["expert"] = expert
        if self.injects_sample_info:
            # One entry for the whole batch, broadcast by the transformer (under diffusion forcing
            # its per-sample list broadcasts against [B, T] timesteps only for batch 1).
            extra["fps"] = [SKYREELS_FPS_INDEX]
        per_frame = t.ndim == 2 and t_in.ndim == 2
        for embedding in self.per_frame_time_embeddings if per_frame else ():
            embedding.tokens_per_frame = t_in.shape[1] // t.shape[1]
        try:
            out = self.transformer(
                hidden_states=self.model_input(x_t, cond).to(dtype),
                timestep=t_in,
                encoder_hidden_states=cond.text.to(dtype),
                return_dict=False,
                **extra,
            )[0]
        finally:
            for embedding in self.per_frame_time_embeddings if per_frame else ():
                embedding.tokens_per_frame = None
        return out

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
        first_frame: Optional[Any] = None,
    ) -> Optional[torch.Tensor]:
        """A sample through the repo's own diffusers pipeline (WanPipeline, or WanImageToVideoPipeline
        from `first_frame`, a uint8 [H, W, 3] image) around the live transformer, stepping with
        `scheduler` (a diffusers scheduler); returns the normalised latents. A single Wan 2.2 expert
        samples with the base repo's other expert."""
        from diffusers import WanImageToVideoPipeline, WanPipeline

        from fv_accel.sampling import pipeline_latents

        if self.kind == "skyreels_v2" or self.uses_image_features:
            # Validation's whole-clip loop over `forward` with the same scheduler: SkyReels-V2's stock
            # pipeline samples by diffusion forcing, and WanImageToVideoPipeline takes the image or
            # precomputed CLIP features, not both, while its condition latent needs the image (the
            # CLIP encoder is not kept loaded).
            return None

        transformer, transformer_2 = self.transformer, None
        if self.expert == "both":
            transformer, transformer_2 = self.transformer.high, self.transformer.low
        elif self.expert is not None:
            other = self._other_expert().to(self.device)
            transformer, transformer_2 = (transformer, other) if self.expert == "high_noise" else (other, transformer)
        parts = dict(
            tokenizer=None,
            text_encoder=None,
            vae=vae,
            scheduler=scheduler,
            transformer=transformer,
            transformer_2=transformer_2,
            boundary_ratio=self.layout.boundary_ratio if self.expert is not None else None,
            expand_timesteps=self.layout.expand_timesteps,
        )
        call: dict[str, Any] = {}
        if self.task == "i2v":
            if first_frame is None:
                raise ValueError("an image-to-video sample needs a first frame")
            from PIL import Image

            pipe = WanImageToVideoPipeline(image_encoder=None, image_processor=None, **parts)
            call["image"] = Image.fromarray(np.asarray(first_frame, dtype=np.uint8))
        else:
            pipe = WanPipeline(**parts)
        try:
            return pipeline_latents(
                pipe,
                cond.text,
                None if negative is None else negative.text,
                height=height,
                width=width,
                num_frames=num_frames,
                num_inference_steps=num_inference_steps,
                guidance_scale=guidance_scale,
                generator=generator,
                **call,
            )
        finally:
            if self.expert in ("high_noise", "low_noise"):
                self._other_expert().to("cpu")

    def _other_expert(self) -> torch.nn.Module:
        """The frozen other expert of the base repo (for sample videos), kept on the CPU between uses."""
        if getattr(self, "_other", None) is None:
            other = "low_noise" if self.expert == "high_noise" else "high_noise"
            module, _ = build_transformer(self.student_config, EXPERT_SUBFOLDERS[other])
            self._other = module.eval().requires_grad_(False)
        return self._other

    # ---- engines, LoRA state and outputs ----
    def attach_accelerator(self, accelerator: Any) -> None:
        from accelerate.utils import DistributedType

        if self.expert == "both" and accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
            raise ValueError(
                f"models.student.expert: both runs under DDP or one process, not {accelerator.distributed_type.value}: "
                f"train the experts one at a time (high_noise, low_noise) with a sharded engine"
            )
        super().attach_accelerator(accelerator)

    def lora_files_state(self, accelerator: Any = None) -> tuple[dict, dict]:
        """The adapter as written to files (see DiffusersStudent). With both experts, the keys
        carry the expert's name (`high_noise.` / `low_noise.`)."""
        from fv_accel.models.lora import adapter_metadata, adapter_state_dict, deployable_lora

        if self.expert != "both":
            return super().lora_files_state(accelerator)
        module = self._unwrapped(accelerator)
        state: dict = {}
        for name in EXPERT_SUBFOLDERS:
            expert = module.expert(name)
            part, metadata = deployable_lora(adapter_state_dict(expert), adapter_metadata(expert), None)
            part.update(self.gate_state(expert))
            state.update({f"{name}.{k}": v for k, v in part.items()})
        return state, metadata

    def load_lora_files_state(self, state: dict, metadata: Optional[dict]) -> None:
        if self.expert != "both":
            return super().load_lora_files_state(state, metadata)
        self.check_lora_file_rank(metadata)
        module = self._unwrapped()
        for name in EXPERT_SUBFOLDERS:
            part = {k[len(name) + 1:]: v for k, v in state.items() if k.startswith(name + ".")}
            if not part:
                raise ValueError(f"the checkpoint's LoRA holds no adapter of the {name} expert (models.student.expert: both)")
            self.load_adapter_and_gates(module.expert(name), part, metadata)

    def lora_files(self, state: dict) -> dict[str, dict]:
        """A run of both experts writes each expert's adapter under its own file-name suffix."""
        if self.expert != "both":
            return {"": state}
        return {
            LORA_FILE_SUFFIX[name]: {k[len(name) + 1:]: v for k, v in state.items() if k.startswith(name + ".")}
            for name in EXPERT_SUBFOLDERS
        }

    def transformer_folders(self, accelerator: Any) -> dict[str, torch.nn.Module]:
        """`transformer` (and `transformer_2` for both experts, or a low-noise expert alone)."""
        module = accelerator.unwrap_model(self.transformer)
        if self.expert == "both":
            return {sub: module.expert(name) for name, sub in EXPERT_SUBFOLDERS.items()}
        return {EXPERT_SUBFOLDERS[self.expert] if self.expert else "transformer": module}

    def base_model_info(self) -> dict:
        return {**super().base_model_info(), "expert": self.expert, "task": self.task}

    def predict_noise_teacher_forcing(
        self,
        context_latents: torch.Tensor,
        context_timesteps: torch.Tensor,
        noisy_latents: torch.Tensor,
        timesteps: torch.Tensor,
        training_batch: TrainingBatch,
        *,
        conditional: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over [context | noisy] frames (teacher forcing); returns both halves' outputs.

        Needs block-causal attention: noisy block b sees itself and the context copies of blocks < b.
        """
        if self.causal_attention is None:
            raise ValueError("teacher forcing needs block-causal attention: set models.student.causal: true")
        num_frames = noisy_latents.shape[2]
        with self.causal_attention.teacher_forcing():
            out = self.predict_noise(
                torch.cat([context_latents, noisy_latents], dim=2),
                torch.cat([context_timesteps, timesteps], dim=1),
                training_batch,
                conditional=conditional,
            )
        return out[:, :, :num_frames], out[:, :, num_frames:]
