"""Several rewards as one: each reward's [B] scores, checked, and their weighted sum `avg`."""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

from fv_accel.rewards.base import REWARDS, Reward, RewardSpec, check_clips
from fv_accel.rewards.spec import parse_reward_fn
from fv_accel.rewards.user import UserReward, is_user_reward

logger = logging.getLogger(__name__)


class MultiReward:
    """The rewards of a `RewardSpec`, built on one device, called together.

        scores, invalid = rewards.score(clips, prompts)

    `clips` is a uint8 tensor [B, T, H, W, 3], `prompts` B strings. `scores` maps each reward's
    name to its [B] float32 scores and "avg" to their weighted sum (FastVideo's name; a sum, not a
    mean). `invalid` is a [B] bool tensor: True where any reward gave a non-finite value (NaN or
    inf) for that sample; those samples' scores, `avg` included, are left non-finite, and the
    caller drops them from their group. The first time a reward gives one, one warning names the
    reward and the sample's prompt (once per reward, not per call). `rewards(clips, prompts)` returns
    `scores` alone and leaves the mask in `rewards.last_invalid`.

    A reward's result that is not a float tensor of shape [B] is a ValueError (one line) naming the
    reward, what was expected and what came, and the first prompt. The scores are plain tensors
    (made outside inference mode), usable in autograd expressions such as an advantage-weighted loss.
    """

    def __init__(self, spec: RewardSpec, rewards: Sequence[Reward], device: torch.device):
        self.spec = spec
        self.rewards = list(rewards)
        self.device = torch.device(device)
        self.last_invalid: torch.Tensor | None = None
        self._warned: set[str] = set()

    @property
    def names(self) -> list[str]:
        return self.spec.names

    def __call__(self, clips: torch.Tensor, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        return self.score(clips, prompts)[0]

    def score(self, clips: torch.Tensor, prompts: Sequence[str]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """(scores by reward name plus "avg", invalid [B] bool); see the class docstring."""
        check_clips(clips, prompts)
        prompts = list(prompts)
        scores: dict[str, torch.Tensor] = {}
        for entry, reward in zip(self.spec.entries, self.rewards):
            with torch.inference_mode():
                result = reward(clips, prompts)
            scores[entry.name] = self._checked(entry.name, result, prompts)
        invalid = torch.zeros(len(prompts), dtype=torch.bool, device=self.device)
        for name, values in scores.items():
            bad = ~torch.isfinite(values)
            if bad.any():
                self._warn_once(name, values, bad, prompts)
                invalid |= bad
        scores["avg"] = sum(entry.weight * scores[entry.name] for entry in self.spec.entries)
        self.last_invalid = invalid
        return scores, invalid

    def parameter_bytes(self) -> dict[str, int]:
        """Bytes of the parameters each reward holds (0 for a reward with no model), by name."""
        return {
            entry.name: sum(p.numel() * p.element_size() for m in reward.modules() for p in m.parameters())
            for entry, reward in zip(self.spec.entries, self.rewards)
        }

    def _checked(self, name: str, result: Any, prompts: list[str]) -> torch.Tensor:
        """`result` as float32 [B] on the device (a copy outside inference mode), or a ValueError."""
        batch = len(prompts)
        if isinstance(result, torch.Tensor) and result.is_floating_point() and tuple(result.shape) == (batch,):
            return result.detach().to(device=self.device, dtype=torch.float32).clone()
        if isinstance(result, torch.Tensor):
            got = f"a tensor of dtype {str(result.dtype).removeprefix('torch.')} and shape {list(result.shape)}"
        else:
            got = f"a {type(result).__name__} ({_short(repr(result))})"
        raise ValueError(
            f"reward '{name}' returned {got}; expected a float tensor of shape [B] = [{batch}], one score per clip "
            f"(first prompt: {_short(prompts[0] if prompts else '')!r})"
        )

    def _warn_once(self, name: str, values: torch.Tensor, bad: torch.Tensor, prompts: list[str]) -> None:
        if name in self._warned:
            return
        self._warned.add(name)
        first = int(bad.nonzero()[0, 0])
        logger.warning(
            "reward '%s' gave %s for %d of %d samples, first for the prompt %r (sample %d); such samples are "
            "marked invalid and left out of their groups (this warning is shown once per reward)",
            name, float(values[first]), int(bad.sum()), len(prompts), _short(prompts[first]), first,
        )


def build_rewards(spec: Any, device: torch.device | str = "cpu") -> MultiReward:
    """The `MultiReward` of a `RewardSpec` (or a raw `method.reward_fn` value, parsed first), each
    reward built on `device` (its model loaded frozen, in the dtype its options ask)."""
    if not isinstance(spec, RewardSpec):
        spec = parse_reward_fn(spec)
    device = torch.device(device)
    rewards = [
        (UserReward if is_user_reward(entry.name) else REWARDS[entry.name])(entry, device) for entry in spec.entries
    ]
    return MultiReward(spec, rewards, device)


def _short(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
