"""A seeded tiny Cosmos-Predict2 Video2World model in the Hub layout (nvidia/Cosmos-Predict2-2B-Video2World).

    python -m fv_accel.tiny_model DIR --model cosmos2

What it mirrors of the real repo: `Cosmos2VideoToWorldPipeline` with a T5 encoder and its fast
tokenizer, the Wan 2.1 VAE (`AutoencoderKLWan`, 16 latent channels, 8x spatial, 4x temporal),
a `CosmosTransformer3DModel` taking the 16 latent channels plus the condition-mask channel
(`in_channels` 17) and the padding mask (`concat_padding_mask`), patch (1, 2, 2), no learnable
positional embedding and the 2B model's RoPE scale (1, 3, 3), and the scheduler diffusers'
conversion script writes (`FlowMatchEulerDiscreteScheduler(use_karras_sigmas=True)`), to which
the pipeline's constructor adds `sigma_max` 80, `sigma_min` 0.002, `sigma_data` 1.0 and
`final_sigmas_type` "sigma_min". Widths and depths are toy sizes.

The repo stores no safety checker (`"safety_checker": [null, null]` in model_index.json): the
pipeline's constructor then builds cosmos_guardrail's `CosmosSafetyChecker`, which is not
installable here, so the stock pipeline is loaded with
`Cosmos2VideoToWorldPipeline.from_pretrained(DIR, safety_checker=...)` and a stand-in
(fv_accel.models.cosmos2.PassThroughSafetyChecker, which checks nothing).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from fv_accel.tiny.model import TinyModel, build_tiny_text_encoder, build_tiny_tokenizer, build_tiny_vae, measure_latent_stats, save_tiny_pipeline

TINY_COSMOS2_TEXT_DIM = 32
TINY_COSMOS2_TRANSFORMER_CONFIG = dict(
    in_channels=16 + 1,  # latent channels + the condition-mask channel (Video2World)
    out_channels=16,
    num_attention_heads=2,
    attention_head_dim=24,
    num_layers=2,
    mlp_ratio=2.0,
    text_embed_dim=TINY_COSMOS2_TEXT_DIM,
    adaln_lora_dim=16,
    patch_size=(1, 2, 2),
    rope_scale=(1.0, 3.0, 3.0),
    concat_padding_mask=True,
    extra_pos_embed_type=None,
)
LAYOUT = "nvidia/Cosmos-Predict2-2B-Video2World"
SUMMARY = (
    "Cosmos2VideoToWorldPipeline: T5 text encoder, Wan 2.1 VAE, 17-channel CosmosTransformer3DModel "
    "(latent + condition mask), EDM-preconditioned flow scheduler"
)


class _NoSafetyChecker:
    """Given to the pipeline's constructor only to stop it building cosmos_guardrail's checker;
    unregistered (None) before the folder is written."""


def write_tiny_cosmos2(out_dir: str | Path, seed: int = 0, latents_stats: Optional[tuple] = None) -> Path:
    """Write the tiny Cosmos-Predict2 Video2World model to `out_dir`; returns its path.

    Deterministic for a given seed: the tokenizer, the text encoder (seed + 1), the VAE (seed + 2,
    the tiny Wan 2.1 VAE of fv_accel.tiny.model with its measured latent statistics) and the
    transformer (seed + 3). Written by the stock pipeline's `save_pretrained`.
    """
    from diffusers import Cosmos2VideoToWorldPipeline, CosmosTransformer3DModel, FlowMatchEulerDiscreteScheduler

    out = Path(out_dir)
    tokenizer = build_tiny_tokenizer()
    text_encoder = build_tiny_text_encoder(len(tokenizer), seed + 1, t5=True, d_model=TINY_COSMOS2_TEXT_DIM)
    vae = build_tiny_vae(seed + 2, "wan2.1")
    if latents_stats is None:
        latents_stats = measure_latent_stats(vae)
    vae.register_to_config(latents_mean=latents_stats[0], latents_std=latents_stats[1])
    torch.manual_seed(seed + 3)
    transformer = CosmosTransformer3DModel(**TINY_COSMOS2_TRANSFORMER_CONFIG)
    pipeline = Cosmos2VideoToWorldPipeline(
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(use_karras_sigmas=True),
        safety_checker=_NoSafetyChecker(),
    )
    # An optional component registered as None is left out of the folder and recorded as
    # [null, null] in model_index.json.
    pipeline.register_modules(safety_checker=None)
    return save_tiny_pipeline(pipeline, out, {"tokenizer": ["transformers", "PreTrainedTokenizerFast"]})


# `python -m fv_accel.tiny_model DIR --model cosmos2` (fv_accel.tiny.registry).
TINY_MODEL_ENTRIES = {"cosmos2": TinyModel(SUMMARY, LAYOUT, write_tiny_cosmos2)}
