"""Stand-in role predictions for the causal consistency distillation parity test, shared by the golden
generator (tests/fastvideo_reference/make_causal_cd_golden.py, FastVideo 0.2.1's own method) and
tests/test_causal_cd_parity.py (fv_accel's). Layout here is fv_accel's [B, C, T, H, W].

A role's teacher-forced flow is
    standin_predict_noise(kind, x_t, t, branch)                  (tests/dmd2_standins.py)
  + CONTEXT_WEIGHT * (1 + t_ctx / 1000) * context(clean)        what the clean history holds
  + w * (1 + tanh(x_t))                                         the role model's one parameter
where context(clean)[b, c, f] is the mean over height, width and the frames of the chunks before
frame f's chunk (chunks of CHUNK latent frames; 0 in the first chunk): the block-causal rule of
teacher forcing, per channel and frame, so a context in another layout, order or chunking moves the
losses. t_ctx is the clean context's timestep (0 in both). The student and the EMA share the
"student" coefficients (they start as one model), the teacher has its own. `w` is the first entry of
each role's `scale_shift_table` in fv_accel (a one-element parameter in FastVideo's stand-in): the
optimizer moves the student's and the EMA update the EMA's, so when the EMA moves shows in the losses."""

from __future__ import annotations

import torch

from dmd2_standins import standin_predict_noise

CHUNK = 3
CONTEXT_WEIGHT = 0.3
W_INIT = 0.05
# Which stand-in coefficients each role uses.
STANDIN_KIND = {"student": "student", "ema": "student", "teacher": "teacher"}


def standin_context(clean: torch.Tensor) -> torch.Tensor:
    """[B, C, T, 1, 1]: per frame, the mean of the clean frames of the earlier chunks."""
    x = clean.float().mean(dim=(3, 4))  # [B, C, T]
    out = torch.zeros_like(x)
    for f in range(x.shape[2]):
        start = (f // CHUNK) * CHUNK
        if start:
            out[:, :, f] = x[:, :, :start].mean(dim=2)
    return out[..., None, None]


def cd_standin_flow(role: str, x_t: torch.Tensor, timestep: torch.Tensor, conditional: bool, clean: torch.Tensor,
                    context_timestep: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The stand-in teacher-forced flow of `role` for x_t [B, C, T, H, W] at `timestep` (one value for
    every frame) given the clean latents `clean` [B, C, T, H, W] at `context_timestep`; float32,
    differentiable in `w`."""
    x = x_t.float()
    core = standin_predict_noise(STANDIN_KIND[role], x, timestep, conditional)
    t_ctx = float(context_timestep.detach().float().reshape(-1)[0]) if context_timestep is not None else 0.0
    ctx = CONTEXT_WEIGHT * (1.0 + t_ctx / 1000.0) * standin_context(clean.to(x.device))
    return core + ctx + w.to(device=x.device, dtype=x.dtype) * (1.0 + torch.tanh(x))
