"""Seeded tiny Kandinsky 5 models in the layout of kandinskylab/Kandinsky-5.0-T2V-Lite-sft-5s-Diffusers
(text-to-video) and kandinskylab/Kandinsky-5.0-I2V-Pro-sft-5s-Diffusers (image-to-video):

    python -m fv_accel.tiny_model DIR --model kandinsky5        # Kandinsky5T2VPipeline
    python -m fv_accel.tiny_model DIR --model kandinsky5_i2v    # Kandinsky5I2VPipeline

Mirrored from the real repos: the `model_index.json` components and classes
(`Qwen2_5_VLForConditionalGeneration` + a Qwen tokenizer, `CLIPTextModel` + `CLIPTokenizer`,
HunyuanVideo's `AutoencoderKLHunyuanVideo`, `Kandinsky5Transformer3DModel`,
`FlowMatchEulerDiscreteScheduler` with shift 5) and every transformer flag the real configs set:
`visual_cond` true (the transformer takes [latent, condition latent, mask] = 2 * 16 + 1 channels),
`attention_type` "regular" (the 5 s checkpoints' dense attention), patch (1, 2, 2), 16 latent
channels in and out, RoPE axes in the real (16, 24, 24) proportions.

- The Qwen tokenizer is word-level over Qwen2's split pattern (as the tiny HunyuanVideo 1.5's), with
  three words of the pipeline's prompt template split in two, so that the template up to the caption
  is exactly the pipeline's `prompt_template_encode_start_idx` (128) tokens, as with the real
  tokenizer: the pipeline's crop keeps the caption's tokens and the closing `<|im_end|>`. The real
  repo saves a `Qwen2VLProcessor` there; its video processor needs torchvision, and the pipeline calls
  only the tokenizer part (`text=`, no images), so the tiny repo saves the tokenizer alone.
- The transformer's modulation layers (zero-initialised in diffusers, trained in the real
  checkpoints) get small random weights: with zeros, every gate is 0 and the text never reaches
  the output.
- The VAE and the CLIP text encoder are the tiny HunyuanVideo's (the real repos ship the same
  classes; `scaling_factor` is 1 / the tiny VAE's latent std).
"""

from __future__ import annotations

from pathlib import Path

import torch

from fv_accel.tiny.model import TINY_VOCAB_WORDS, TinyModel, save_tiny_pipeline

LAYOUT_T2V = "kandinskylab/Kandinsky-5.0-T2V-Lite-sft-5s-Diffusers"
LAYOUT_I2V = "kandinskylab/Kandinsky-5.0-I2V-Pro-sft-5s-Diffusers"
FLOW_SHIFT = 5.0  # the real repos' scheduler shift (FastVideo's Kandinsky 5 flow_shift too)
QWEN_HIDDEN = 32  # tiny Qwen2.5-VL hidden size (the real one: 3584)
# Words of the pipeline's template that the real BPE splits; split here too to reach 128 tokens.
SPLIT_WORDS = r"processing|namism|cren"
TRANSFORMER_CONFIG = dict(
    in_visual_dim=16,
    out_visual_dim=16,
    in_text_dim=QWEN_HIDDEN,
    in_text_dim2=24,  # the tiny CLIP's pooled width (fv_accel.tiny.hunyuan_video.TINY_CLIP_DIM)
    time_dim=16,
    patch_size=(1, 2, 2),
    model_dim=32,
    ff_dim=64,
    num_text_blocks=1,
    num_visual_blocks=2,
    axes_dims=(4, 6, 6),  # head dim 16 (the real (16, 24, 24) sums to 64, Pro's (32, 48, 48) to 128)
    visual_cond=True,
    attention_type="regular",
)


def template_prefix() -> str:
    """The pipeline's prompt template up to the caption."""
    from diffusers import Kandinsky5T2VPipeline

    pipe = Kandinsky5T2VPipeline(None, None, None, None, None, None, None)
    return pipe.prompt_template.split("{}")[0]


