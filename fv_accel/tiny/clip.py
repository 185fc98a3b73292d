"""A tiny CLIP in the Hub layout, the stand-in for the reward models' checkpoints in tests.

`write_tiny_clip(folder, kind)` writes what a real CLIP repo holds, built from configs with seeded
random weights: `config.json` and `model.safetensors` of a `CLIPModel`, `preprocessor_config.json`
of a `CLIPImageProcessor` and the tokenizer files (`vocab.json`, `merges.txt`, `tokenizer.json`,
`tokenizer_config.json`). `AutoModel`, `CLIPModel`, `AutoProcessor` and `CLIPProcessor` load it with
`from_pretrained` exactly as they load `yuvalkirstain/PickScore_v1` (kind "pickscore", which carries
its own processor here, where the real one borrows `laion/CLIP-ViT-H-14-laion2B-s32B-b79K`'s) or
`openai/clip-vit-large-patch14` (kind "clip").

The tokenizer is CLIP's: a byte-level BPE whose vocabulary is the 256 byte symbols, the same with
the end-of-word mark `</w>`, the products of its merges (learnt by the `tokenizers` library's
trainer from the tiny world's caption words) and `<|startoftext|>` / `<|endoftext|>` last.
The image processor is saved as `CLIPImageProcessor` (as real repos name it); transformers picks
its PIL backend where torchvision is absent.
"""

from __future__ import annotations

import json
from pathlib import Path

KINDS = ("pickscore", "clip")
IMAGE_SIZE = 32
MAX_TEXT_TOKENS = 77  # CLIP's context length (the rewards truncate prompts to it)
# What tells the two kinds apart, after the real checkpoints: PickScore is a fine-tuned LAION
# ViT-H (gelu, a learnt logit scale near ln 100), OpenAI's ViT-L uses quick_gelu.
_KIND_SETTINGS = {
    "pickscore": {"hidden_act": "gelu", "logit_scale_init_value": 4.6052, "seed": 1},
    "clip": {"hidden_act": "quick_gelu", "logit_scale_init_value": 2.6592, "seed": 2},
}
_BOS, _EOS = "<|startoftext|>", "<|endoftext|>"


def write_tiny_clip(folder: str | Path, kind: str = "pickscore") -> Path:
    """Write the tiny CLIP `kind` ("pickscore" | "clip") into `folder` (created); returns it."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {', '.join(KINDS)}, got {kind!r}")
    from transformers import CLIPTokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab, merges = _tiny_bpe()
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    # Read back from vocab.json / merges.txt, as CLIPTokenizer reads a repo's, then saved in full
    # (tokenizer.json, tokenizer_config.json) as the Hub repos are.
    tokenizer = CLIPTokenizer.from_pretrained(str(folder), model_max_length=MAX_TEXT_TOKENS)
    tokenizer.save_pretrained(str(folder))
    _tiny_image_processor().save_pretrained(str(folder))
    _tiny_clip_model(kind, tokenizer).save_pretrained(str(folder))
    return folder


def _tiny_bpe() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """(vocab, merges) of CLIP's byte-level BPE, its merges learnt from the tiny captions' words."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from fv_accel.tiny.clips import BACKGROUNDS, COLORS, MOTIONS, SHAPES

    learner = Tokenizer(models.BPE(continuing_subword_prefix="", end_of_word_suffix="</w>", unk_token=_EOS))
    learner.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Lowercase()])
    learner.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"), behavior="removed", invert=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    words = [*COLORS, *BACKGROUNDS, *SHAPES, *MOTIONS, "a", "moving", "on", "background", "photo", "of", "the"]
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), end_of_word_suffix="</w>", show_progress=False
    )
    learner.train_from_iterator([" ".join(words)] * 2, trainer)
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in json.loads(learner.to_str())["model"]["merges"]]
    symbols = list(bytes_to_unicode().values())
    vocab = {s: i for i, s in enumerate(symbols)}
    vocab.update({s + "</w>": len(symbols) + i for i, s in enumerate(symbols)})
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    vocab[_BOS] = len(vocab)
    vocab[_EOS] = len(vocab)
    return vocab, merges


def _tiny_image_processor():
    """CLIP's image processing (bicubic resize of the short side, centre crop, CLIP's mean/std) at
    IMAGE_SIZE; the PIL backend, which needs no torchvision, saved under CLIPImageProcessor's name."""
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    return CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )


def _tiny_clip_model(kind: str, tokenizer):
    """A `CLIPModel` from a tiny `CLIPConfig` (hidden 32, 2 layers, 2 heads, 32-pixel images in
    8-pixel patches, 16-wide projection), its weights drawn from the kind's seed."""
    import torch
    from transformers import CLIPConfig, CLIPModel

    settings = _KIND_SETTINGS[kind]
    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  hidden_act=settings["hidden_act"])
    config = CLIPConfig(
        text_config=dict(
            common, vocab_size=len(tokenizer), max_position_embeddings=MAX_TEXT_TOKENS,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        ),
        vision_config=dict(common, image_size=IMAGE_SIZE, patch_size=8),
        projection_dim=16,
        logit_scale_init_value=settings["logit_scale_init_value"],
    )
    with torch.random.fork_rng(devices=[]):  # seeded weights, the caller's random state untouched
        torch.manual_seed(settings["seed"])
        return CLIPModel(config).eval()
