"""A seeded tiny LTX-2 (audio and video) in the diffusers layout of Lightricks/LTX-2, for offline tests.

    python -m fv_accel.tiny_model DIR --model ltx2

The folder holds what `LTX2Pipeline.from_pretrained(DIR)` reads, every component built from a config:
a Gemma 3 text encoder (`Gemma3ForConditionalGeneration`, a toy text tower and vision tower) and its
tokenizer, the text connectors (`LTX2TextConnectors`: the stacked hidden states of every Gemma layer
projected, then one connector stack per modality with learnable registers), an
`AutoencoderKLLTX2Video` with the real geometry (4x4 pixel patches, four down blocks: 32x spatial,
8x temporal, so frame counts are 8k + 1), an `AutoencoderKLLTX2Audio` (stereo log-mel at 16 kHz,
hop 160, 4x compression of time and mel bins; `base_channels` = latent channels x latent mel bins,
as the pipeline normalises packed audio tokens with its per-feature statistics), an `LTX2Vocoder`
(mel -> 16 kHz stereo waveform), the `LTX2VideoTransformer3DModel` (video and audio branches joined
by audio-to-video and video-to-audio cross-attention) and the scheduler config of the repo
(resolution-dependent shift).

Every config flag is the class default, which is LTX-2.0's (rope type, registers, causal offset,
normalisation, qk norm, timestep multipliers); only widths, depths and channel counts are toy-sized.

    python -m fv_accel.tiny_model DIR --model ltx2_3    (or ltx2_5)

LTX-2.3 and LTX-2.5 (`TINY_LTX2_VARIANTS`) set, over that, every flag diffusers' conversion script
writes for the real checkpoints (scripts/convert_ltx2_to_diffusers.py, versions "2.3" / "2.5"):
the transformer's gated attention, prompt (cross-attention) modulation, split RoPE, STG-ready
perturbed attention and no caption projection (the connectors project per modality instead; 2.5
also drops the video feed-forward bias and adds the keyframe embedding); the connectors' gated
attention, per-modality projections with bias and split RoPE; the video VAE's 2.3 decoder
(four up blocks, no residual upsampling, zero padding); the vocoder with bandwidth extension
(`LTX2VocoderWithBWE`, snake-beta activations, anti-aliasing, 48 kHz). LTX-2.5's text encoder is
Gemma 4 (`Gemma4UnifiedForConditionalGeneration`), the others' Gemma 3.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from fv_accel.tiny.model import TinyModel, save_tiny_pipeline

# Lightricks/LTX-2 scheduler/scheduler_config.json: the keys LTX2Pipeline reads for `mu`.
LTX2_SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000,
    shift=1.0,
    use_dynamic_shifting=True,
    base_shift=0.95,
    max_shift=2.05,
    base_image_seq_len=1024,
    max_image_seq_len=4096,
    shift_terminal=0.1,
)

TINY_LTX2_TEXT_DIM = 16
TINY_LTX2_TEXT_LAYERS = 2
TINY_LTX2_LATENT_CHANNELS = 8
TINY_LTX2_AUDIO_LATENT_CHANNELS = 2
TINY_LTX2_MEL_BINS = 16  # 4 latent mel bins: 2 channels x 4 bins = 8 packed audio features

# The 2.0 video VAE layout at toy widths (four LTX2VideoDownBlock3Ds: space, time, then both twice).
TINY_LTX2_VAE_CONFIG = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=TINY_LTX2_LATENT_CHANNELS,
    block_out_channels=(8, 8, 16, 16),
    down_block_types=("LTX2VideoDownBlock3D",) * 4,
    decoder_block_out_channels=(8, 16, 32),
    layers_per_block=(1, 1, 1, 1, 1),
    decoder_layers_per_block=(1, 1, 1, 1),
    spatio_temporal_scaling=(True, True, True, True),
    decoder_spatio_temporal_scaling=(True, True, True),
    decoder_inject_noise=(False, False, False, False),
    downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
    upsample_residual=(True, True, True),
    upsample_factor=(2, 2, 2),
    timestep_conditioning=False,
    patch_size=4,
    patch_size_t=1,
    resnet_norm_eps=1e-6,
    encoder_causal=True,
    decoder_causal=False,
    encoder_spatial_padding_mode="zeros",
    decoder_spatial_padding_mode="reflect",
    spatial_compression_ratio=32,
    temporal_compression_ratio=8,
)

TINY_LTX2_AUDIO_VAE_CONFIG = dict(
    base_channels=TINY_LTX2_AUDIO_LATENT_CHANNELS * TINY_LTX2_MEL_BINS // 4,
    output_channels=2,
    ch_mult=(1, 2, 4),
    num_res_blocks=1,
    in_channels=2,
    resolution=32,
    latent_channels=TINY_LTX2_AUDIO_LATENT_CHANNELS,
    sample_rate=16000,
    mel_hop_length=160,
    mel_bins=TINY_LTX2_MEL_BINS,
)

# Mel frames (100 a second) -> 16 kHz samples: 160x upsampling.
TINY_LTX2_VOCODER_CONFIG = dict(
    in_channels=2 * TINY_LTX2_MEL_BINS,
    hidden_channels=16,
    out_channels=2,
    upsample_kernel_sizes=[16, 10, 8],
    upsample_factors=[8, 5, 4],
    resnet_kernel_sizes=[3],
    resnet_dilations=[[1, 3, 5]],
    output_sampling_rate=16000,
)

TINY_LTX2_CONNECTORS_CONFIG = dict(
    caption_channels=TINY_LTX2_TEXT_DIM,
    text_proj_in_factor=TINY_LTX2_TEXT_LAYERS + 1,
    video_connector_num_attention_heads=2,
    video_connector_attention_head_dim=8,
    video_connector_num_layers=1,
    video_connector_num_learnable_registers=16,
    audio_connector_num_attention_heads=2,
    audio_connector_attention_head_dim=8,
    audio_connector_num_layers=1,
    audio_connector_num_learnable_registers=16,
    connector_rope_base_seq_len=64,
    rope_type="split",  # as diffusers' conversion of the real checkpoints writes (the class default is "interleaved")
)

TINY_LTX2_TRANSFORMER_CONFIG = dict(
    in_channels=TINY_LTX2_LATENT_CHANNELS,
    out_channels=TINY_LTX2_LATENT_CHANNELS,
    num_attention_heads=2,
    attention_head_dim=8,
    cross_attention_dim=16,
    audio_in_channels=TINY_LTX2_AUDIO_LATENT_CHANNELS * TINY_LTX2_MEL_BINS // 4,
    audio_out_channels=TINY_LTX2_AUDIO_LATENT_CHANNELS * TINY_LTX2_MEL_BINS // 4,
    audio_num_attention_heads=2,
    audio_attention_head_dim=4,
    audio_cross_attention_dim=8,
    num_layers=2,
    caption_channels=TINY_LTX2_TEXT_DIM,
    rope_type="split",  # as diffusers' conversion of the real checkpoints writes (the class default is "interleaved")
)

# LTX-2.3 / 2.5 over LTX-2.0, component by component: the conversion script's flags, toy sizes.
_TINY_LTX2_3_TRANSFORMER = dict(
    gated_attn=True, cross_attn_mod=True, audio_gated_attn=True, audio_cross_attn_mod=True,
    use_prompt_embeddings=False, perturbed_attn=True,
)
_TINY_LTX2_3_CONNECTORS = dict(
    video_gated_attn=True, audio_gated_attn=True, per_modality_projections=True,
    # Each connector as wide as its branch of the transformer (video 2 x 8, audio 2 x 4), as 2.3's
    # (4096, 2048): the projections feed the connectors, whose output is the branches' text.
    audio_connector_attention_head_dim=4, video_hidden_dim=16, audio_hidden_dim=8, proj_bias=True,
)
_TINY_LTX2_3_VAE = dict(
    decoder_block_out_channels=(8, 16, 16, 32),
    layers_per_block=(1, 1, 1, 1, 1),
    decoder_layers_per_block=(1, 1, 1, 1, 1),
    decoder_spatio_temporal_scaling=(True, True, True, True),
    decoder_inject_noise=(False, False, False, False, False),
    upsample_type=("spatiotemporal", "spatiotemporal", "temporal", "spatial"),
    upsample_residual=(False, False, False, False),
    upsample_factor=(2, 2, 1, 2),
    decoder_spatial_padding_mode="zeros",
)
# Mel frames (100 a second) -> 16 kHz (x160), then the bandwidth extension's mel (hop 80) -> 48 kHz (x240).
_TINY_LTX2_3_VOCODER = dict(
    in_channels=2 * TINY_LTX2_MEL_BINS,
    hidden_channels=16,
    upsample_kernel_sizes=[11, 8, 16],
    upsample_factors=[5, 4, 8],
    resnet_kernel_sizes=[3],
    resnet_dilations=[[1, 3, 5]],
    bwe_in_channels=2 * TINY_LTX2_MEL_BINS,
    bwe_hidden_channels=16,
    bwe_upsample_kernel_sizes=[12, 11, 16],
    bwe_upsample_factors=[6, 5, 8],
    bwe_resnet_kernel_sizes=[3],
    bwe_resnet_dilations=[[1, 3, 5]],
    filter_length=64,
    hop_length=80,
    window_length=64,
    num_mel_channels=TINY_LTX2_MEL_BINS,
    input_sampling_rate=16000,
    output_sampling_rate=48000,
)
TINY_LTX2_VARIANTS = {
    "2.0": dict(transformer={}, connectors={}, vae={}, vocoder=None, text_encoder="gemma3"),
    "2.3": dict(transformer=_TINY_LTX2_3_TRANSFORMER, connectors=_TINY_LTX2_3_CONNECTORS, vae=_TINY_LTX2_3_VAE,
                vocoder=_TINY_LTX2_3_VOCODER, text_encoder="gemma3"),
    "2.5": dict(transformer=dict(_TINY_LTX2_3_TRANSFORMER, ff_bias=False, use_keyframes_abs_pos_embedding=True),
                connectors=_TINY_LTX2_3_CONNECTORS, vae=_TINY_LTX2_3_VAE, vocoder=_TINY_LTX2_3_VOCODER, text_encoder="gemma4"),
}

# The tokenizer's length: LTX2Pipeline pads prompts to `max_sequence_length` (1024 by default), the
# tiny repo's prompts are short, and its connectors' registers fill the padding.
TINY_LTX2_MAX_SEQUENCE_LENGTH = 64


def build_tiny_gemma4(vocab_size: int, seed: int):
    """A seeded toy `Gemma4UnifiedForConditionalGeneration` (LTX-2.5's text encoder): a text tower of
    TINY_LTX2_TEXT_LAYERS layers (sliding, then full attention), toy vision and audio embedders."""
    from transformers import Gemma4UnifiedConfig, Gemma4UnifiedForConditionalGeneration

    torch.manual_seed(seed)
    config = Gemma4UnifiedConfig(
        text_config=dict(
            vocab_size=vocab_size, hidden_size=TINY_LTX2_TEXT_DIM, intermediate_size=32, num_hidden_layers=TINY_LTX2_TEXT_LAYERS,
            num_attention_heads=2, num_key_value_heads=1, head_dim=8, global_head_dim=8, max_position_embeddings=256,
            sliding_window=64, layer_types=["sliding_attention", "full_attention"],
        ),
        vision_config=dict(patch_size=2, pooling_kernel_size=2, mm_embed_dim=16, mm_posemb_size=16, output_proj_dims=16),
        audio_config=dict(audio_embed_dim=16),
    )
    return Gemma4UnifiedForConditionalGeneration(config).eval()


def build_tiny_gemma3(vocab_size: int, seed: int):
    """A seeded toy `Gemma3ForConditionalGeneration` (text tower of TINY_LTX2_TEXT_LAYERS layers)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(seed)
    config = Gemma3Config(
        text_config=dict(
            vocab_size=vocab_size,
            hidden_size=TINY_LTX2_TEXT_DIM,
            intermediate_size=32,
            num_hidden_layers=TINY_LTX2_TEXT_LAYERS,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            max_position_embeddings=256,
            sliding_window=64,
        ),
        vision_config=dict(
            hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
        ),
        mm_tokens_per_image=4,
    )
    return Gemma3ForConditionalGeneration(config).eval()


def write_tiny_ltx2(out_dir: str | Path, seed: int = 0, version: str = "2.0") -> Path:
    """Write the tiny LTX-`version` (a key of TINY_LTX2_VARIANTS) to `out_dir` with
    `LTX2Pipeline.save_pretrained`; returns its path.

    Deterministic for a given seed: the tokenizer, then the text encoder (seed + 1), the connectors
    (seed + 2), the video VAE (seed + 3), the audio VAE (seed + 4), the vocoder (seed + 5) and the
    transformer (seed + 6), each drawn from its own seed."""
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2Pipeline,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder, LTX2VocoderWithBWE

    from fv_accel.tiny.model import build_tiny_tokenizer

    variant = TINY_LTX2_VARIANTS[version]
    tokenizer = build_tiny_tokenizer()
    tokenizer.model_max_length = TINY_LTX2_MAX_SEQUENCE_LENGTH
    build_text_encoder = build_tiny_gemma4 if variant["text_encoder"] == "gemma4" else build_tiny_gemma3
    text_encoder = build_text_encoder(len(tokenizer), seed + 1)
    torch.manual_seed(seed + 2)
    connectors = LTX2TextConnectors(**{**TINY_LTX2_CONNECTORS_CONFIG, **variant["connectors"]})
    torch.manual_seed(seed + 3)
    vae = AutoencoderKLLTX2Video(**{**TINY_LTX2_VAE_CONFIG, **variant["vae"]}).eval()
    torch.manual_seed(seed + 4)
    audio_vae = AutoencoderKLLTX2Audio(**TINY_LTX2_AUDIO_VAE_CONFIG).eval()
    torch.manual_seed(seed + 5)
    if variant["vocoder"] is None:
        vocoder = LTX2Vocoder(**TINY_LTX2_VOCODER_CONFIG).eval()
    else:
        vocoder = LTX2VocoderWithBWE(**variant["vocoder"]).eval()
    torch.manual_seed(seed + 6)
    transformer = LTX2VideoTransformer3DModel(**{**TINY_LTX2_TRANSFORMER_CONFIG, **variant["transformer"]})
    scheduler = FlowMatchEulerDiscreteScheduler(**LTX2_SCHEDULER_CONFIG)
    pipe = LTX2Pipeline(
        scheduler=scheduler,
        vae=vae,
        audio_vae=audio_vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        connectors=connectors,
        transformer=transformer,
        vocoder=vocoder,
    )
    return save_tiny_pipeline(pipe, Path(out_dir), {"tokenizer": ["transformers", "PreTrainedTokenizerFast"]})


# `python -m fv_accel.tiny_model DIR --model ltx2` (fv_accel.tiny.registry collects these).
_LTX2_PARTS = "text connectors, AutoencoderKLLTX2Video{}, AutoencoderKLLTX2Audio"
TINY_MODEL_ENTRIES = {
    "ltx2": TinyModel(
        summary=f"LTX2Pipeline: Gemma 3, {_LTX2_PARTS.format('')}, LTX2Vocoder, LTX2VideoTransformer3DModel (video + audio)",
        layout="Lightricks/LTX-2",
        write=write_tiny_ltx2,
    ),
    "ltx2_3": TinyModel(
        summary=f"LTX2Pipeline (LTX-2.3): Gemma 3, {_LTX2_PARTS.format(' (2.3 decoder)')}, LTX2VocoderWithBWE, "
        "LTX2VideoTransformer3DModel (gated attention, prompt modulation)",
        layout="diffusers/LTX-2.3-Diffusers",
        write=functools.partial(write_tiny_ltx2, version="2.3"),
    ),
    "ltx2_5": TinyModel(
        summary=f"LTX2Pipeline (LTX-2.5): Gemma 4, {_LTX2_PARTS.format(' (2.3 decoder)')}, LTX2VocoderWithBWE, "
        "LTX2VideoTransformer3DModel (2.3's, no video FF bias, keyframe embedding)",
        layout="Lightricks/LTX-2.5-Diffusers",
        write=functools.partial(write_tiny_ltx2, version="2.5"),
    ),
}
