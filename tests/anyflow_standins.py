"""Stand-in flow-map prediction for the AnyFlow parity test, shared by both sides: the golden
generator (tests/fastvideo_reference/make_anyflow_golden.py, which runs FastVideo 0.2.1's own
AnyFlowPretrainMethod and AnyFlowMethod) and tests/test_anyflow_parity.py (fv_accel's). The teacher
and critic keep the DMD2 stand-ins (tests/dmd2_standins.py); the student's average velocity
u(x_t, t, r) is one deterministic function of (x_t, t, r, branch), per sample (the pretraining
draws one (t, r) per sample). Layout here is fv_accel's [B, C, T, H, W].

It is elementwise (layout-free), nonlinear in x_t, steep in t (sin(50 s), so that the central
difference at t +/- epsilon moves well past the tolerance when epsilon, the shift or the clamping
differ) and depends on r through two terms of its own (so r = t, r = 0 and a free r differ)."""

from __future__ import annotations

import torch

# a * x + b * tanh(x) * (1 + s) + c * s * (+1 cond / -1 uncond) + d * sin(50 s) * x + offset
#   + e * (s - q) * x + f * cos(40 q)   with s = t / 1000, q = r / 1000 per sample
STUDENT_FLOW_MAP_COEFFICIENTS = (0.90, 0.35, 0.60, 0.30, 0.05, 0.45, 0.20)


def per_sample(values: torch.Tensor, batch_size: int, ndim: int, device: torch.device) -> torch.Tensor:
    """[B] (or one value) timesteps / 1000 as [B, 1, ...] for broadcasting over a latent."""
    v = values.detach().float().reshape(-1).to(device) / 1000.0
    if v.numel() == 1:
        v = v.expand(batch_size)
    return v.reshape(batch_size, *([1] * (ndim - 1)))


def standin_velocity_with_r(x_t: torch.Tensor, timestep: torch.Tensor, r_timestep: torch.Tensor, conditional: bool) -> torch.Tensor:
    """The stand-in average velocity of the student for x_t [B, C, T, H, W] from t to r, float32."""
    a, b, c, d, offset, e, f = STUDENT_FLOW_MAP_COEFFICIENTS
    x = x_t.float()
    s = per_sample(timestep, x.shape[0], x.ndim, x.device)
    q = per_sample(r_timestep, x.shape[0], x.ndim, x.device)
    branch = 1.0 if conditional else -1.0
    return (a * x + b * torch.tanh(x) * (1.0 + s) + (c * branch) * s + d * torch.sin(50.0 * s) * x + offset
            + e * (s - q) * x + f * torch.cos(40.0 * q))
