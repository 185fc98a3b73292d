"""Seeded tiny models of every supported Wan variant, in the Hub layout, for offline tests (the
other families' tiny models live beside this file, one file each; `python -m fv_accel.tiny_model`
writes any of them).

Each variant mirrors the layout of a real diffusers repo at toy sizes: the same `model_index.json`
keys and component classes, the same transformer channel counts and conditioning (image
cross-attention, two experts and their `boundary_ratio`, `expand_timesteps`), the same VAE
geometry (the Wan 2.2 VAE: 48 latent channels, 16x spatial). The stock pipeline of the repo loads
the folder with `DiffusionPipeline.from_pretrained(DIR)`. The Wan 2.1 VAE's weights are set in
closed form from its seed so that it reconstructs the tiny clips (fv_accel.tiny.vae); the Wan 2.2
VAE is randomly initialised. The transformer's width and depth are those of the inline `models.student.transformer_config` of the built-in tiny recipe (the one
source of those numbers); each VAE's `latents_mean`/`latents_std` are measured on procedural clips.
"""

from __future__ import annotations

import functools
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

# Words of the tiny captions; the tokenizer's vocabulary (plus the special tokens).
TINY_VOCAB_WORDS = (
    "a an the on of and with moving slowly quickly left right up down across circle square "
    "triangle ball box red green blue yellow white black orange purple cyan background dark "
    "light bright small large frame video shape"
).split()
SPECIAL_TOKENS = ["<pad>", "</s>", "<unk>"]

TINY_TEXT_DIM = 32
# The Wan 2.1 VAE (Wan 2.1 models, Wan 2.2 A14B, SkyReels-V2): 16 latent channels, 8x spatial.
TINY_VAE_CONFIG = dict(
    base_dim=8,
    z_dim=16,
    dim_mult=[1, 1, 1, 1],
    num_res_blocks=1,
    temperal_downsample=[False, True, True],
)
# The Wan 2.2 VAE (Wan2.2-TI2V-5B): pixels are patchified 2x2 (12 input channels), residual
# blocks, 48 latent channels, 16x spatial; the decoder is wider than the encoder, as in the real one.
TINY_VAE22_CONFIG = dict(
    base_dim=8,
    decoder_base_dim=12,
    z_dim=48,
    in_channels=12,
    out_channels=12,
    is_residual=True,
    patch_size=2,
    dim_mult=[1, 1, 1, 1],
    num_res_blocks=1,
    temperal_downsample=[False, True, True],
    scale_factor_spatial=16,
    scale_factor_temporal=4,
)
# Wan 2.1 I2V's image encoder is a CLIP ViT-H/14 vision tower (224 px, 257 tokens of 1280); this
# one sees 32 px in 8 px patches: 17 tokens of 16.
TINY_CLIP_VISION_CONFIG = dict(
    hidden_size=16,
    intermediate_size=32,
    projection_dim=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=32,
    patch_size=8,
)


@dataclass(frozen=True)
class TinyVariant:
    """What one tiny model mirrors of its real repo."""

    name: str
    layout: str  # the real repo whose layout it mirrors
    summary: str  # one line for `--list`
    pipeline: str  # model_index.json `_class_name`
    transformer_class: str = "WanTransformer3DModel"
    vae: str = "wan2.1"  # "wan2.1" (16 channels, 8x) or "wan2.2" (48 channels, 16x)
    in_channels: int = 16
    out_channels: int = 16
    image_encoder: bool = False  # CLIP vision tower + image cross-attention (Wan 2.1 I2V)
    two_transformers: bool = False  # `transformer` (high noise) + `transformer_2` (low noise)
    boundary_ratio: Optional[float] = None
    expand_timesteps: bool = False
    # The real repo's scheduler: UniPCMultistepScheduler with flow sigmas at `flow_shift` (see
    # `build_scheduler` for where each value comes from).
    flow_shift: float = 3.0
    # Transformer config flags the real checkpoint sets (from diffusers' conversion script of the repo).
    transformer_flags: tuple[tuple[str, object], ...] = ()

    def transformer_config(self) -> dict:
        config = tiny_transformer_config()
        config.update(in_channels=self.in_channels, out_channels=self.out_channels, **dict(self.transformer_flags))
        if self.image_encoder:
            # As in Wan2.1-I2V-14B: image_dim is the CLIP width, added_kv_proj_dim the transformer's.
            config.update(
                image_dim=TINY_CLIP_VISION_CONFIG["hidden_size"],
                added_kv_proj_dim=config["num_attention_heads"] * config["attention_head_dim"],
            )
        return config


