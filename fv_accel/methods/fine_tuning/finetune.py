"""FineTuneMethod: plain flow-matching SFT (REFERENCE.md sections 2 and 3)."""

from __future__ import annotations

from typing import Any, Literal

import torch

from fv_accel.methods.base import LogScalar, TrainingMethod, flow_matching_loss  # noqa: F401 (re-exported)
from fv_accel.models.base import ModelBase


class FineTuneMethod(TrainingMethod):
    """Supervised finetuning: only student participates."""

    def __init__(self, *, cfg: Any, role_models: dict[str, ModelBase]) -> None:
        super().__init__(cfg=cfg, role_models=role_models)
        self._require_trainable_student("FineTuneMethod")
        self._attn_kind: Literal["dense", "vsa"] = self._infer_attn_kind()
        self._init_student()

    def single_train_step(
        self, batch: dict[str, Any], iteration: int
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, LogScalar]]:
        """Prepare targets and compute the supervised flow-matching loss."""
        del iteration
        tb = self.attach_vsa_metadata(self.prepare(batch, self.batch_generator(batch)))
        pred = self.student.predict_noise(
            tb.noisy_model_input, tb.timesteps, tb, conditional=True, attn_kind=self._attn_kind
        )
        return self.with_audio_loss(self.unweighted_loss(pred, tb), tb, "finetune_loss")

    def math_signature(self) -> dict[str, Any]:
        sig = super().math_signature()
        sig["method.timestep_index_range"] = list(self._timestep_index_range)
        return sig
