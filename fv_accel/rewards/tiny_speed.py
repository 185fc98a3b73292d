"""The tiny demo's reward (configs/tiny_nft.yaml): how far the shape of a tiny-world clip TRAVELS (no model to load).

The reward is the distance in pixels between the shape's centre in the first and in the last frame
that show it (the tiny world's `tiny_shape_centres`), over the frame's width: about 0.15 to 0.5 for
the multimodal world's clips, whose travel is drawn per clip whatever the caption. A clip showing
the shape in fewer than two frames scores 0.
"""

from __future__ import annotations

import numpy as np

from fv_accel.rewards.base import register_reward
from fv_accel.rewards.tiny_left import TinyTrackReward


@register_reward
class TinySpeed(TinyTrackReward):
    name = "tiny_speed"

    def score_track(self, centres: np.ndarray, width: int) -> float:
        shown = centres[np.isfinite(centres).all(axis=1)]
        return float(np.linalg.norm(shown[-1] - shown[0]) / width) if len(shown) >= 2 else 0.0
