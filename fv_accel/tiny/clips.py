"""Procedural clips of moving shapes with captions that describe them (the tiny world's content).

Two worlds (`training.data.tiny_world`):

- `default`: every clip its own caption (drawn from the seed), the shape crossing the frame
  through its centre (`tiny_clip_specs`);
- `multimodal`: a few captions (`tiny_num_captions`), each with many clips of the same shape,
  colour, size and background moving in the caption's direction, from other start positions at
  other speeds (`multimodal_clip_specs`). A caption then has many answers: a sampler that averages
  them draws a blur far from every clip, a good one lands near one of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

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
    # Where the centre starts, (x, y) as fractions of the frame, and how far it travels along the
    # motion over the clip (a fraction of the frame). None: the default world's path, crossing
    # the frame's centre over 0.6 of it.
    start: Optional[tuple[float, float]] = None
    travel: float = 0.6

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


# The multimodal world's captions: caption i has colour i, the shapes and motions in turn and a
# dark background (every colour shows on it); fixed, so that held-out clips (another data seed)
# share the training captions.
_MULTIMODAL_BACKGROUNDS = ("black", "dark")
# Start positions keep the centre within [_EDGE, 1 - _EDGE] of the frame along the motion; across
# it, a caption's clips take the two sides in turn, each within _ACROSS of the frame's edge. The
# mean of a caption's clips, where a sampler that averages them puts its blur, then lies on no
# clip's path (measured on 8 clips per caption: the pixel mean of a caption's clips is 9-10 px
# from the nearest clip's track at 48x48, a clip 2.5 px from its nearest other clip). The travel
# (speed: the fraction of the frame crossed over the clip) is drawn from _TRAVEL.
_EDGE = 0.22
_ACROSS = (0.2, 0.3)
_TRAVEL = (0.15, 0.5)
MULTIMODAL_SIZE = 0.14


def multimodal_captions(num_captions: int) -> list[ClipSpec]:
    """The multimodal world's captions, as the spec each caption's clips share (start unset)."""
    colors, motions = list(COLORS), list(MOTIONS)
    if not 1 <= num_captions <= len(colors):
        raise ValueError(f"tiny_num_captions: {num_captions}: the multimodal world has 1 to {len(colors)} captions")
    return [
        ClipSpec(shape=SHAPES[i % len(SHAPES)], color=colors[i], background=_MULTIMODAL_BACKGROUNDS[(i // 2) % 2],
                 motion=motions[i % len(motions)], size=MULTIMODAL_SIZE)
        for i in range(num_captions)
    ]


def multimodal_clip_specs(n: int, num_captions: int, seed: int = 0) -> list[ClipSpec]:
    """`n` clips of the multimodal world: clip k has caption k % num_captions, the side of the frame
    (k // num_captions) % 2 across its motion, and its own start position and travel (drawn from
    `seed`), always moving in its caption's direction."""
    rng = np.random.default_rng(seed)
    captions = multimodal_captions(num_captions)
    specs = []
    for k in range(n):
        base = captions[k % num_captions]
        dx, dy = MOTIONS[base.motion]
        travel = float(rng.uniform(*_TRAVEL))
        along = float(rng.uniform(_EDGE, 1.0 - _EDGE - travel))  # start along the motion, moving forward
        across = float(rng.uniform(*_ACROSS))
        across = across if (k // num_captions) % 2 == 0 else 1.0 - across
        along = along if dx + dy > 0 else 1.0 - along
        start = (along, across) if dx else (across, along)
        specs.append(ClipSpec(base.shape, base.color, base.background, base.motion, base.size, start=start, travel=travel))
    return specs


def world_clip_specs(world: str, n: int, seed: int, num_captions: int = 4) -> list[ClipSpec]:
    """The clips of a tiny world: `default` (tiny_clip_specs) or `multimodal` (multimodal_clip_specs)."""
    if world == "default":
        return tiny_clip_specs(n, seed=seed)
    if world == "multimodal":
        return multimodal_clip_specs(n, num_captions, seed=seed)
    raise ValueError(f"tiny_world: {world!r}: choose default or multimodal")


def render_clip(spec: ClipSpec, *, num_frames: int, height: int, width: int) -> np.ndarray:
    """uint8 frames [F, H, W, 3]: the shape crosses the frame smoothly along its motion."""
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    dx, dy = MOTIONS[spec.motion]
    radius = spec.size * min(height, width)
    frames = np.empty((num_frames, height, width, 3), dtype=np.uint8)
    bg = np.array(BACKGROUNDS[spec.background], dtype=np.float32)
    fg = np.array(COLORS[spec.color], dtype=np.float32)
    for f in range(num_frames):
        if spec.start is None:
            progress = f / max(1, num_frames - 1) - 0.5  # -0.5 .. 0.5
            cx = width / 2 + dx * progress * width * 0.6
            cy = height / 2 + dy * progress * height * 0.6
        else:
            progress = f / max(1, num_frames - 1)  # 0 .. 1
            cx = width * (spec.start[0] + dx * spec.travel * progress)
            cy = height * (spec.start[1] + dy * spec.travel * progress)
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
