"""Training methods: each owns the math (what is noised, what the loss is)."""

from fv_accel.methods.base import TrainingMethod
from fv_accel.methods.distribution_matching import DMD2Method, SelfForcingMethod
from fv_accel.methods.fine_tuning import DiffusionForcingSFTMethod, FineTuneMethod
from fv_accel.methods.fine_tuning.tfsft import TeacherForcingSFTMethod
from fv_accel.methods.rl import DiffusionNFTMethod

METHODS = {
    "finetune": FineTuneMethod,
    "dfsft": DiffusionForcingSFTMethod,
    "tfsft": TeacherForcingSFTMethod,
    "dmd2": DMD2Method,
    "self_forcing": SelfForcingMethod,
    "diffusion_nft": DiffusionNFTMethod,
}

__all__ = ["TrainingMethod", "FineTuneMethod", "DiffusionForcingSFTMethod", "TeacherForcingSFTMethod", "DMD2Method", "SelfForcingMethod", "DiffusionNFTMethod", "METHODS"]
