"""FastVideo's fine-tuning methods, with the seed's public face."""

from fv_accel.methods.fine_tuning.dfsft import DiffusionForcingSFTMethod
from fv_accel.methods.fine_tuning.finetune import FineTuneMethod

__all__ = ["FineTuneMethod", "DiffusionForcingSFTMethod"]
