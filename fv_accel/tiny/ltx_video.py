"""Seeded tiny LTX-Video models in the diffusers layouts of Lightricks/LTX-Video, for offline tests.

    python -m fv_accel.tiny_model DIR --model ltx_video             # LTXPipeline (0.9.0 to 0.9.5)
    python -m fv_accel.tiny_model DIR --model ltx_video_condition   # LTXConditionPipeline (0.9.7)

The folder holds what `LTXPipeline.from_pretrained(DIR)` reads: a T5 encoder (T5EncoderModel) and
its tokenizer, an `AutoencoderKLLTXVideo` with the real geometry (pixels patchified 4x4, three
spatio-temporal downsamplings: 32x spatial, 8x temporal, so frame counts are 8k + 1) whose
`latents_mean`/`latents_std` buffers are measured on procedural clips and whose decoder is
timestep-conditioned (as from LTX-Video 0.9.1 on), an `LTXVideoTransformer3DModel` (patch 1x1x1) and
the repo's `FlowMatchEulerDiscreteScheduler` config (resolution-dependent shift: `use_dynamic_shifting`
with `base_shift`/`max_shift` over `base_image_seq_len`..`max_image_seq_len` tokens, `shift_terminal`).

The condition variant is what diffusers' scripts/convert_ltx_to_diffusers.py writes for 0.9.7: an
`LTXConditionPipeline` folder, the 0.9.5+ VAE layout (four `LTXVideo095DownBlock3D`s downsampling
space, time, then both twice, compression ratios 32 and 8 recorded in its config; a decoder of three
residual 2x up blocks) and a scheduler without dynamic shifting.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from fv_accel.tiny.model import TinyModel, build_tiny_text_encoder, save_tiny_pipeline

# Lightricks/LTX-Video scheduler/scheduler_config.json (0.9.x): the keys LTXPipeline reads for `mu`
# and the terminal stretch of its sampling sigmas.
LTX_SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000,
    shift=1.0,
    use_dynamic_shifting=True,
    base_shift=0.95,
    max_shift=2.05,
    base_image_seq_len=1024,
    max_image_seq_len=4096,
    shift_terminal=0.1,
)

TINY_LTX_TEXT_DIM = 32
TINY_LTX_LATENT_CHANNELS = 16
# LTX-Video's VAE: 4x4 pixel patches, then three blocks that halve time, height and width (the
# fourth keeps the size): 32x spatial, 8x temporal, causal encoder. Toy widths and depths.
TINY_LTX_VAE_CONFIG = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=TINY_LTX_LATENT_CHANNELS,
    block_out_channels=(8, 8, 16, 16),
    # One width through the decoder: a timestep-conditioned up block that changes width gets an
    # input resnet fed the raw timestep, which diffusers' decoder cannot run.
    decoder_block_out_channels=(16, 16, 16, 16),
    layers_per_block=(1, 1, 1, 1, 1),
    decoder_layers_per_block=(1, 1, 1, 1, 1),
    spatio_temporal_scaling=(True, True, True, False),
    decoder_spatio_temporal_scaling=(True, True, True, False),
    decoder_inject_noise=(False, False, False, False, False),
    timestep_conditioning=True,
    patch_size=4,
    patch_size_t=1,
    encoder_causal=True,
    decoder_causal=False,
)
# The 0.9.5+ VAE (diffusers' conversion for 0.9.5 and 0.9.7) at toy widths: each residual up block
# halves the width its upsampler doubles (decoder widths 32, 16, 8 from the latent side), as 1024, 512,
# 256 in the real one, so every up block keeps its width.
TINY_LTX_095_VAE_CONFIG = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=TINY_LTX_LATENT_CHANNELS,
    block_out_channels=(8, 8, 16, 16, 16),
    down_block_types=("LTXVideo095DownBlock3D",) * 4,
    decoder_block_out_channels=(8, 16, 32),
    layers_per_block=(1, 1, 1, 1, 1),
    decoder_layers_per_block=(1, 1, 1, 1),
    spatio_temporal_scaling=(True, True, True, True),
    decoder_spatio_temporal_scaling=(True, True, True),
    decoder_inject_noise=(False, False, False, False),
    downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
    upsample_residual=(True, True, True),
    upsample_factor=(2, 2, 2),
    timestep_conditioning=True,
    patch_size=4,
    patch_size_t=1,
    encoder_causal=True,
    decoder_causal=False,
    spatial_compression_ratio=32,
    temporal_compression_ratio=8,
)
# The scheduler diffusers' conversion gives 0.9.5 and 0.9.7: no dynamic shifting.
LTX_095_SCHEDULER_CONFIG = dict(num_train_timesteps=1000, use_dynamic_shifting=False)

# LTXVideoTransformer3DModel at toy size: caption_channels is the T5 width; cross-attention runs at
# the transformer's width (as in the real model: 2048 = 32 heads x 64).
TINY_LTX_TRANSFORMER_CONFIG = dict(
    in_channels=TINY_LTX_LATENT_CHANNELS,
    out_channels=TINY_LTX_LATENT_CHANNELS,
    patch_size=1,
    patch_size_t=1,
    num_attention_heads=2,
    attention_head_dim=16,
    cross_attention_dim=32,
    num_layers=2,
    caption_channels=TINY_LTX_TEXT_DIM,
)


# Pipeline class -> (VAE config, scheduler config) of its tiny model.
TINY_LTX_LAYOUTS = {
    "LTXPipeline": (TINY_LTX_VAE_CONFIG, LTX_SCHEDULER_CONFIG),
    "LTXConditionPipeline": (TINY_LTX_095_VAE_CONFIG, LTX_095_SCHEDULER_CONFIG),
}


def build_tiny_ltx_vae(seed: int, pipeline: str = "LTXPipeline"):
    from diffusers import AutoencoderKLLTXVideo

    torch.manual_seed(seed)
    return AutoencoderKLLTXVideo(**TINY_LTX_LAYOUTS[pipeline][0]).eval()


@functools.lru_cache(maxsize=None)
def tiny_ltx_latent_stats(seed: int, pipeline: str = "LTXPipeline") -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean/std of the tiny VAE's latents (the posterior's mode) over procedural clips
    of 17 frames at 64x64, so that its `latents_mean`/`latents_std` buffers describe its own latent
    space as LTX-Video's describe LTX-Video's."""
    from fv_accel.tiny.clips import clip_batch

    vae = build_tiny_ltx_vae(seed, pipeline)
    video = clip_batch(8, 123, num_frames=17, height=64, width=64)
    with torch.no_grad():
        z = vae.encode(video).latent_dist.mode()  # [B, C, T, H, W]
    mean = z.mean(dim=(0, 2, 3, 4))
    std = z.std(dim=(0, 2, 3, 4)).clamp_min(1e-4)
    return tuple(round(float(v), 6) for v in mean), tuple(round(float(v), 6) for v in std)


