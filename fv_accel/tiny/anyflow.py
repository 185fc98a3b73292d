"""Seeded tiny AnyFlow models in the layout of nvidia/AnyFlow-Wan2.1-T2V-1.3B-Diffusers:

    python -m fv_accel.tiny_model DIR --model anyflow       # AnyFlowPipeline
    python -m fv_accel.tiny_model DIR --model anyflow_far   # AnyFlowFARPipeline (nvidia/AnyFlow-FAR-Wan2.1-1.3B-Diffusers)

Mirrored from the real repo: the `model_index.json` components (UMT5 + its tokenizer, the Wan 2.1
`AutoencoderKLWan`, `AnyFlowTransformer3DModel`, `FlowMapEulerDiscreteScheduler`) and every flag the
real transformer config sets for the flow map: `gate_value` 0.25, `deltatime_type` "r", Wan 2.1's
`cross_attn_norm`, patch (1, 2, 2) and 16 latent channels in and out. The width and depth are the
tiny Wan's (the built-in recipe's inline transformer config), the text encoder, tokenizer and VAE the
tiny Wan 2.1's (seed + 1, seed + 2). The delta embedder is drawn apart from the time embedder (seed
+ 3 for the whole transformer), so that r changes the output as in a trained checkpoint. The
scheduler's shift is 5.0 (`FlowMapEulerDiscreteScheduler`'s documented Wan 2.1 value).

The FAR model (`AnyFlowFARTransformer3DModel`) adds the released FAR flags: `compressed_patch_size`
(1, 4, 4) and `full_chunk_limit` 3; its `chunk_partition` keeps the released shape (a first chunk of
one latent frame, then equal chunks) at the tiny length: (1, 2, 2) for 17 frames (5 latent frames),
where the released (1, 3, 3, 3, 3, 3, 3, 2) is for 81.
"""

from __future__ import annotations

from pathlib import Path

import torch

from fv_accel.tiny.model import TinyModel

LAYOUT = "nvidia/AnyFlow-Wan2.1-T2V-1.3B-Diffusers"
FLOW_SHIFT = 5.0
GATE_VALUE = 0.25
DELTATIME_TYPE = "r"
# Keys of the tiny Wan transformer config that AnyFlowTransformer3DModel takes.
ANYFLOW_KEYS = ("patch_size", "num_attention_heads", "attention_head_dim", "in_channels", "out_channels", "text_dim",
                "freq_dim", "ffn_dim", "num_layers", "cross_attn_norm", "eps", "rope_max_seq_len")


def tiny_anyflow_transformer_config() -> dict:
    from fv_accel.tiny.model import tiny_transformer_config

    wan = tiny_transformer_config()
    config = {k: wan[k] for k in ANYFLOW_KEYS if k in wan}
    config.update(gate_value=GATE_VALUE, deltatime_type=DELTATIME_TYPE)
    return config


FAR_FLAGS = dict(compressed_patch_size=(1, 4, 4), full_chunk_limit=3, chunk_partition=(1, 2, 2))


def write_tiny_anyflow(out_dir: str | Path, seed: int = 0, far: bool = False) -> Path:
    """The tiny AnyFlow T2V repo (`far`: AnyFlow-FAR) written by its pipeline's `save_pretrained` into `out_dir`."""
    from diffusers import (
        AnyFlowFARPipeline,
        AnyFlowFARTransformer3DModel,
        AnyFlowPipeline,
        AnyFlowTransformer3DModel,
        FlowMapEulerDiscreteScheduler,
    )

    from fv_accel.tiny.model import (
        _tiny_vae_latent_stats,
        build_tiny_text_encoder,
        build_tiny_tokenizer,
        build_tiny_vae,
        save_tiny_pipeline,
    )

    tokenizer = build_tiny_tokenizer()
    text_encoder = build_tiny_text_encoder(len(tokenizer), seed + 1)
    vae = build_tiny_vae(seed + 2)
    mean, std = _tiny_vae_latent_stats("wan2.1", seed + 2)
    vae.register_to_config(latents_mean=mean, latents_std=std)
    torch.manual_seed(seed + 3)
    if far:
        transformer = AnyFlowFARTransformer3DModel(**tiny_anyflow_transformer_config(), **FAR_FLAGS)
    else:
        transformer = AnyFlowTransformer3DModel(**tiny_anyflow_transformer_config())
    pipeline = (AnyFlowFARPipeline if far else AnyFlowPipeline)(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
        scheduler=FlowMapEulerDiscreteScheduler(num_train_timesteps=1000, shift=FLOW_SHIFT),
    )
    return save_tiny_pipeline(pipeline, Path(out_dir))


TINY_MODEL_ENTRIES = {
    "anyflow": TinyModel(
        "AnyFlowPipeline, AnyFlowTransformer3DModel (flow map: gate 0.25, deltatime r), FlowMapEulerDiscreteScheduler shift 5",
        LAYOUT,
        write_tiny_anyflow,
    ),
    "anyflow_far": TinyModel(
        "AnyFlowFARPipeline, AnyFlowFARTransformer3DModel (FAR chunks (1, 2, 2), full_chunk_limit 3), FlowMapEulerDiscreteScheduler shift 5",
        "nvidia/AnyFlow-FAR-Wan2.1-1.3B-Diffusers",
        lambda out, seed: write_tiny_anyflow(out, seed, far=True),
    ),
}
