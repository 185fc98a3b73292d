"""A seeded tiny HunyuanVideo model in the layout of hunyuanvideo-community/HunyuanVideo.

    python -m fv_accel.tiny_model DIR --model hunyuan_video

Same `model_index.json` components and classes as the real repo (HunyuanVideoPipeline:
`LlamaModel` + `LlamaTokenizerFast`, `CLIPTextModel` + `CLIPTokenizer`, `AutoencoderKLHunyuanVideo`
(8x spatial, 4x temporal, 16 latent channels), `HunyuanVideoTransformer3DModel` with the guidance
embedding, `FlowMatchEulerDiscreteScheduler` with shift 7), at toy sizes, so that the stock pipeline
runs on it with its own defaults:

- the Llama tokenizer is a Llama-style BPE whose merges are chosen so that the pipeline's prompt
  template up to the caption is exactly `crop_start` (95) tokens, bos included, as with the real
  Llama 3 tokenizer: the pipeline's crop leaves the caption's tokens and the closing `<|eot_id|>`;
- the Llama model has 3 layers, so the pipeline's hidden state (`hidden_states[-3]`, two layers
  skipped) is the output of its first layer;
- the CLIP tokenizer is a byte-level BPE that knows the tiny caption words (pad = eos, as CLIP's);
- the VAE's `scaling_factor` is 1 / the tiny VAE's latent std over procedural clips (the real one,
  0.476986, is the real VAE's), so normalised latents are about unit-scale as in the real model.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Optional

import torch

from fv_accel.tiny.model import TINY_VOCAB_WORDS, TinyModel, save_tiny_pipeline

TINY_HUNYUAN_LAYOUT = "hunyuanvideo-community/HunyuanVideo"
TINY_LLAMA_DIM = 32
TINY_CLIP_DIM = 24  # the pooled projection width (768 in the real CLIP-L)
# Two dual-stream and one single-stream block; head dim 16 split (4, 6, 6) over (t, h, w) by RoPE.
TINY_TRANSFORMER_CONFIG = dict(
    in_channels=16,
    out_channels=16,
    num_attention_heads=2,
    attention_head_dim=16,
    num_layers=1,
    num_single_layers=1,
    num_refiner_layers=1,
    mlp_ratio=2.0,
    patch_size=2,
    patch_size_t=1,
    qk_norm="rms_norm",
    guidance_embeds=True,
    text_embed_dim=TINY_LLAMA_DIM,
    pooled_projection_dim=TINY_CLIP_DIM,
    rope_theta=256.0,
    rope_axes_dim=(4, 6, 6),
)
TINY_HUNYUAN_VAE_CONFIG = dict(
    latent_channels=16,
    block_out_channels=(8, 8, 16, 16),
    layers_per_block=1,
    norm_num_groups=4,
    spatial_compression_ratio=8,
    temporal_compression_ratio=4,
    mid_block_add_attention=True,
)
TINY_HUNYUAN_SHIFT = 7.0  # the real repo's scheduler_config.json shift

LLAMA_SPECIAL = ["<unk>", "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CLIP_BOS, CLIP_EOS = "<|startoftext|>", "<|endoftext|>"


def _template_parts() -> tuple[str, int]:
    """(the pipeline's prompt template up to the caption, its crop_start)."""
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

    prefix = DEFAULT_PROMPT_TEMPLATE["template"].split("{}")[0]
    return prefix, int(DEFAULT_PROMPT_TEMPLATE["crop_start"])


def _llama_tokenizer(vocab: dict, merges: list):
    from transformers import LlamaTokenizerFast

    tok = LlamaTokenizerFast(
        vocab=dict(vocab),
        merges=list(merges),
        unk_token="<unk>",
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
        pad_token="<|end_of_text|>",
        add_bos_token=True,
        padding_side="right",  # the pipeline crops from the left and masks from the right
        model_max_length=1024,
    )
    tok.add_tokens(LLAMA_SPECIAL[3:], special_tokens=True)
    return tok


def _pair_counts(tokens: list[str]) -> dict[tuple[str, str], int]:
    """Non-overlapping occurrences of each adjacent pair (what a last-ranked BPE merge removes)."""
    counts: dict[tuple[str, str], int] = {}
    last: dict[tuple[str, str], int] = {}
    for i in range(len(tokens) - 1):
        pair = (tokens[i], tokens[i + 1])
        if pair[0] in LLAMA_SPECIAL or pair[1] in LLAMA_SPECIAL:
            continue
        if last.get(pair, -2) == i - 1:  # overlaps the previous occurrence ("a a a")
            continue
        last[pair] = i
        counts[pair] = counts.get(pair, 0) + 1
    return counts


def _apply_last_merge(tokens: list[str], left: str, right: str) -> list[str]:
    """The tokens after a BPE merge ranked last: its pair merged left to right, without overlaps."""
    out: list[str] = []
    i = 0
    while i < len(tokens):
        if i + 1 < len(tokens) and tokens[i] == left and tokens[i + 1] == right:
            out.append(left + right)
            i += 2
        else:
            out.append(tokens[i])
            i += 1
    return out


@functools.lru_cache(maxsize=1)
def tiny_llama_vocab() -> tuple[dict, tuple]:
    """The tiny Llama tokenizer's (vocab, merges): characters, byte fallback, the tiny caption words
    as one token each ("▁word"), and merges over the template until its prefix is crop_start tokens."""
    prefix, crop_start = _template_parts()
    words = list(TINY_VOCAB_WORDS)
    vocab: dict[str, int] = {tok: i for i, tok in enumerate(LLAMA_SPECIAL)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    text_chars = sorted(set(prefix.replace(" ", "▁")) | set("▁" + "".join(words)))
    for ch in text_chars:
        if ch not in vocab:
            vocab[ch] = len(vocab)
    merges: list[tuple[str, str]] = []

    def add_word(word: str) -> None:  # merges building `word` left to right
        for i in range(2, len(word) + 1):
            left, right = word[: i - 1], word[i - 1]
            merged = left + right
            if merged not in vocab:
                vocab[merged] = len(vocab)
                merges.append((left, right))

    for w in words:
        add_word("▁" + w)
        add_word(w)  # a caption's first word follows "\n\n" without a space
    # The template's words, numbers and punctuation marks as one token each, "\n\n" as one.
    add_word("\n\n")
    for piece in re.findall(r"▁?[A-Za-z]+|▁?[0-9]+|▁?[^A-Za-z0-9▁\n]", prefix.replace(" ", "▁")):
        add_word(piece)

    def prefix_tokens() -> list[str]:
        tok = _llama_tokenizer(vocab, merges)
        return tok.convert_ids_to_tokens(tok(prefix).input_ids)

    tokens = prefix_tokens()
    while len(tokens) > crop_start:
        excess = len(tokens) - crop_start
        counts = _pair_counts(tokens)
        # The shortest merge of template tokens that does not overshoot (newlines stay alone).
        candidates = sorted(
            ((c, p) for p, c in counts.items() if c <= excess and "\n" not in p[0] + p[1]),
            key=lambda cp: (len(cp[1][0] + cp[1][1]), -cp[0], cp[1]),
        )
        if not candidates:
            raise RuntimeError("no merge brings the template prefix to crop_start tokens")
        _, (left, right) = candidates[0]
        vocab.setdefault(left + right, len(vocab))
        merges.append((left, right))
        tokens = _apply_last_merge(tokens, left, right)
    tokens = prefix_tokens()  # the real tokenizer agrees
    if len(tokens) != crop_start:
        raise RuntimeError(f"the template prefix is {len(tokens)} tokens, expected {crop_start}")
    return vocab, tuple(merges)


def build_tiny_llama_tokenizer():
    vocab, merges = tiny_llama_vocab()
    return _llama_tokenizer(vocab, list(merges))


def build_tiny_clip_tokenizer():
    """A CLIP byte-level BPE knowing the tiny caption words ("word</w>"); pad = eos, as CLIP's."""
    from transformers import CLIPTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab: dict[str, int] = {CLIP_BOS: 0, CLIP_EOS: 1}
    for ch in bytes_to_unicode().values():
        vocab.setdefault(ch, len(vocab))
        vocab.setdefault(ch + "</w>", len(vocab))
    merges: list[tuple[str, str]] = []
    for word in TINY_VOCAB_WORDS:
        pieces = list(word[:-1]) + [word[-1] + "</w>"]
        current = pieces[0]
        for piece in pieces[1:]:
            merged = current + piece
            if merged not in vocab:
                vocab[merged] = len(vocab)
                merges.append((current, piece))
            current = merged
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)


def build_tiny_llama(vocab_size: int, seed: int):
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=TINY_LLAMA_DIM,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    return LlamaModel(config).eval()


def build_tiny_clip_text(vocab_size: int, seed: int):
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(seed)
    config = CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=TINY_CLIP_DIM,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=77,
        projection_dim=TINY_CLIP_DIM,
        bos_token_id=0,
        eos_token_id=1,  # the pooled output is the first eos token's state
        pad_token_id=1,
    )
    return CLIPTextModel(config).eval()


