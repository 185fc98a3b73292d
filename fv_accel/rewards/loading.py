"""How a reward model loads: from a Hub id or a local folder like the project's models, frozen.

A failure becomes the project's one-line `ModelLoadError` (fv_accel/models/loading.py's
`explain_load_error`), prefixed with the reward's name: a model missing from the cache offline
names the `hf download <id>` command. Remote code is never trusted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

import torch

from fv_accel.hub_access import error_first_line, offline_unless_hub_answers
from fv_accel.rewards.base import DTYPES, REWARD_KEY, Reward, RewardEntry


def freeze(module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """`module` on `device` in `dtype`, in eval mode, without gradients."""
    module = module.to(device=device, dtype=dtype).eval()
    module.requires_grad_(False)
    return module


def load_pretrained(
    loader: Callable[..., Any], model_id: str, *, reward: str, what: str, revision: Optional[str] = None, **kwargs: Any
) -> Any:
    """`loader(model_id, revision=..., trust_remote_code=False, **kwargs)` (a `from_pretrained`) for
    a Hub id or a local folder, a failure turned into the project's one-line `ModelLoadError`
    naming the reward (a model missing offline: the `hf download <id>` command)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    from fv_accel.models.loading import ModelLoadError, explain_load_error

    if not Path(model_id).exists():
        try:
            validate_repo_id(model_id)
        except HFValidationError as err:
            raise ModelLoadError(
                f"reward '{reward}' ({REWARD_KEY}): '{model_id}' is neither an existing local folder nor a valid "
                f"Hub id ({error_first_line(err)})"
            ) from None
        offline_unless_hub_answers()  # no answer from the Hub: the local cache only, at once
    try:
        return loader(model_id, revision=revision, trust_remote_code=False, **kwargs)
    except (OSError, ValueError) as err:
        explained = explain_load_error(model_id, what, err, revision=revision)
        raise ModelLoadError(f"reward '{reward}' ({REWARD_KEY}): {explained}") from None


class FrozenModelReward(Reward):
    """A reward computed by a pretrained model with its processor (PickScore, CLIPScore): the
    options `frames` and `dtype`, the processor and the frozen model loaded by `load`."""

    def __init__(self, entry: RewardEntry, device: torch.device):
        super().__init__(entry, device)
        self.frames = entry.options["frames"]
        self.dtype = DTYPES[entry.options["dtype"]]
        self.processor: Any = None
        self.model: Any = None

    def load(self, processor_loader: Callable[..., Any], processor_id: str, processor_revision: Optional[str],
             model_loader: Callable[..., Any]) -> None:
        """The processor, and the model (`options["model"]` at `options["revision"]`) frozen in the recipe's dtype."""
        opts = self.entry.options
        self.processor = load_pretrained(processor_loader, processor_id, reward=self.name, what="processor",
                                         revision=processor_revision)
        model = load_pretrained(model_loader, opts["model"], reward=self.name, what="weights", revision=opts["revision"],
                                dtype=self.dtype)
        self.model = freeze(model, self.device, self.dtype)

    def modules(self) -> list[torch.nn.Module]:
        return [self.model]
