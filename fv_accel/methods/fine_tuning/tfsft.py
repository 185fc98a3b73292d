"""TeacherForcingSFTMethod: DFSFT on [clean context | noisy] frames (REFERENCE.md section 5).

The student sees the latents twice in one forward: a clean copy (timestep 0, or the small
augmentation timestep `method.context_timestep`) and the per-chunk noised copy of DFSFT. With
block-causal attention, noisy block b attends to its own noisy block and to the clean copies of
blocks < b, so every block learns to denoise given a clean past, the way an autoregressive rollout
samples. Only the noisy half is in the loss (DFSFT's bell-weighted per-frame loss).

Random draws per step: DFSFT's (noise, u, chunk indices), then, only with `context_timestep > 0`,
the context noise [B, C, T, H, W].
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fv_accel.methods.base import LogScalar
from fv_accel.methods.fine_tuning.dfsft import DiffusionForcingSFTMethod
from fv_accel.models.base import ModelBase
from fv_accel.schedulers import randn


def parse_context_timestep(raw: Any, num_train_timesteps: int = 1000) -> float:
    """`method.context_timestep`: a timestep value in [0, N) for the clean context (0 = clean)."""
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or math.isnan(float(raw)):
        raise ValueError(f"method.context_timestep must be a number in [0, {num_train_timesteps}), got {raw!r}")
    value = float(raw)
    if not 0.0 <= value < num_train_timesteps:
        raise ValueError(f"method.context_timestep must be in [0, {num_train_timesteps}), got {raw!r}")
    return value


class TeacherForcingSFTMethod(DiffusionForcingSFTMethod):
    """Teacher-forcing SFT: a causal student denoises each chunk given clean copies of the past."""

    def __init__(self, *, cfg: Any, role_models: dict[str, ModelBase]) -> None:
        super().__init__(cfg=cfg, role_models=role_models)
        self._context_timestep = parse_context_timestep(
            self.method_config.get("context_timestep", 0.0), self.table.num_train_timesteps
        )

    def _check_student(self) -> None:
        super()._check_student()
        if getattr(self.student, "causal_block_size", None) is None:
            raise ValueError(
                "method.name 'tfsft' needs a block-causal student (models.student.causal: true): with "
                "bidirectional attention the noisy half would see the clean copy of its own future"
            )
        if not hasattr(self.student, "predict_noise_teacher_forcing"):
            raise ValueError(f"{type(self.student).__name__} has no teacher-forcing forward")

    def single_train_step(
        self, batch: dict[str, Any], iteration: int
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, LogScalar]]:
        del iteration
        generator = self.batch_generator(batch)
        tb = self._prepare(batch, generator=generator)
        context = tb.latents
        context_t = torch.full_like(tb.timesteps, self._context_timestep)
        if self._context_timestep > 0:
            # Noise augmentation of the context: x_c = (1 - s) x0 + s eps_c with s = t_c / N.
            sigma = torch.full_like(tb.sigmas, self._context_timestep / self.table.num_train_timesteps)
            context_noise = randn(tb.latents.shape, generator, tb.latents.device)
            context = self.table.add_noise(tb.latents, context_noise, sigma)
        _, pred = self.student.predict_noise_teacher_forcing(
            context, context_t, tb.noisy_model_input, tb.timesteps, tb, conditional=True
        )
        loss = self.compute_loss(pred, tb)
        return self._step_result(loss, tb, "tfsft_loss")

    def math_signature(self) -> dict[str, Any]:
        sig = super().math_signature()
        sig["method.context_timestep"] = self._context_timestep
        return sig