def build_tiny_hunyuan_vae(seed: int, scaling_factor: Optional[float] = None):
    from diffusers import AutoencoderKLHunyuanVideo

    torch.manual_seed(seed)
    vae = AutoencoderKLHunyuanVideo(**TINY_HUNYUAN_VAE_CONFIG).eval()
    if scaling_factor is not None:
        vae.register_to_config(scaling_factor=scaling_factor)
    return vae


@functools.lru_cache(maxsize=None)
def tiny_hunyuan_scaling_factor(seed: int) -> float:
    """1 / the tiny VAE's latent std over procedural clips (all channels together, as the real
    scaling_factor is one number)."""
    from fv_accel.tiny.model import measure_latent_stats

    _, std = measure_latent_stats(build_tiny_hunyuan_vae(seed))
    return round(1.0 / (sum(s * s for s in std) / len(std)) ** 0.5, 6)


def write_tiny_hunyuan_video(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the tiny HunyuanVideo model to `out_dir`; returns its path.

    Deterministic for a given seed: the Llama text encoder (seed + 1), the VAE (seed + 2), the
    transformer (seed + 3) and the CLIP text encoder (seed + 4), each from its own seed. Written by
    the stock pipeline's `save_pretrained`, beside `out_dir` first, `model_index.json` moved in last.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, HunyuanVideoPipeline, HunyuanVideoTransformer3DModel

    out = Path(out_dir)
    tokenizer = build_tiny_llama_tokenizer()
    tokenizer_2 = build_tiny_clip_tokenizer()
    text_encoder = build_tiny_llama(len(tokenizer), seed + 1)
    vae = build_tiny_hunyuan_vae(seed + 2, tiny_hunyuan_scaling_factor(seed + 2))
    torch.manual_seed(seed + 3)
    transformer = HunyuanVideoTransformer3DModel(**TINY_TRANSFORMER_CONFIG)
    text_encoder_2 = build_tiny_clip_text(len(tokenizer_2), seed + 4)
    pipeline = HunyuanVideoPipeline(
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=TINY_HUNYUAN_SHIFT),
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
    )
    return save_tiny_pipeline(pipeline, out, {"tokenizer": ["transformers", "LlamaTokenizerFast"], "tokenizer_2": ["transformers", "CLIPTokenizer"]})


# `python -m fv_accel.tiny_model DIR --model hunyuan_video` (fv_accel.tiny.registry)
TINY_MODEL_ENTRIES = {
    "hunyuan_video": TinyModel(
        summary="HunyuanVideoPipeline: Llama + CLIP text encoders, guidance-embedding transformer, HunyuanVideo VAE "
        "(16 channels, 8x spatial, 4x temporal)",
        layout=TINY_HUNYUAN_LAYOUT,
        write=lambda out, seed: write_tiny_hunyuan_video(out, seed=seed),
    )
}
