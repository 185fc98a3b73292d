"""A tiny Wan model in the Hub layout, seeded, for offline smoke tests of every loading path.

    python -m fv_accel.tiny_model DIR [--seed 0] [--class wan|skyreels_v2]

writes `model_index.json`, `transformer/`, `vae/`, `text_encoder/`, `tokenizer/` and `scheduler/`
as `WanPipeline.from_pretrained(DIR)` expects. The transformer's architecture is the inline
`models.student.transformer_config` of the built-in tiny recipe (the one source of those numbers).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional

import torch

# Words of the tiny captions; the tokenizer's vocabulary (plus the special tokens).
TINY_VOCAB_WORDS = (
    "a an the on of and with moving slowly quickly left right up down across circle square "
    "triangle ball box red green blue yellow white black orange purple cyan background dark "
    "light bright small large frame video shape"
).split()
SPECIAL_TOKENS = ["<pad>", "</s>", "<unk>"]

TINY_TEXT_DIM = 32
TINY_VAE_CONFIG = dict(
    base_dim=8,
    z_dim=16,
    dim_mult=[1, 1, 1, 1],
    num_res_blocks=1,
    temperal_downsample=[False, True, True],
)


def tiny_transformer_config() -> dict:
    from fv_accel.config import default_recipe, load_config

    return dict(load_config(default_recipe("finetune")).models.student.transformer_config)


def build_tiny_tokenizer():
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + list(TINY_VOCAB_WORDS))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace()])
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", vocab["</s>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", model_max_length=512
    )


def build_tiny_text_encoder(vocab_size: int, seed: int):
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    config = UMT5Config(
        vocab_size=vocab_size,
        d_model=TINY_TEXT_DIM,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    return UMT5EncoderModel(config).eval()


def build_tiny_vae(seed: int):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    return AutoencoderKLWan(**TINY_VAE_CONFIG).eval()


def write_tiny_model(out_dir: str | Path, seed: int = 0, model_class: str = "wan", latents_stats: Optional[tuple] = None) -> Path:
    """Write the tiny model folder; returns its path. Deterministic for a given seed."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SkyReelsV2Transformer3DModel, WanTransformer3DModel

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer()
    text_encoder = build_tiny_text_encoder(len(tokenizer), seed + 1)
    vae = build_tiny_vae(seed + 2)
    if latents_stats is None:
        latents_stats = measure_latent_stats(vae)
    vae.register_to_config(latents_mean=latents_stats[0], latents_std=latents_stats[1])
    torch.manual_seed(seed + 3)
    cls = {"wan": WanTransformer3DModel, "skyreels_v2": SkyReelsV2Transformer3DModel}[model_class]
    transformer = cls(**tiny_transformer_config())
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)

    transformer.save_pretrained(out / "transformer", safe_serialization=True)
    vae.save_pretrained(out / "vae", safe_serialization=True)
    text_encoder.save_pretrained(out / "text_encoder", safe_serialization=True)
    tokenizer.save_pretrained(out / "tokenizer")
    scheduler.save_pretrained(out / "scheduler")
    pipeline = "SkyReelsV2DiffusionForcingPipeline" if model_class == "skyreels_v2" else "WanPipeline"
    index = {
        "_class_name": pipeline,
        "_diffusers_version": __import__("diffusers").__version__,
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        "transformer": ["diffusers", cls.__name__],
        "vae": ["diffusers", "AutoencoderKLWan"],
    }
    if model_class == "wan":
        index["transformer_2"] = [None, None]
    (out / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


@torch.no_grad()
def measure_latent_stats(vae) -> tuple[list[float], list[float]]:
    """Per-channel mean/std of the tiny VAE's latents over procedural clips, so that the tiny
    model's `latents_mean`/`latents_std` describe its own latent space (as Wan's do for Wan's)."""
    from fv_accel.tiny.clips import render_clip, tiny_clip_specs

    clips = [render_clip(spec, num_frames=9, height=32, width=32) for spec in tiny_clip_specs(8, seed=123)]
    video = torch.stack([torch.from_numpy(c).permute(3, 0, 1, 2) for c in clips]).float() / 127.5 - 1.0
    z = vae.encode(video).latent_dist.mode()  # [B, C, T, H, W]
    mean = z.mean(dim=(0, 2, 3, 4))
    std = z.std(dim=(0, 2, 3, 4)).clamp_min(1e-4)
    return [round(float(v), 6) for v in mean], [round(float(v), 6) for v in std]


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--class", dest="model_class", choices=["wan", "skyreels_v2"], default="wan")
    args = parser.parse_args(argv)
    path = write_tiny_model(args.out_dir, seed=args.seed, model_class=args.model_class)
    print(f"wrote the tiny {args.model_class} model to {path}")


if __name__ == "__main__":
    main()
