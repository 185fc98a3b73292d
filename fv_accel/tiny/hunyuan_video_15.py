"""A seeded tiny HunyuanVideo 1.5 text-to-video model in the Hub layout of
hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v, loadable by the stock `HunyuanVideo15Pipeline`.

Mirrored from the real repo: the component classes and `model_index.json` keys (Qwen2.5-VL text
model + Qwen-style tokenizer with a chat template, ByT5 `T5EncoderModel` + `ByT5Tokenizer`,
`AutoencoderKLHunyuanVideo15` with 32 latent channels, 16x spatial and 4x temporal compression,
`HunyuanVideo15Transformer3DModel` taking [latent (32), condition latent (32), mask (1)] = 65
channels with patch 1, `FlowMatchEulerDiscreteScheduler(shift=5.0)`, `ClassifierFreeGuidance(6.0)`).

The pipeline crops the first 108 tokens of the chat-formatted prompt (the system turn of the real
Qwen tokenizer). The tiny tokenizer splits text with Qwen2's pre-tokenizer pattern and keeps every
piece whole (a word-level vocabulary of those pieces), which makes that system turn exactly 108
tokens too, so the crop keeps the caption's tokens as it does for the real model.

The VAE's `scaling_factor` (the real one is 1.03682) is 1 / std of the tiny VAE's latents over
procedural clips, so that normalised latents have unit scale as the real model's do.
"""

from __future__ import annotations

import functools
import inspect
from pathlib import Path

import torch

from fv_accel.tiny.model import TinyModel, save_tiny_pipeline

LAYOUT = "hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v"
# The real 480p t2v repo's scheduler shift and guidance scale (diffusers' conversion script).
FLOW_SHIFT = 5.0
GUIDANCE_SCALE = 6.0

# Qwen2's pre-tokenizer pattern (how the real tokenizer splits text before BPE).
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
# Qwen2.5-VL's chat format (system turn, user turn, generation prompt).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXT_HIDDEN = 32  # tiny Qwen2.5-VL hidden size (the real one: 3584)
BYT5_HIDDEN = 16  # tiny ByT5 d_model (the real one: 1472)
IMAGE_EMBED_DIM = 16  # SigLIP width the transformer's image projection takes (the real one: 1152)

TRANSFORMER_CONFIG = dict(
    in_channels=65,
    out_channels=32,
    num_attention_heads=2,
    attention_head_dim=16,
    num_layers=2,
    num_refiner_layers=1,
    mlp_ratio=2.0,
    patch_size=1,
    patch_size_t=1,
    qk_norm="rms_norm",
    text_embed_dim=TEXT_HIDDEN,
    text_embed_2_dim=BYT5_HIDDEN,
    image_embed_dim=IMAGE_EMBED_DIM,
    rope_theta=256.0,
    rope_axes_dim=(4, 6, 6),  # sums to attention_head_dim, as (16, 56, 56) does to 128
    target_size=64,
    task_type="t2v",
    use_meanflow=False,
)
# 5 blocks: four 2x spatial downsamples (16x), the last two also 2x in time (4x). The last
# width is a multiple of 2 * latent_channels (the encoder's channel-averaging shortcut).
VAE_CONFIG = dict(
    latent_channels=32,
    block_out_channels=(8, 8, 16, 16, 64),
    layers_per_block=1,
    spatial_compression_ratio=16,
    temporal_compression_ratio=4,
)


def _system_message() -> str:
    from diffusers import HunyuanVideo15Pipeline

    return inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds).parameters["system_message"].default


