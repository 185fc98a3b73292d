"""Stand-in role predictions for the DMD2 parity test, shared by both sides: the golden generator
(tests/fastvideo_reference/make_dmd2_golden.py, which runs FastVideo 0.2.1's own DMD2Method) and
tests/test_dmd2_parity.py (which runs fv_accel's). Replacing the transformers by one deterministic
function of (role, x_t, timestep, branch) isolates the method's math: noise, timesteps, rollout,
noising, x0 conversion, guidance and losses. Layout here is fv_accel's [B, C, T, H, W].

The prediction is elementwise, so it does not depend on the layout; it is nonlinear in x_t, differs
between roles and between the conditional and unconditional branches, and depends steeply on the
timestep the model is given (the sin(50 s) term), so that giving the model another value than
FastVideo does (the table entry nearest to it, say) moves the losses well past the test's tolerance."""

from __future__ import annotations

import torch

# role -> (a, b, c, d, offset):
# a * x + b * tanh(x) * (1 + s) + c * s * (+1 cond / -1 uncond) + d * sin(50 s) * x + offset
STANDIN_COEFFICIENTS = {
    "student": (0.90, 0.35, 0.60, 0.30, 0.05),
    "teacher": (1.10, -0.25, 0.80, -0.20, -0.03),
    "critic": (0.70, 0.45, -0.50, 0.25, 0.02),
}


def standin_timestep_fraction(timestep: torch.Tensor) -> torch.Tensor:
    """s = t / 1000 from the first element of the timestep the model is given (FastVideo passes
    one [1] tensor, long or float; a [B] tensor of equal values gives the same s)."""
    return timestep.detach().float().reshape(-1)[0].cpu() / 1000.0


def standin_predict_noise(role: str, x_t: torch.Tensor, timestep: torch.Tensor, conditional: bool) -> torch.Tensor:
    """The stand-in flow prediction of `role` for x_t [B, C, T, H, W] at `timestep`, float32."""
    if role not in STANDIN_COEFFICIENTS:
        raise ValueError(f"stand-in role {role!r}: expected one of {sorted(STANDIN_COEFFICIENTS)}")
    a, b, c, d, offset = STANDIN_COEFFICIENTS[role]
    x = x_t.float()
    s = standin_timestep_fraction(timestep).to(x.device)
    branch = 1.0 if conditional else -1.0
    return a * x + b * torch.tanh(x) * (1.0 + s) + (c * branch) * s + d * torch.sin(50.0 * s) * x + offset


def standin_batch(B: int, C: int, T: int, H: int, W: int, L: int, D: int, seed: int) -> dict[str, torch.Tensor]:
    """A dataloader batch in fv_accel's keys, drawn from its own generator: vae_latent [B, C, T, H, W]
    (already "normalised": used as is), text_embedding [B, L, D], an all-ones text mask."""
    g = torch.Generator("cpu").manual_seed(int(seed))
    vae_latent = torch.randn(B, C, T, H, W, generator=g, dtype=torch.float32)
    text_embedding = torch.randn(B, L, D, generator=g, dtype=torch.float32)
    return {
        "vae_latent": vae_latent,
        "text_embedding": text_embedding,
        "text_attention_mask": torch.ones(B, L, dtype=torch.long),
        "sample_index": torch.arange(B),
        "epoch": torch.zeros(B, dtype=torch.long),
    }