TINY_MODELS: dict[str, TinyVariant] = {
    v.name: v
    for v in (
        TinyVariant(
            "wan21_t2v",
            "Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
            "WanPipeline, one 16-channel transformer (the default)",
            "WanPipeline",
        ),
        TinyVariant(
            "wan21_i2v",
            "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers",
            "WanImageToVideoPipeline, 36-channel transformer with image cross-attention, CLIP vision image encoder",
            "WanImageToVideoPipeline",
            in_channels=36,
            image_encoder=True,
        ),
        TinyVariant(
            "wan22_ti2v",
            "Wan-AI/Wan2.2-TI2V-5B-Diffusers",
            "WanPipeline with expand_timesteps, Wan 2.2 VAE (48 channels, 16x spatial), 48-channel transformer",
            "WanPipeline",
            vae="wan2.2",
            in_channels=48,
            out_channels=48,
            expand_timesteps=True,
            flow_shift=5.0,
        ),
        TinyVariant(
            "wan22_t2v_a14b",
            "Wan-AI/Wan2.2-T2V-A14B-Diffusers",
            "WanPipeline, transformer + transformer_2 (16 channels), boundary_ratio 0.875",
            "WanPipeline",
            two_transformers=True,
            boundary_ratio=0.875,
        ),
        TinyVariant(
            "wan22_i2v_a14b",
            "Wan-AI/Wan2.2-I2V-A14B-Diffusers",
            "WanImageToVideoPipeline, two 36-channel transformers, boundary_ratio 0.9, no image encoder",
            "WanImageToVideoPipeline",
            in_channels=36,
            two_transformers=True,
            boundary_ratio=0.9,
        ),
        TinyVariant(
            "skyreels_v2",
            "Skywork/SkyReels-V2-DF-1.3B-540P-Diffusers",
            "SkyReelsV2DiffusionForcingPipeline, one 16-channel SkyReels-V2 transformer",
            "SkyReelsV2DiffusionForcingPipeline",
            transformer_class="SkyReelsV2Transformer3DModel",
            flow_shift=8.0,
            # scripts/convert_skyreelsv2_to_diffusers.py, SkyReels-V2-DF-1.3B-540P: the fps embedding.
            transformer_flags=(("inject_sample_info", True),),
        ),
    )
}
DEFAULT_TINY_MODEL = "wan21_t2v"
# `--class` / `write_tiny_model(model_class=...)`: the names before there were variants.
MODEL_CLASS_ALIASES = {"wan": "wan21_t2v", "skyreels_v2": "skyreels_v2"}


def tiny_variant(name: str) -> TinyVariant:
    if name not in TINY_MODELS:
        raise ValueError(f"unknown tiny model {name!r}; known: {', '.join(TINY_MODELS)}")
    return TINY_MODELS[name]


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


def build_tiny_text_encoder(vocab_size: int, seed: int, *, t5: bool = False, **config_overrides):
    """A seeded tiny T5-family text encoder: UMT5 (Wan's), or with `t5` a T5EncoderModel (LTX-Video,
    Cosmos); `config_overrides` change its config (e.g. feed_forward_proj="gated-gelu", T5 v1.1)."""
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    config_class, model_class = (T5Config, T5EncoderModel) if t5 else (UMT5Config, UMT5EncoderModel)
    config = config_class(
        **{
            **dict(
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
            ),
            **config_overrides,
        }
    )
    return model_class(config).eval()


