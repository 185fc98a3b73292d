"""Procedural clips of moving shapes with captions that describe them (the tiny world's content)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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


def clip_batch(n: int, seed: int, *, num_frames: int, height: int, width: int):
    """`n` procedural clips (tiny_clip_specs(n, seed)) as a float tensor [n, 3, F, H, W] in [-1, 1]."""
    import torch

    frames = np.stack([render_clip(s, num_frames=num_frames, height=height, width=width) for s in tiny_clip_specs(n, seed=seed)])
    return torch.from_numpy(frames).permute(0, 4, 1, 2, 3).float() / 127.5 - 1.0
