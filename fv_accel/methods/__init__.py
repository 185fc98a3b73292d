"""Training methods: each owns the math (what is noised, what the loss is)."""

from fv_accel.methods.base import TrainingMethod
from fv_accel.methods.fine_tuning import DiffusionForcingSFTMethod, FineTuneMethod

METHODS = {
    "finetune": FineTuneMethod,
    "dfsft": DiffusionForcingSFTMethod,
}

__all__ = ["TrainingMethod", "FineTuneMethod", "DiffusionForcingSFTMethod", "METHODS"]
