"""A seeded tiny MiniMax-H3 in the layout of MiniMaxAI/MiniMax-H3 (diffusers' conversion,
scripts/convert_minimax_h3_to_diffusers.py), which `MiniMaxH3ModularPipeline` loads:

    python -m fv_accel.tiny_model DIR --model minimax_h3

Mirrored from the conversion: `model_index.json` and `modular_model_index.json` (the same component
map, the modular one with each component's loading spec; `_blocks_class_name` MiniMaxH3Blocks),
`transformer/` (`MiniMaxH3Transformer3DModel` with every flag the conversion writes; the
checkpoint-tied ones kept: 24 video latent channels, 32 audio latent channels, patch (1, 2, 2),
rope_theta, the eps values), `vae/` (`AutoencoderKLMiniMaxH3`: 24 latent channels, clip_length 17,
token_drop 3, so 17 n + 5 frames -> 5 n + 2 latent frames; per-channel latents_mean / latents_std),
`audio_vae/` (`AutoencoderKLMiniMaxH3Audio`: 32 latent channels at 32 kHz, encoder rates
(2, 4, 4, 5, 5): 40 latents per second as the pipeline assumes), `scheduler/` and `audio_scheduler/`
(`MiniMaxH3Scheduler`, shifts 12 and 3), and the Qwen3-VL conditioner
(`Qwen3VLForConditionalGeneration`: 51 decoder layers, since the pipeline reads `hidden_states[50]`),
its tokenizer, and processor/ (the real repo's `Qwen3VLProcessor`) holding the tokenizer alone:
transformers builds no Qwen3VLProcessor without torchvision, and t2va calls only its
`create_mm_token_type_ids` (`fv_accel.models.minimax_h3.TextTokenTypes` stands in: load the modular
pipeline without `processor`, then `pipe.update_components(processor=TextTokenTypes())`).

Shrunk: widths, depths, the VAEs' level counts (the video VAE compresses 4x spatially, 4x in time).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from fv_accel.tiny.model import TinyModel

LAYOUT = "MiniMaxAI/MiniMax-H3"
TEXT_HIDDEN = 32  # the tiny Qwen3-VL width (the real one: 5120)
TEXT_LAYERS = 51  # the pipeline reads hidden_states[50]
VIDEO_SHIFT, AUDIO_SHIFT = 12.0, 3.0  # the conversion's sigma_shift_scales
TRANSFORMER_CONFIG = dict(
    num_attention_heads=2,
    attention_head_dim=16,
    hidden_size=32,
    num_layers=2,
    num_refiner_layers=1,
    ffn_dim=64,
    in_channels=24,
    audio_in_channels=32,
    patch_size=[1, 2, 2],
    text_dim=TEXT_HIDDEN,
    freq_dim=16,
    time_embed_hidden_dim=32,
    time_embed_dim=16,
    rope_freq_dim=2,
    rope_theta=10000.0,
    norm_eps=1e-05,
    qk_norm_eps=1e-05,
    final_norm_eps=1e-05,
)
VAE_CONFIG = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=24,
    block_out_channels=[8, 16],
    layers_per_block=1,
    spatial_downsample_factors=[2, 2],
    temporal_downsample_factors=[2, 2],
    norm_num_groups=4,
    norm_eps=1e-06,
    spatial_padding_mode="reflect",
    decoder_num_layers=1,
    decoder_num_attention_heads=2,
    decoder_attention_head_dim=8,
    decoder_num_register_tokens=4,
    decoder_ffn_mult=4,
    decoder_rope_theta=100.0,
    decoder_rope_dim_ratio=0.75,
    decoder_norm_eps=1e-05,
    clip_length=17,
    token_drop=3,
)
AUDIO_VAE_CONFIG = dict(
    encoder_dim=2,
    encoder_rates=[2, 4, 4, 5, 5],
    latent_dim=32,
    latent_channels=32,
    num_attention_heads=2,
    decoder_dim=128,  # halved at each of the 7 upsampling stages
    decoder_rates=[5, 5, 2, 2, 2, 2, 2],
    decoder_kernel_sizes=[9, 9, 4, 4, 4, 4, 4],
    resblock_kernel_sizes=[3],
    resblock_dilation_sizes=[[1]],
    sampling_rate=32000,
)
COMPONENTS = {
    "text_encoder": ["transformers", "Qwen3VLForConditionalGeneration"],
    # The real repo's Qwen2TokenizerFast is byte-level BPE; the tiny word-level one loads as what it is
    # (transformers 5 would rebuild a Qwen2TokenizerFast as BPE from its vocabulary).
    "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
    "processor": ["transformers", "Qwen3VLProcessor"],
    "vae": ["diffusers", "AutoencoderKLMiniMaxH3"],
    "audio_vae": ["diffusers", "AutoencoderKLMiniMaxH3Audio"],
    "transformer": ["diffusers", "MiniMaxH3Transformer3DModel"],
    "scheduler": ["diffusers", "MiniMaxH3Scheduler"],
    "audio_scheduler": ["diffusers", "MiniMaxH3Scheduler"],
}


def build_text_encoder(vocab_size: int, seed: int):
    """Tiny `Qwen3VLForConditionalGeneration` with TEXT_LAYERS decoder layers; its vision tower is the
    smallest the config takes (never run by t2va)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    torch.manual_seed(seed)
    config = Qwen3VLConfig(
        text_config=dict(
            vocab_size=vocab_size,
            hidden_size=TEXT_HIDDEN,
            intermediate_size=32,
            num_hidden_layers=TEXT_LAYERS,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [4, 2, 2], "mrope_interleaved": True},
            pad_token_id=0,
            bos_token_id=None,
            eos_token_id=2,
        ),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=TEXT_HIDDEN,
                           deepstack_visual_indexes=[0], num_position_embeddings=16, patch_size=16),
    )
    return Qwen3VLForConditionalGeneration(config).eval()


