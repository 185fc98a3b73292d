"""Training methods: each owns the math (what is noised, what the loss is)."""

from fv_accel.methods.base import TrainingMethod
from fv_accel.methods.consistency_model import CausalConsistencyDistillationMethod
from fv_accel.methods.distribution_matching import DMD2Method, SelfForcingMethod
from fv_accel.methods.distribution_matching import AnyFlowMethod, AnyFlowPretrainMethod
from fv_accel.methods.fine_tuning import DiffusionForcingSFTMethod, FineTuneMethod
from fv_accel.methods.fine_tuning.tfsft import TeacherForcingSFTMethod
from fv_accel.methods.knowledge_distillation import KDCausalMethod, KDMethod
from fv_accel.methods.rl import DiffusionNFTMethod

METHODS = {
    "finetune": FineTuneMethod,
    "dfsft": DiffusionForcingSFTMethod,
    "tfsft": TeacherForcingSFTMethod,
    "dmd2": DMD2Method,
    "self_forcing": SelfForcingMethod,
    "diffusion_nft": DiffusionNFTMethod,
    "causal_cd": CausalConsistencyDistillationMethod,
    "anyflow_pretrain": AnyFlowPretrainMethod,
    "anyflow": AnyFlowMethod,
    "kd": KDMethod,
    "kd_causal": KDCausalMethod,
}

__all__ = ["TrainingMethod", "FineTuneMethod", "DiffusionForcingSFTMethod", "TeacherForcingSFTMethod", "DMD2Method", "SelfForcingMethod", "DiffusionNFTMethod", "CausalConsistencyDistillationMethod", "AnyFlowPretrainMethod", "AnyFlowMethod", "KDMethod", "KDCausalMethod", "METHODS"]
