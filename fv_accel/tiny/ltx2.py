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
"""

from __future__ import annotations

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
)

# The tokenizer's length: LTX2Pipeline pads prompts to `max_sequence_length` (1024 by default), the
# tiny repo's prompts are short, and its connectors' registers fill the padding.
TINY_LTX2_MAX_SEQUENCE_LENGTH = 64


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


def write_tiny_ltx2(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the tiny LTX-2 to `out_dir` with `LTX2Pipeline.save_pretrained`; returns its path.

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
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    from fv_accel.tiny.model import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    tokenizer.model_max_length = TINY_LTX2_MAX_SEQUENCE_LENGTH
    text_encoder = build_tiny_gemma3(len(tokenizer), seed + 1)
    torch.manual_seed(seed + 2)
    connectors = LTX2TextConnectors(**TINY_LTX2_CONNECTORS_CONFIG)
    torch.manual_seed(seed + 3)
    vae = AutoencoderKLLTX2Video(**TINY_LTX2_VAE_CONFIG).eval()
    torch.manual_seed(seed + 4)
    audio_vae = AutoencoderKLLTX2Audio(**TINY_LTX2_AUDIO_VAE_CONFIG).eval()
    torch.manual_seed(seed + 5)
    vocoder = LTX2Vocoder(**TINY_LTX2_VOCODER_CONFIG).eval()
    torch.manual_seed(seed + 6)
    transformer = LTX2VideoTransformer3DModel(**TINY_LTX2_TRANSFORMER_CONFIG)
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
TINY_MODEL_ENTRIES = {
    "ltx2": TinyModel(
        summary="LTX2Pipeline: Gemma 3, text connectors, AutoencoderKLLTX2Video, AutoencoderKLLTX2Audio, "
        "LTX2Vocoder, LTX2VideoTransformer3DModel (video + audio)",
        layout="Lightricks/LTX-2",
        write=write_tiny_ltx2,
    ),
}
