"""The built-in tiny dataset: procedural clips of moving shapes with captions that describe them.

Clips are rendered, written as real mp4 files with a caption beside each, and encoded by the
preprocessing pipeline with the tiny VAE and text encoder of `fv_accel.tiny_model` (seeded) into
FastVideo's Parquet schema: the tiny default recipe exercises decoding, encoding and training end
to end without the network.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

COLORS = {
    "red": (220, 40, 40),
    "green": (40, 200, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 220, 40),
    "white": (240, 240, 240),
    "orange": (240, 140, 30),
    "purple": (150, 50, 190),
    "cyan": (40, 210, 220),
}
BACKGROUNDS = {"black": (10, 10, 10), "dark": (40, 40, 60), "light": (200, 200, 190)}
SHAPES = ("circle", "square")
MOTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}


@dataclass(frozen=True)
class ClipSpec:
    shape: str
    color: str
    background: str
    motion: str
    size: float  # radius as a fraction of the frame

    @property
    def caption(self) -> str:
        return f"a {self.color} {self.shape} moving {self.motion} on a {self.background} background"


def tiny_clip_specs(n: int, seed: int = 0) -> list[ClipSpec]:
    rng = np.random.default_rng(seed)
    specs = []
    for _ in range(n):
        specs.append(
            ClipSpec(
                shape=str(rng.choice(SHAPES)),
                color=str(rng.choice(list(COLORS))),
                background=str(rng.choice(list(BACKGROUNDS))),
                motion=str(rng.choice(list(MOTIONS))),
                size=float(rng.uniform(0.15, 0.25)),
            )
        )
    return specs


def render_clip(spec: ClipSpec, *, num_frames: int, height: int, width: int) -> np.ndarray:
    """uint8 frames [F, H, W, 3]: the shape crosses the frame smoothly along its motion."""
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    dx, dy = MOTIONS[spec.motion]
    radius = spec.size * min(height, width)
    frames = np.empty((num_frames, height, width, 3), dtype=np.uint8)
    bg = np.array(BACKGROUNDS[spec.background], dtype=np.float32)
    fg = np.array(COLORS[spec.color], dtype=np.float32)
    for f in range(num_frames):
        progress = f / max(1, num_frames - 1) - 0.5  # -0.5 .. 0.5
        cx = width / 2 + dx * progress * width * 0.6
        cy = height / 2 + dy * progress * height * 0.6
        if spec.shape == "circle":
            dist = np.sqrt((xx - cx) ** 2 + (yy - cy) ** 2) - radius
        else:
            dist = np.maximum(np.abs(xx - cx), np.abs(yy - cy)) - radius
        alpha = np.clip(0.5 - dist, 0.0, 1.0)[..., None]  # anti-aliased edge
        frames[f] = (alpha * fg + (1 - alpha) * bg).round().astype(np.uint8)
    return frames


def default_cache_dir() -> Path:
    root = os.environ.get("FV_ACCEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "fv_accel"
    )
    return Path(root)


def tiny_dataset_dir(data_cfg, cache_dir: Optional[str] = None) -> Path:
    settings = {
        "n": data_cfg.tiny_num_clips,
        "frames": data_cfg.tiny_num_frames,
        "h": data_cfg.tiny_height,
        "w": data_cfg.tiny_width,
        "seed": data_cfg.seed,
        "v": 2,  # 2: mp4 files encoded by the preprocessing pipeline
    }
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
    )
    return out / "latents"


def write_tiny_videos(folder: Path, *, num_clips: int, num_frames: int, height: int, width: int, seed: int) -> list[Path]:
    """Render the procedural clips into `folder` as mp4 files with their captions (skips existing ones)."""
    from fv_accel.data.video import write_video

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for k, spec in enumerate(tiny_clip_specs(num_clips, seed=seed)):
        video = folder / f"tiny-{k:04d}.mp4"
        caption = video.with_suffix(".txt")
        if not caption.is_file():
            caption.write_text(spec.caption + "\n", encoding="utf-8")
        if not video.is_file():
            write_video(video, render_clip(spec, num_frames=num_frames, height=height, width=width), fps=TINY_FPS)
        paths.append(video)
    return paths


def build_tiny_dataset(out: Path, *, num_clips: int, num_frames: int, height: int, width: int, seed: int) -> Path:
    """Videos, tiny model, then latents via the preprocessing pipeline; returns the latents folder."""
    from fv_accel.data.video import FrameSampling
    from fv_accel.preprocess import preprocess
    from fv_accel.tiny_model import write_tiny_model

    model_dir = out / "tiny-model"
    if not (model_dir / "model_index.json").is_file():
        write_tiny_model(model_dir, seed=0)
    write_tiny_videos(out / "videos", num_clips=num_clips, num_frames=num_frames, height=height, width=width, seed=seed)
    sampling = FrameSampling(num_frames=(num_frames,), buckets=((height, width),), seed=seed)
    # CPU and fp32 whatever the machine, so the cached dataset is the same everywhere.
    result = preprocess(
        str(model_dir), str(out / "videos"), out / "latents", sampling, device=torch.device("cpu"), dtype=torch.float32
    )
    if result.encoded != num_clips:
        raise RuntimeError(f"tiny dataset: {result.summary} in {out / 'latents'}; expected all {num_clips} clips")
    return out / "latents"