def build_qwen_tokenizer():
    """A Qwen-style fast tokenizer: Qwen2's split pattern (then SPLIT_WORDS isolated), one token per
    piece, <|im_start|> / <|im_end|> special, right padding."""
    import regex
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from fv_accel.tiny.hunyuan_video_15 import QWEN_SPECIAL_TOKENS, QWEN_SPLIT_PATTERN

    text = " ".join([template_prefix(), " ".join(TINY_VOCAB_WORDS), ". , \" ' & ; ! ?"]).lower()
    pieces = [p for chunk in regex.findall(QWEN_SPLIT_PATTERN, text) for p in regex.split(f"({SPLIT_WORDS})", chunk) if p]
    pieces += [" " + w for w in TINY_VOCAB_WORDS] + list(TINY_VOCAB_WORDS) + ["\n", " .", " ,", ' "', '"']
    vocab = {tok: i for i, tok in enumerate(QWEN_SPECIAL_TOKENS)}
    for piece in pieces:
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.Split(Regex(SPLIT_WORDS), behavior="isolated"),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=32768,
        padding_side="right",
    )


def build_qwen_text_encoder(vocab_size: int, seed: int):
    """Tiny `Qwen2_5_VLForConditionalGeneration` (the pipeline reads its last hidden state); its
    vision tower is the smallest the config takes (never run: the pipeline passes no images)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=vocab_size,
            hidden_size=QWEN_HIDDEN,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 1, 1]},
            pad_token_id=0,
            bos_token_id=None,
            eos_token_id=2,
        ),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=QWEN_HIDDEN,
                           fullatt_block_indexes=[0]),
    )
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def build_transformer(seed: int):
    """The tiny transformer, its zero-initialised modulation layers drawn small (see the module docstring)."""
    from diffusers import Kandinsky5Transformer3DModel
    from diffusers.models.transformers.transformer_kandinsky import Kandinsky5Modulation

    torch.manual_seed(seed)
    transformer = Kandinsky5Transformer3DModel(**TRANSFORMER_CONFIG)
    for module in transformer.modules():
        if isinstance(module, Kandinsky5Modulation):
            torch.nn.init.normal_(module.out_layer.weight, std=0.05)
            torch.nn.init.normal_(module.out_layer.bias, std=0.05)
    return transformer.eval()


def write_tiny_kandinsky5(out_dir: str | Path, seed: int = 0, *, task: str = "t2v") -> Path:
    """Write the tiny model (`task` t2v: Kandinsky5T2VPipeline, i2v: Kandinsky5I2VPipeline) to
    `out_dir` with the stock pipeline's `save_pretrained`, atomically; deterministic for a seed: the
    Qwen encoder from seed + 1, the VAE seed + 2, the transformer seed + 3, CLIP seed + 4."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Kandinsky5I2VPipeline, Kandinsky5T2VPipeline

    from fv_accel.tiny.hunyuan_video import (
        build_tiny_clip_text,
        build_tiny_clip_tokenizer,
        build_tiny_hunyuan_vae,
        tiny_hunyuan_scaling_factor,
    )

    tokenizer, tokenizer_2 = build_qwen_tokenizer(), build_tiny_clip_tokenizer()
    pipeline_class = Kandinsky5I2VPipeline if task == "i2v" else Kandinsky5T2VPipeline
    pipeline = pipeline_class(
        transformer=build_transformer(seed + 3),
        vae=build_tiny_hunyuan_vae(seed + 2, tiny_hunyuan_scaling_factor(seed + 2)),
        text_encoder=build_qwen_text_encoder(len(tokenizer), seed + 1),
        tokenizer=tokenizer,
        text_encoder_2=build_tiny_clip_text(len(tokenizer_2), seed + 4),
        tokenizer_2=tokenizer_2,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=FLOW_SHIFT),
    )
    return save_tiny_pipeline(pipeline, out_dir, {"tokenizer_2": ["transformers", "CLIPTokenizer"]})


SUMMARY = "Qwen2.5-VL + CLIP text encoders, HunyuanVideo VAE (16 channels, 8x spatial, 4x temporal), visual_cond transformer"
# `python -m fv_accel.tiny_model DIR --model kandinsky5` (fv_accel.tiny.registry)
TINY_MODEL_ENTRIES = {
    "kandinsky5": TinyModel(
        summary=f"Kandinsky5T2VPipeline: {SUMMARY}",
        layout=LAYOUT_T2V,
        write=lambda out, seed: write_tiny_kandinsky5(out, seed),
    ),
    "kandinsky5_i2v": TinyModel(
        summary=f"Kandinsky5I2VPipeline: {SUMMARY}, first frame clean",
        layout=LAYOUT_I2V,
        write=lambda out, seed: write_tiny_kandinsky5(out, seed, task="i2v"),
    ),
}
