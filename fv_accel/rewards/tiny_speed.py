"""A second tiny-world reward: how far the shape of a tiny-world clip TRAVELS (no model to load).

The reward is the distance in pixels between the shape's centre in the first and in the last frame
that show it (the tiny world's `tiny_shape_centres`), over the frame's width: about 0.15 to 0.5 for
the multimodal world's clips, whose travel is drawn per clip whatever the caption. A clip showing
the shape in fewer than two frames scores 0.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from fv_accel.rewards.base import Reward, register_reward


@register_reward
class TinySpeed(Reward):
    name = "tiny_speed"
    options: dict = {}

    @torch.inference_mode()
    def __call__(self, clips: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        from fv_accel.tiny import tiny_shape_centres

        width = clips.shape[3]
        scores = []
        for clip in clips.cpu().numpy():
            centres = tiny_shape_centres(clip)
            shown = centres[np.isfinite(centres).all(axis=1)]
            scores.append(float(np.linalg.norm(shown[-1] - shown[0]) / width) if len(shown) >= 2 else 0.0)
        return torch.tensor(scores, dtype=torch.float32, device=self.device)
