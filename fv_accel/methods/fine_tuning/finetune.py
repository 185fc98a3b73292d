"""FineTuneMethod: plain flow-matching SFT (REFERENCE.md sections 2 and 3)."""

from __future__ import annotations

from typing import Any, Literal

import torch

from fv_accel.methods.base import LogScalar, TrainingMethod
from fv_accel.models.base import ModelBase, TrainingBatch
from fv_accel.schedulers import FlowMatchTable


def flow_matching_loss(
    pred: torch.Tensor,
    clean: torch.Tensor,
    noisy: torch.Tensor,
    noise: torch.Tensor,
    sigmas: torch.Tensor,
    *,
    precondition_outputs: bool,
    reduce_dims: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """Squared error in fp32 of the velocity (or, preconditioned, of x0_hat = x_t - sigma * pred).

    `sigmas` is [B] or per frame [B, T]; `reduce_dims=None` averages every element, otherwise only
    over the given dims (DFSFT keeps [B, T]).
    """
    pred = pred.float()
    if precondition_outputs:
        sigma = FlowMatchTable.expand_sigma(sigmas.float(), pred.ndim)
        err = noisy.float() - sigma * pred - clean.float()
    else:
        err = pred - (noise.float() - clean.float())
    sq = err.pow(2)
    return sq.mean() if reduce_dims is None else sq.mean(dim=reduce_dims)


class FineTuneMethod(TrainingMethod):
    """Supervised finetuning: only student participates."""

    def __init__(self, *, cfg: Any, role_models: dict[str, ModelBase]) -> None:
        super().__init__(cfg=cfg, role_models=role_models)
        self._require_trainable_student("FineTuneMethod")
        self._attn_kind: Literal["dense", "vsa"] = self._infer_attn_kind()
        self.student.init_preprocessors(self.training_config)
        self._init_optimizers_and_schedulers()

    def _prepare(self, batch: dict[str, Any]) -> TrainingBatch:
        tb = self.student.prepare_batch(batch, generator=self.batch_generator(batch), latents_source="data")
        for name in ("latents", "noisy_model_input", "noise", "sigmas", "timesteps"):
            if getattr(tb, name) is None:
                raise RuntimeError(f"prepare_batch() must set TrainingBatch.{name}")
        return tb

    def single_train_step(
        self, batch: dict[str, Any], iteration: int
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, LogScalar]]:
        """Prepare targets and compute the supervised flow-matching loss."""
        del iteration
        tb = self._prepare(batch)
        pred = self.student.predict_noise(
            tb.noisy_model_input, tb.timesteps, tb, conditional=True, attn_kind=self._attn_kind
        )
        loss = flow_matching_loss(
            pred,
            tb.latents,
            tb.noisy_model_input,
            tb.noise,
            tb.sigmas,
            precondition_outputs=bool(self.training_config.model.precondition_outputs),
        )
        return self._step_result(loss, tb, "finetune_loss")
