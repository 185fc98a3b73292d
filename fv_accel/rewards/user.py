"""The user's own reward: a recipe name `module:function` (e.g. `my_rewards:sharpness`).

The module is imported with importlib from sys.path, the current working directory included (it is
added when missing), so a `my_rewards.py` in the directory the run is started from is found. The
function is called as `function(clips, prompts)`: clips the uint8 tensor [B, T, H, W, 3], prompts a
list of B strings; it returns B float scores as a tensor, a numpy array or a list, converted here to
a tensor (its dtype kept: `MultiReward` rejects anything but B floats).
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any, Callable, Sequence

import numpy as np
import torch

from fv_accel.hub_access import error_first_line
from fv_accel.rewards.base import Reward, RewardEntry


def is_user_reward(name: str) -> bool:
    return ":" in name


def import_user_function(name: str) -> Callable[..., Any]:
    """The function `module:function` names; ValueError (one line) when the name is malformed, the
    module cannot be imported, or it has no such callable."""
    module_name, _, function_name = name.partition(":")
    if not module_name.strip() or not function_name.strip() or ":" in function_name:
        raise ValueError("expected 'module:function' (a Python module on the path and a function in it)")
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    if module_name not in sys.modules:
        importlib.invalidate_caches()  # a module written since the last import is found
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 - any failure of the user's module, reported in one line
        raise ValueError(
            f"cannot import module '{module_name}' ({error_first_line(err)}); searched: the current directory "
            f"({cwd}) and sys.path"
        ) from None
    function = getattr(module, function_name, None)
    if not callable(function):
        what = "no function" if function is None else f"a {type(function).__name__}, not a function,"
        raise ValueError(f"module '{module_name}' ({getattr(module, '__file__', '?')}) has {what} named '{function_name}'")
    return function


class UserReward(Reward):
    """A `module:function` reward: the function called on the clips and prompts, its scores
    converted to a tensor on the reward's device."""

    options: dict = {}

    def __init__(self, entry: RewardEntry, device: torch.device):
        super().__init__(entry, device)
        self.name = entry.name
        self.function = import_user_function(entry.name)

    def __call__(self, clips: torch.Tensor, prompts: Sequence[str]) -> Any:
        return as_scores(self.function(clips, list(prompts)), self.device)


def as_scores(result: Any, device: torch.device) -> Any:
    """A numpy array or list/tuple of numbers as a tensor on `device` (dtype kept); anything else
    (and a list that is no array of numbers) unchanged, for `MultiReward`'s check to name."""
    if isinstance(result, torch.Tensor):
        return result.to(device)
    if isinstance(result, np.ndarray) and result.dtype.kind in "biuf":
        return torch.from_numpy(result).to(device)
    if isinstance(result, (list, tuple)):
        try:
            return torch.as_tensor(result, device=device)
        except (TypeError, ValueError, RuntimeError):
            return result
    return result