def write_tiny_ltx_video(out_dir: str | Path, seed: int = 0, pipeline: str = "LTXPipeline") -> Path:
    """Write the tiny LTX-Video model of `pipeline` (a key of TINY_LTX_LAYOUTS) to `out_dir` with
    that pipeline's `save_pretrained`; returns its path.

    Deterministic for a given seed: the tokenizer, then the text encoder (seed + 1), the VAE
    (seed + 2) and the transformer (seed + 3), each drawn from its own seed.
    """
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler, LTXVideoTransformer3DModel

    from fv_accel.tiny.model import build_tiny_tokenizer

    out = Path(out_dir)
    tokenizer = build_tiny_tokenizer()
    # A T5 v1.1-style encoder (gated GELU feed-forward), as LTX-Video's T5-XXL at toy size.
    text_encoder = build_tiny_text_encoder(len(tokenizer), seed + 1, t5=True, d_model=TINY_LTX_TEXT_DIM, feed_forward_proj="gated-gelu")
    vae = build_tiny_ltx_vae(seed + 2, pipeline)
    mean, std = tiny_ltx_latent_stats(seed + 2, pipeline)
    # LTX keeps its statistics as persistent buffers (saved in the safetensors file), not in the config.
    vae.latents_mean.copy_(torch.tensor(mean))
    vae.latents_std.copy_(torch.tensor(std))
    torch.manual_seed(seed + 3)
    transformer = LTXVideoTransformer3DModel(**TINY_LTX_TRANSFORMER_CONFIG)
    scheduler = FlowMatchEulerDiscreteScheduler(**TINY_LTX_LAYOUTS[pipeline][1])
    pipe = getattr(diffusers, pipeline)(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer
    )
    return save_tiny_pipeline(pipe, out, {"tokenizer": ["transformers", "PreTrainedTokenizerFast"]})


def _write_condition(out_dir: Path, seed: int) -> Path:
    return write_tiny_ltx_video(out_dir, seed, "LTXConditionPipeline")


# `python -m fv_accel.tiny_model DIR --model ltx_video` (fv_accel.tiny.registry collects these).
TINY_MODEL_ENTRIES = {
    "ltx_video": TinyModel(
        summary="LTXPipeline: T5, AutoencoderKLLTXVideo (32x spatial, 8x temporal), LTXVideoTransformer3DModel",
        layout="Lightricks/LTX-Video",
        write=write_tiny_ltx_video,
    ),
    "ltx_video_condition": TinyModel(
        summary="LTXConditionPipeline: T5, the 0.9.5+ AutoencoderKLLTXVideo layout, LTXVideoTransformer3DModel",
        layout="Lightricks/LTX-Video-0.9.7-dev",
        write=_write_condition,
    ),
}
