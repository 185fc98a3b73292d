"""Reward models and the user's reward functions, for reward training (DiffusionNFT).

One file per reward, each registering itself (`@register_reward`); every module of this package
is imported here, so adding a reward touches only its own file:

- `pickscore`: PickScore (yuvalkirstain/PickScore_v1), as FastVideo and DiffusionNFT compute it;
- `clipscore`: CLIPScore (openai/clip-vit-large-patch14), as FastVideo computes it;
- `tiny_left`: how far left a tiny-world clip's shape ends;
- `tiny_speed`: the tiny demo's reward (configs/tiny_nft.yaml), how far a tiny-world clip's shape travels;
- `module:function`: the user's own function (fv_accel/rewards/user.py).

    spec = parse_reward_fn(cfg.method.reward_fn)   # a one-line ValueError naming the key on a problem
    rewards = build_rewards(spec, device)          # MultiReward: the models loaded frozen
    scores, invalid = rewards.score(clips, prompts)  # {name: [B], "avg": weighted sum}, [B] bool

The interface is fv_accel/rewards/base.py's; `MultiReward`'s docstring says what `score` returns.
"""

import importlib
import pkgutil

from fv_accel.rewards.base import REWARDS, Reward, RewardEntry, RewardSpec, register_reward
from fv_accel.rewards.multi import MultiReward, build_rewards
from fv_accel.rewards.spec import parse_reward_fn

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = [
    "REWARDS",
    "MultiReward",
    "Reward",
    "RewardEntry",
    "RewardSpec",
    "build_rewards",
    "parse_reward_fn",
    "register_reward",
]
