"""The built-in tiny dataset: procedural clips of moving shapes with captions that describe them.

Clips are rendered, written as real mp4 files with a caption beside each, and encoded by the
preprocessing pipeline with the tiny VAE and text encoder of `fv_accel.tiny.model` (seeded) into
FastVideo's Parquet schema: the tiny default recipe exercises decoding, encoding and training end
to end without the network.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Optional

import torch

from fv_accel.tiny.clips import COLORS, MOTIONS, ClipSpec, render_clip, tiny_clip_specs, world_clip_specs  # noqa: F401 (re-exported)


def default_cache_dir() -> Path:
    """Where the tiny datasets are cached: `$FV_ACCEL_CACHE`, else `$XDG_CACHE_HOME/fv_accel`, else
    `~/.cache/fv_accel`."""
    root = os.environ.get("FV_ACCEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "fv_accel"
    )
    return Path(root)


# The multimodal world's rendering, in its cached folders' names: a change to its clips changes it.
MULTIMODAL_VERSION = 1


def tiny_dataset_dir(data_cfg, cache_dir: Optional[str] = None) -> Path:
    settings = {
        "n": data_cfg.tiny_num_clips,
        "frames": data_cfg.tiny_num_frames,
        "h": data_cfg.tiny_height,
        "w": data_cfg.tiny_width,
        "seed": data_cfg.seed,
        # 4: the tiny Wan model ships the real repo's UniPC scheduler (fv_accel.tiny.model);
        # 5: unconditional_text.safetensors beside the shards
        "v": 5,
    }
    if data_cfg.tiny_world != "default":  # the default world's folders keep their names
        settings.update(world=data_cfg.tiny_world, captions=data_cfg.tiny_num_captions, world_v=MULTIMODAL_VERSION)
    key = hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    root = Path(cache_dir or data_cfg.tiny_cache_dir or default_cache_dir())
    return root / f"tiny-data-{key}"


TINY_FPS = 8.0


def ensure_tiny_dataset(data_cfg, cache_dir: Optional[str] = None) -> Path:
    """Build the tiny dataset once (idempotent); returns the folder holding its Parquet shards.

    The clips are rendered, written as real mp4 files with a same-named .txt caption beside each
    (`videos/`), then encoded by the preprocessing pipeline (the code behind `python -m
    fv_accel.preprocess`) with the tiny model (`tiny-model/`) into `latents/`.
    """
    from fv_accel.data.schema import DATASET_INFO

    out = tiny_dataset_dir(data_cfg, cache_dir)
    if (out / "latents" / DATASET_INFO).is_file():  # written last: its presence means done
        return out / "latents"
    build_tiny_dataset(
        out,
        num_clips=data_cfg.tiny_num_clips,
        num_frames=data_cfg.tiny_num_frames,
        height=data_cfg.tiny_height,
        width=data_cfg.tiny_width,
        seed=data_cfg.seed,
        world=data_cfg.tiny_world,
        num_captions=data_cfg.tiny_num_captions,
    )
    return out / "latents"


def write_tiny_videos(
    folder: Path, *, num_clips: int, num_frames: int, height: int, width: int, seed: int,
    world: str = "default", num_captions: int = 4,
) -> list[Path]:
    """Render the procedural clips of a tiny world (`world_clip_specs`) into `folder` as mp4 files
    with their captions (skips existing ones)."""
    from fv_accel.data.video import write_video

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for k, spec in enumerate(world_clip_specs(world, num_clips, seed, num_captions)):
        video = folder / f"tiny-{k:04d}.mp4"
        caption = video.with_suffix(".txt")
        if not caption.is_file():
            caption.write_text(spec.caption + "\n", encoding="utf-8")
        if not video.is_file():
            write_video(video, render_clip(spec, num_frames=num_frames, height=height, width=width), fps=TINY_FPS)
        paths.append(video)
    return paths


def build_tiny_dataset(
    out: Path, *, num_clips: int, num_frames: int, height: int, width: int, seed: int,
    world: str = "default", num_captions: int = 4,
) -> Path:
    """Videos, tiny model, then latents via the preprocessing pipeline; returns the latents folder."""
    from fv_accel.data.video import FrameSampling
    from fv_accel.preprocess import preprocess
    from fv_accel.tiny.model import write_tiny_model

    model_dir = out / "tiny-model"
    if not (model_dir / "model_index.json").is_file():
        write_tiny_model(model_dir, seed=0)
    write_tiny_videos(
        out / "videos", num_clips=num_clips, num_frames=num_frames, height=height, width=width, seed=seed,
        world=world, num_captions=num_captions,
    )
    sampling = FrameSampling(num_frames=(num_frames,), buckets=((height, width),), seed=seed)
    # CPU and fp32 whatever the machine, so the cached dataset is the same everywhere.
    result = preprocess(
        str(model_dir), str(out / "videos"), out / "latents", sampling, device=torch.device("cpu"), dtype=torch.float32
    )
    if result.encoded != num_clips:
        raise RuntimeError(f"tiny dataset: {result.summary} in {out / 'latents'}; expected all {num_clips} clips")
    return out / "latents"
