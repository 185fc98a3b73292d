"""A tiny-world reward: how far LEFT the shape of a tiny-world clip ends (no model to load).

A tiny clip (fv_accel/tiny/) holds one coloured shape moving on a plain background. The reward is
1 - x_end / W, in [0, 1]: x_end the shape's centre x in pixels in the clip's last frame (the
tiny world's `tiny_shape_centres`), W the frame width. Where the last frame shows no shape, the
last frame that shows one counts; a clip with no shape in any frame scores 0. The score needs no
weights and reads off the clip, so a reward-training run on the tiny world can be checked by eye.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from fv_accel.rewards.base import Reward, register_reward


class TinyTrackReward(Reward):
    """A tiny-world reward read off the shape's centre track [F, 2] (pixels; NaN where a frame shows
    no shape) of each clip: `score_track(centres, width)`."""

    options: dict = {}

    @torch.inference_mode()
    def __call__(self, clips: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        from fv_accel.tiny import tiny_shape_centres

        width = clips.shape[3]
        scores = [self.score_track(tiny_shape_centres(clip), width) for clip in clips.cpu().numpy()]
        return torch.tensor(scores, dtype=torch.float32, device=self.device)

    def score_track(self, centres: np.ndarray, width: int) -> float:
        raise NotImplementedError


@register_reward
class TinyLeft(TinyTrackReward):
    name = "tiny_left"

    def score_track(self, centres: np.ndarray, width: int) -> float:
        xs = centres[:, 0]
        shown = xs[np.isfinite(xs)]
        return float(np.clip(1.0 - shown[-1] / width, 0.0, 1.0)) if shown.size else 0.0
