"""Stand-ins for the KD parity test, shared by the golden generator
(tests/fastvideo_reference/make_kd_golden.py, which runs FastVideo 0.2.1's own KDMethod and
KDCausalMethod) and tests/test_kd_parity.py (fv_accel's): the student's prediction as a cheap
deterministic function of (x_t, timestep), and a stand-in teacher-trajectory batch drawn from a seed.
Layout here is fv_accel's ([B, C, T, H, W]; trajectories [B, S, C, T, H, W]).

The prediction is elementwise and takes the timestep per sample ([B]) or per latent frame ([B, T]),
so a per-frame timestep that reaches the wrong frame, or a wrong timestep value, moves the loss;
the sin(50 s) term makes it steep in the timestep."""

from __future__ import annotations

import torch

# a * x + b * tanh(x) * (1 + s) + c * s + d * sin(50 s) * x + offset, s = t / 1000
KD_STANDIN = (0.90, 0.35, 0.60, 0.30, 0.05)


def kd_standin_predict(x_t: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
    """The stand-in student velocity for x_t [B, C, T, H, W] at timestep [B] or [B, T], float32."""
    a, b, c, d, offset = KD_STANDIN
    x = x_t.float()
    s = timestep.detach().float().to(x.device) / 1000.0
    s = s.view(-1, 1, 1, 1, 1) if s.ndim == 1 else s[:, None, :, None, None]
    return a * x + b * torch.tanh(x) * (1.0 + s) + c * s + d * torch.sin(50.0 * s) * x + offset


def kd_standin_batch(B: int, C: int, T: int, H: int, W: int, L: int, D: int, timesteps: list[int], seed: int,
                     dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A cache batch: trajectory_latents [B, S, C, T, H, W] (a noisy-to-clean path around a random
    x0), trajectory_timesteps [B, S], real [B, C, T, H, W], text [B, L, D] and its mask."""
    g = torch.Generator("cpu").manual_seed(int(seed))
    real = torch.randn(B, C, T, H, W, generator=g)
    noise = torch.randn(B, C, T, H, W, generator=g)
    wobble = torch.randn(B, len(timesteps), C, T, H, W, generator=g)
    sigma = torch.tensor(timesteps, dtype=torch.float32).view(1, -1, 1, 1, 1, 1) / 1000.0
    path = (1 - sigma) * real[:, None] + sigma * noise[:, None] + 0.1 * sigma * wobble
    return {
        "trajectory_latents": path.to(dtype),
        "trajectory_timesteps": torch.tensor([timesteps] * B, dtype=torch.long),
        "real": real.to(dtype),
        "text_embedding": torch.randn(B, L, D, generator=g),
        "text_attention_mask": torch.ones(B, L, dtype=torch.long),
        "sample_index": torch.arange(B),
        "epoch": torch.zeros(B, dtype=torch.long),
    }