def build_tiny_vae(seed: int, kind: str = "wan2.1"):
    """The tiny VAE `kind` from `seed`: the Wan 2.1 one with the closed-form weights that
    reconstruct the tiny clips (fv_accel.tiny.vae), the Wan 2.2 one randomly initialised."""
    from diffusers import AutoencoderKLWan

    config = {"wan2.1": TINY_VAE_CONFIG, "wan2.2": TINY_VAE22_CONFIG}[kind]
    torch.manual_seed(seed)
    vae = AutoencoderKLWan(**config).eval()
    if kind == "wan2.1":
        from fv_accel.tiny.vae import set_reconstructing_weights

        set_reconstructing_weights(vae, seed)
    return vae


def build_tiny_image_encoder(seed: int):
    """(CLIPVisionModel, CLIPImageProcessor) as Wan 2.1 I2V's `image_encoder` / `image_processor`."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(seed)
    encoder = CLIPVisionModel(CLIPVisionConfig(**TINY_CLIP_VISION_CONFIG)).eval()
    side = TINY_CLIP_VISION_CONFIG["image_size"]
    processor = CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    return encoder, processor


def build_scheduler(variant: TinyVariant):
    """The scheduler of the real repo the variant mirrors, with the keys its scheduler_config.json
    sets: diffusers' Wan conversion script (scripts/convert_wan_to_diffusers.py) writes
    `UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
    num_train_timesteps=1000, flow_shift=...)` with flow_shift 5.0 for TI2V, 3.0 for the Wan 2.1
    T2V/I2V and Wan 2.2 A14B repos. SkyReels-V2 DF ships the same class; its flow_shift 8.0 is the
    one diffusers' SkyReels-V2 documentation sets for text-to-video."""
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=variant.flow_shift
    )


def write_tiny_variant(
    out_dir: str | Path,
    name: str = DEFAULT_TINY_MODEL,
    seed: int = 0,
    latents_stats: Optional[tuple] = None,
) -> Path:
    """Write the tiny model `name` (a key of TINY_MODELS) to `out_dir`; returns its path.

    Deterministic for a given seed: the tokenizer, then the text encoder (seed + 1), the VAE
    (seed + 2), the transformer (seed + 3), `transformer_2` (seed + 4) and the image encoder
    (seed + 5), each drawn from its own seed. The folder is written by the stock pipeline's
    `save_pretrained`, so `model_index.json` holds exactly the keys that pipeline reads.
    """
    import diffusers

    variant = tiny_variant(name)
    out = Path(out_dir)
    tokenizer = build_tiny_tokenizer()
    text_encoder = build_tiny_text_encoder(len(tokenizer), seed + 1)
    vae = build_tiny_vae(seed + 2, variant.vae)
    if latents_stats is None:
        latents_stats = _tiny_vae_latent_stats(variant.vae, seed + 2)
    vae.register_to_config(latents_mean=latents_stats[0], latents_std=latents_stats[1])
    transformer_cls = getattr(diffusers, variant.transformer_class)
    torch.manual_seed(seed + 3)
    transformer = transformer_cls(**variant.transformer_config())
    components = dict(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer, scheduler=build_scheduler(variant))
    if variant.pipeline in ("WanPipeline", "WanImageToVideoPipeline"):
        transformer_2 = None
        if variant.two_transformers:
            torch.manual_seed(seed + 4)
            transformer_2 = transformer_cls(**variant.transformer_config())
        components.update(
            transformer_2=transformer_2, boundary_ratio=variant.boundary_ratio, expand_timesteps=variant.expand_timesteps
        )
    if variant.pipeline == "WanImageToVideoPipeline":
        image_encoder, image_processor = build_tiny_image_encoder(seed + 5) if variant.image_encoder else (None, None)
        components.update(image_encoder=image_encoder, image_processor=image_processor)
    pipeline = getattr(diffusers, variant.pipeline)(**components)
    return save_tiny_pipeline(pipeline, out)