def build_qwen_tokenizer():
    """A Qwen-style fast tokenizer: Qwen2's split pattern, one token per piece, a chat template,
    right padding (as the real repo's tokenizer is saved)."""
    import regex
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from fv_accel.tiny.model import TINY_VOCAB_WORDS

    text = " ".join(["system\n" + _system_message(), "user\n", "assistant\n", " ".join(TINY_VOCAB_WORDS), ". ,"])
    pieces = regex.findall(QWEN_SPLIT_PATTERN, text.lower())
    pieces += [" " + w for w in TINY_VOCAB_WORDS] + list(TINY_VOCAB_WORDS) + ["system", "user", "assistant", "\n", " .", " ,"]
    vocab = {tok: i for i, tok in enumerate(QWEN_SPECIAL_TOKENS)}
    for piece in pieces:
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=32768,
        padding_side="right",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_text_encoder(vocab_size: int, seed: int):
    """Tiny `Qwen2_5_VLTextModel` (the pipeline reads its third-to-last hidden state: 3 layers)."""
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    torch.manual_seed(seed)
    config = Qwen2_5_VLTextConfig(
        vocab_size=vocab_size,
        hidden_size=TEXT_HIDDEN,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 1, 1]},
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=2,
    )
    return Qwen2_5_VLTextModel(config).eval()


def build_byt5(seed: int):
    """(`ByT5Tokenizer`, tiny `T5EncoderModel` over its 384 byte ids) as the glyph text encoder."""
    from transformers import ByT5Tokenizer, T5Config, T5EncoderModel

    tokenizer = ByT5Tokenizer()
    torch.manual_seed(seed)
    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=BYT5_HIDDEN,
        d_kv=8,
        d_ff=32,
        num_layers=2,
        num_heads=2,
        relative_attention_num_buckets=8,
        feed_forward_proj="gated-gelu",
        is_encoder_decoder=False,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    return tokenizer, T5EncoderModel(config).eval()


def build_vae(seed: int):
    from diffusers import AutoencoderKLHunyuanVideo15

    torch.manual_seed(seed)
    vae = AutoencoderKLHunyuanVideo15(**VAE_CONFIG).eval()
    vae.register_to_config(scaling_factor=_measured_scaling_factor(seed))
    return vae


@functools.lru_cache(maxsize=None)
def _measured_scaling_factor(seed: int) -> float:
    """1 / std of the tiny VAE (drawn from `seed`) latents' posterior mode over procedural clips."""
    from diffusers import AutoencoderKLHunyuanVideo15

    from fv_accel.tiny.clips import clip_batch

    torch.manual_seed(seed)
    vae = AutoencoderKLHunyuanVideo15(**VAE_CONFIG).eval()
    video = clip_batch(8, 123, num_frames=9, height=32, width=32)
    # One clip per call: the VAE's mid-block attention mask (diffusers 0.42.1) broadcasts only for batch 1.
    with torch.no_grad():
        z = torch.cat([vae.encode(clip[None]).latent_dist.mode() for clip in video])
    return round(1.0 / float(z.std().clamp_min(1e-4)), 6)


def write_tiny_hunyuan_video_15(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the tiny model to `out_dir` (deterministic for a seed: the text encoder from seed + 1,
    the VAE seed + 2, the transformer seed + 3, the ByT5 encoder seed + 4) with the stock
    pipeline's `save_pretrained`, atomically; returns the path."""
    from diffusers import (
        ClassifierFreeGuidance,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15Pipeline,
        HunyuanVideo15Transformer3DModel,
    )

    tokenizer = build_qwen_tokenizer()
    text_encoder = build_text_encoder(len(tokenizer), seed + 1)
    vae = build_vae(seed + 2)
    torch.manual_seed(seed + 3)
    transformer = HunyuanVideo15Transformer3DModel(**TRANSFORMER_CONFIG)
    tokenizer_2, text_encoder_2 = build_byt5(seed + 4)
    pipeline = HunyuanVideo15Pipeline(
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=FLOW_SHIFT),
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        guider=ClassifierFreeGuidance(guidance_scale=GUIDANCE_SCALE),
    )
    return save_tiny_pipeline(pipeline, out_dir)


TINY_MODEL_ENTRIES = {
    "hunyuan_video_15": TinyModel(
        summary="HunyuanVideo15Pipeline: Qwen2.5-VL + ByT5 text encoders, 32-channel 16x VAE, 65-channel transformer",
        layout=LAYOUT,
        write=write_tiny_hunyuan_video_15,
    )
}
