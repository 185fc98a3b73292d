"""The reward interface: what a reward is, what the recipe says about it, and the pieces the
built-in rewards share (frame choice, CLIP features).

A reward is called `reward(clips, prompts) -> torch.Tensor [B] float32`: `clips` the decoded
videos, a uint8 tensor [B, T, H, W, 3] (T may be 1), `prompts` their B prompts. A reward model
never trains: it is loaded in eval mode with `requires_grad_(False)`, on the device and in the
dtype asked, and called under `torch.inference_mode()`.

The recipe key `method.reward_fn` is parsed (fv_accel/rewards/spec.py) into a `RewardSpec`: one
`RewardEntry` (name, weight, options with their defaults filled in) per reward. This module and
spec.py import nothing of the model stack (the reward models load through loading.py), so the
recipe's checks can parse a spec cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

REWARD_KEY = "method.reward_fn"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# CLIP's context length: the CLIP rewards truncate (and CLIPScore pads) prompts to it.
CLIP_MAX_TEXT_TOKENS = 77
# Images per forward pass of a reward model (a clip's frames times its samples are split to this).
MAX_IMAGES_PER_FORWARD = 32


@dataclass(frozen=True)
class RewardEntry:
    """One reward of a recipe: its name (a registered reward, or `module:function` for the user's
    own), its weight in the weighted sum `avg`, and its options (defaults filled in)."""

    name: str
    weight: float
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RewardSpec:
    """`method.reward_fn` parsed: the rewards in recipe order."""

    entries: tuple[RewardEntry, ...]

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    @property
    def weights(self) -> dict[str, float]:
        return {e.name: e.weight for e in self.entries}


class Reward:
    """A reward: `__call__(clips uint8 [B, T, H, W, 3], prompts) -> [B] float32`.

    A subclass registered with `register_reward` names itself (`name`) and the options a recipe may
    set with their defaults (`options`, the one place a default lives); it is built as
    `cls(entry, device)`. `modules()` lists the torch modules it holds (their parameters are what
    `MultiReward.parameter_bytes` counts)."""

    name: str = ""
    options: dict[str, Any] = {}

    def __init__(self, entry: RewardEntry, device: torch.device):
        self.entry = entry
        self.device = torch.device(device)

    def __call__(self, clips: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        raise NotImplementedError

    def modules(self) -> list[torch.nn.Module]:
        return []


# name -> Reward subclass; filled by each reward's module when fv_accel.rewards imports it.
REWARDS: dict[str, type[Reward]] = {}


def register_reward(cls: type[Reward]) -> type[Reward]:
    """Class decorator: `cls` is the reward `cls.name` of recipes."""
    if not cls.name or ":" in cls.name or cls.name == "avg":
        raise ValueError(f"reward class {cls.__name__}: name {cls.name!r} (a name without ':', not 'avg')")
    REWARDS[cls.name] = cls
    return cls


def check_clips(clips: Any, prompts: Sequence[str]) -> None:
    """ValueError (one line) unless `clips` is a uint8 tensor [B, T, H, W, 3] and there are B prompts."""
    if not isinstance(clips, torch.Tensor) or clips.dtype != torch.uint8 or clips.ndim != 5 or clips.shape[-1] != 3:
        got = f"{clips.dtype} tensor of shape {list(clips.shape)}" if isinstance(clips, torch.Tensor) else type(clips).__name__
        raise ValueError(f"rewards take clips as a uint8 tensor [B, T, H, W, 3], got a {got}")
    if isinstance(prompts, str) or len(prompts) != clips.shape[0]:
        n = "a string" if isinstance(prompts, str) else f"{len(prompts)} prompts"
        raise ValueError(f"rewards take one prompt per clip: {clips.shape[0]} clips, {n}")


def frame_indices(num_frames: int, frames: int | str) -> list[int]:
    """Which frames of a clip of `num_frames` a frame reward scores: `frames` evenly spaced ones,
    the first and the last included (1: the first only, as FastVideo does; more than the clip
    has: every frame), or "all"."""
    if frames == "all" or frames >= num_frames:
        return list(range(num_frames))
    if frames == 1:
        return [0]
    step = (num_frames - 1) / (frames - 1)
    return [round(i * step) for i in range(frames)]


def clip_frames_as_images(clips: torch.Tensor, frames: int | str) -> tuple[list, int]:
    """(PIL images of the chosen frames, sample by sample, frames per sample)."""
    from PIL import Image

    chosen = clips[:, frame_indices(clips.shape[1], frames)].cpu().numpy()
    return [Image.fromarray(frame) for clip in chosen for frame in clip], chosen.shape[1]


def sample_chunks(num_samples: int, frames_per_sample: int) -> list[slice]:
    """Slices of samples whose frames fit MAX_IMAGES_PER_FORWARD (at least one sample each)."""
    per_chunk = max(1, MAX_IMAGES_PER_FORWARD // frames_per_sample)
    return [slice(s, min(s + per_chunk, num_samples)) for s in range(0, num_samples, per_chunk)]


def projected_features(output: Any, width: int, what: str) -> torch.Tensor:
    """The projected embeddings [N, width] from CLIP's `get_text_features` / `get_image_features`:
    a tensor in transformers 4.x, a `BaseModelOutputWithPooling` whose `pooler_output` holds the
    projected embeddings in 5.x."""
    features = output if isinstance(output, torch.Tensor) else getattr(output, "pooler_output", None)
    if not isinstance(features, torch.Tensor) or features.shape[-1] != width:
        got = list(features.shape) if isinstance(features, torch.Tensor) else type(output).__name__
        raise TypeError(f"CLIP {what} features: expected [N, {width}] projected embeddings, got {got}")
    return features