def save_tiny_pipeline(pipeline, out_dir: str | Path, index_classes: Optional[dict] = None) -> Path:
    """`pipeline.save_pretrained` into `out_dir`, atomically: written beside `out_dir` first and moved
    in with model_index.json last, so a folder holding model_index.json is complete (the tiny
    dataset's cache relies on it). Tokenizer and image-processor entries of model_index.json get
    the public class names that load under any transformers version; `index_classes` (component ->
    [library, class]) sets the names a real repo records, over those."""
    out = Path(out_dir)
    partial = out.parent / f".{out.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    pipeline.save_pretrained(partial, safe_serialization=True)
    # transformers 5 records the classes it built, "TokenizersBackend" and (without torchvision)
    # "CLIPImageProcessorPil"; the public names below load the same classes under any version.
    index_path = partial / "model_index.json"
    index = json.loads(index_path.read_text())
    for key, value in index.items():
        if isinstance(value, list) and len(value) == 2 and value[1] == "TokenizersBackend":
            index[key] = ["transformers", "PreTrainedTokenizerFast"]
    if index.get("image_processor", [None])[0] is not None:
        index["image_processor"] = ["transformers", "CLIPImageProcessor"]
    index.update(index_classes or {})
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    out.mkdir(parents=True, exist_ok=True)
    (out / "model_index.json").unlink(missing_ok=True)
    for child in sorted(partial.iterdir(), key=lambda p: p.name == "model_index.json"):
        target = out / child.name
        if target.is_dir():
            shutil.rmtree(target)
        child.replace(target)
    partial.rmdir()
    return out


def _write_variant(name: str, out: Path, seed: int) -> Path:
    return write_tiny_variant(out, name, seed=seed)


@dataclass(frozen=True)
class TinyModel:
    """A tiny model `python -m fv_accel.tiny_model` can write (see fv_accel.tiny.registry)."""

    summary: str  # one line for `--list`
    layout: str  # the real repo whose layout it mirrors
    write: Callable[[Path, int], Path]  # (folder, seed) -> the folder written


def wan_tiny_models() -> dict:
    """The Wan family's tiny models (TINY_MODELS) as registry entries."""
    return {
        name: TinyModel(v.summary, v.layout, functools.partial(_write_variant, name))
        for name, v in TINY_MODELS.items()
    }


def write_tiny_model(out_dir: str | Path, seed: int = 0, model_class: str = "wan", latents_stats: Optional[tuple] = None) -> Path:
    """The tiny Wan2.1-T2V model (`model_class="wan"`) or SkyReels-V2 model (`"skyreels_v2"`)."""
    if model_class not in MODEL_CLASS_ALIASES:
        raise ValueError(f"model_class: expected one of {', '.join(MODEL_CLASS_ALIASES)}, got {model_class!r}")
    return write_tiny_variant(out_dir, MODEL_CLASS_ALIASES[model_class], seed=seed, latents_stats=latents_stats)


@functools.lru_cache(maxsize=None)
def _tiny_vae_latent_stats(kind: str, seed: int) -> tuple[list[float], list[float]]:
    """measure_latent_stats of the tiny VAE `kind` drawn from `seed` (most variants share one VAE:
    measured once per process)."""
    return measure_latent_stats(build_tiny_vae(seed, kind))


@torch.no_grad()
def measure_latent_stats(vae) -> tuple[list[float], list[float]]:
    """Per-channel mean/std of the tiny VAE's latents over procedural clips, so that the tiny
    model's `latents_mean`/`latents_std` describe its own latent space (as Wan's do for Wan's)."""
    from fv_accel.tiny.clips import clip_batch

    z = vae.encode(clip_batch(8, 123, num_frames=9, height=32, width=32)).latent_dist.mode()  # [B, C, T, H, W]
    mean = z.mean(dim=(0, 2, 3, 4))
    std = z.std(dim=(0, 2, 3, 4)).clamp_min(1e-4)
    return [round(float(v), 6) for v in mean], [round(float(v), 6) for v in std]