def build_transformer(seed: int):
    from diffusers import MiniMaxH3Transformer3DModel

    torch.manual_seed(seed)
    return MiniMaxH3Transformer3DModel(**TRANSFORMER_CONFIG).eval()


def build_vaes(seed: int) -> tuple:
    """(video VAE, audio VAE), with per-channel latent statistics drawn near the identity."""
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio

    torch.manual_seed(seed)
    stats = lambda n, base: [round(float(v), 4) for v in base + 0.1 * torch.rand(n)]  # noqa: E731
    vae = AutoencoderKLMiniMaxH3(**VAE_CONFIG, latents_mean=stats(24, -0.05), latents_std=stats(24, 0.95))
    audio_vae = AutoencoderKLMiniMaxH3Audio(**AUDIO_VAE_CONFIG, latents_mean=stats(32, -0.05), latents_std=stats(32, 0.95))
    return vae.eval(), audio_vae.eval()


def write_tiny_minimax_h3(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the tiny model to `out_dir` (written beside it, moved in with the indexes last);
    deterministic for a seed: the text encoder from seed + 1, the VAEs seed + 2, the transformer seed + 3."""
    from diffusers import MiniMaxH3Scheduler

    from fv_accel.tiny.kandinsky5 import build_qwen_tokenizer

    out = Path(out_dir).resolve()
    partial = out.parent / f".{out.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    tokenizer = build_qwen_tokenizer()
    vae, audio_vae = build_vaes(seed + 2)
    parts = {
        "text_encoder": build_text_encoder(len(tokenizer), seed + 1),
        "tokenizer": tokenizer,
        "processor": tokenizer,  # see the module docstring
        "vae": vae,
        "audio_vae": audio_vae,
        "transformer": build_transformer(seed + 3),
        "scheduler": MiniMaxH3Scheduler(shift=VIDEO_SHIFT),
        "audio_scheduler": MiniMaxH3Scheduler(shift=AUDIO_SHIFT),
    }
    for name, part in parts.items():
        part.save_pretrained(partial / name)
    write_indexes(partial, out)
    out.mkdir(parents=True, exist_ok=True)
    for child in sorted(partial.iterdir(), key=lambda p: p.name.endswith("model_index.json")):
        target = out / child.name
        if target.is_dir():
            shutil.rmtree(target)
        child.replace(target)
    partial.rmdir()
    return out


def write_indexes(folder: Path, repo: Path) -> None:
    """model_index.json and modular_model_index.json as the conversion writes them, the modular
    one's components loading from `repo` (the folder's final place)."""
    from diffusers import __version__

    index = {"_class_name": "MiniMaxH3Pipeline", "_diffusers_version": __version__, **COMPONENTS}
    (folder / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    modular = {"_class_name": "MiniMaxH3ModularPipeline", "_diffusers_version": __version__, "_blocks_class_name": "MiniMaxH3Blocks"}
    for name, (library, class_name) in COMPONENTS.items():
        spec = {"type_hint": [library, class_name], "pretrained_model_name_or_path": str(repo), "subfolder": name,
                "variant": None, "revision": None}
        modular[name] = [library, class_name, spec]
    (folder / "modular_model_index.json").write_text(json.dumps(modular, indent=2) + "\n")


# `python -m fv_accel.tiny_model DIR --model minimax_h3` (fv_accel.tiny.registry)
TINY_MODEL_ENTRIES = {
    "minimax_h3": TinyModel(
        summary="MiniMaxH3ModularPipeline (t2va): Qwen3-VL text encoder, 24-channel video VAE, 32 kHz audio VAE, "
        "video + audio transformer",
        layout=LAYOUT,
        write=lambda out, seed: write_tiny_minimax_h3(out, seed),
    ),
}
