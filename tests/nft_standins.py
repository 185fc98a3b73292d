"""Stand-ins for the DiffusionNFT parity test, shared by both sides: the golden generator
(tests/fastvideo_reference/make_nft_golden.py, which runs FastVideo 0.2.1's own DiffusionNFTMethod)
and fv_accel's NFT parity test. They replace what needs weights or a GPU (the role transformers, the
VAE decode, the reward models, the prompt dataset) by deterministic functions, so that what is
compared is the method's math: prompt selection, sampling, rewards, advantages, the NFT loss, the
optimizer steps and the old-policy update. Layout here is fv_accel's [B, C, T, H, W].

A role's prediction is `nft_standin_predict(role, x_t, timestep, w)`: the policy roles (student and
old) share the "policy" coefficients, the reference has its own; `w` is the role model's one
trainable parameter (shape [1], initial value W_INIT), so that training moves the student's
prediction and the old policy's decay and the optimizer's state matter. The core is elementwise,
nonlinear in x_t and steep in the timestep (the sin(50 s) term), with s = t / 1000 per sample: a
timestep of B values (FastVideo's `_training_timestep_loss` gives each sample its own) gives sample b
the value t_b, a timestep of one value is used for every sample."""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Initial value of the one parameter `w` of every role's transformer (student, old and reference).
W_INIT = 0.1

# role -> (a, b, c, d, offset); conditional branch only:
# core = a * x + b * tanh(x) * (1 + s) + c * s + d * sin(50 s) * x + offset
NFT_STANDIN_COEFFICIENTS = {
    "policy": (0.85, 0.30, 0.55, 0.25, 0.04),
    "reference": (1.05, -0.20, 0.70, -0.15, -0.02),
}

# FastVideo's DiffusionNFT accepts only the reward names pickscore and clipscore; the golden run
# registers the stand-in rewards under them: FastVideo name -> stand-in reward.
FASTVIDEO_REWARD_NAMES = {"pickscore": "r_mean", "clipscore": "r_first"}


def nft_standin_timestep_fraction(timestep: torch.Tensor, batch_size: int) -> torch.Tensor:
    """s = t / 1000 as a float32 [B, 1, 1, 1, 1] (CPU) tensor: per sample for a timestep of
    `batch_size` values, the one value for every sample for a timestep of one value."""
    t = timestep.detach().float().reshape(-1).cpu()
    if t.numel() == batch_size:
        s = t / 1000.0
    elif t.numel() == 1:
        s = (t / 1000.0).expand(batch_size)
    else:
        raise ValueError(f"stand-in timestep of {t.numel()} values for a batch of {batch_size}")
    return s.reshape(batch_size, 1, 1, 1, 1)


def nft_standin_predict(role: str, x_t: torch.Tensor, timestep: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The stand-in flow prediction of `role` ("policy" or "reference") for x_t [B, C, T, H, W],
    float32: core(role, x_t, s) + w * (1 + tanh(x_t)). Differentiable in `w` (and x_t)."""
    if role not in NFT_STANDIN_COEFFICIENTS:
        raise ValueError(f"stand-in role {role!r}: expected one of {sorted(NFT_STANDIN_COEFFICIENTS)}")
    a, b, c, d, offset = NFT_STANDIN_COEFFICIENTS[role]
    x = x_t.float()
    s = nft_standin_timestep_fraction(timestep, x.shape[0]).to(x.device)
    tanh_x = torch.tanh(x)
    core = a * x + b * tanh_x * (1.0 + s) + c * s + d * torch.sin(50.0 * s) * x + offset
    return core + w.to(device=x.device, dtype=x.dtype) * (1.0 + tanh_x)


def nft_standin_media(latents_bcthw: torch.Tensor) -> torch.Tensor:
    """The stand-in decode: sigmoid(latents) as contiguous float32 media [B, C, T, H, W] in (0, 1)."""
    return torch.sigmoid(latents_bcthw.float()).contiguous()


# The rewards reduce a contiguous float64 copy of the media and return float32, so that their values do
# not depend on the memory layout (the strides) of the media they are given.
def nft_reward_r_mean(media: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
    """[B] float32: media_b.mean() * (1 + (len(prompt_b) % 5) / 10) + media_b[:, -1].std() (unbiased,
    over the last frame's C x H x W values), media [B, C, T, H, W]; computed in float64."""
    m = media.detach().contiguous().double()
    scores = [
        m[b].mean() * (1.0 + (len(prompts[b]) % 5) / 10.0) + m[b][:, -1].contiguous().std()
        for b in range(m.shape[0])
    ]
    return torch.stack(scores).float()


def nft_reward_r_first(media: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
    """[B] float32: media_b[:, 0].mean(), the first frame's mean, media [B, C, T, H, W]; computed in float64."""
    del prompts
    m = media.detach().contiguous().double()
    return torch.stack([m[b][:, 0].contiguous().mean() for b in range(m.shape[0])]).float()


NFT_STANDIN_REWARDS = {"r_mean": nft_reward_r_mean, "r_first": nft_reward_r_first}

# Captions of different lengths: len 9, 13, 12, 31, 15, so len % 5 = 4, 3, 2, 1, 0 (the r_mean
# factor differs per prompt).
_CAPTIONS = (
    "a red fox",
    "waves at dusk",
    "a cat sleeps",
    "two cats sleeping on a warm mat",
    "ducks on a pond",
)


def nft_standin_rows(num_rows: int, L: int, D: int, seed: int) -> list[dict]:
    """The stand-in prompt dataset: row i is {"caption": str, "text_embedding": float32 [L, D]},
    the embeddings drawn in row order from torch.Generator("cpu").manual_seed(seed) with torch.randn."""
    if not 1 <= num_rows <= len(_CAPTIONS):
        raise ValueError(f"num_rows must be in [1, {len(_CAPTIONS)}]")
    g = torch.Generator("cpu").manual_seed(int(seed))
    return [
        {"caption": _CAPTIONS[i], "text_embedding": torch.randn(L, D, generator=g, dtype=torch.float32)}
        for i in range(num_rows)
    ]
