"""What reward training samples with: the prompt rows of a sampling batch (DiffusionNFT's K-repeat
choice) and the policy's sampler over a role's `predict_noise` (Euler `ode` or `sde_reflow`).

Every draw is FastVideo 0.2.1's, in its order, from the generator given: the start noise and each
re-noising noise drawn in FastVideo's [B, T, C, H, W] layout and permuted to ours [B, C, T, H, W].
The schedule is diffusers' `FlowMatchEulerDiscreteScheduler.set_timesteps` over a table that is
already shifted, so the low end is shifted twice (shift 3, 4 steps: 1000, 857.7, 602.2, 8.93), as
FastVideo's sampler schedules it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from fv_accel.models.base import ModelBase, TrainingBatch
from fv_accel.schedulers import randn


def k_repeat_rows(
    rows: Sequence[int], *, batch_size: int, repeats: int, world_size: int, rank: int, seed: int
) -> list[int]:
    """The rows of this rank's sampling batch: `world_size * batch_size / repeats` distinct rows
    drawn from `rows` (a permutation seeded with `seed`), each repeated `repeats` times, the
    repeats shuffled and cut into one slice per rank (DiffusionNFT's distributed K-repeat sampler;
    the same on every rank, so a prompt's copies spread over the processes)."""
    total = world_size * batch_size
    if total % repeats:
        raise ValueError(
            f"method.num_video_per_prompt {repeats} must divide the processes x method.sample_train_batch_size "
            f"({world_size} x {batch_size} = {total})"
        )
    unique = total // repeats
    if unique > len(rows):
        raise ValueError(
            f"a sampling batch takes {unique} distinct prompts but the dataset has {len(rows)} trainable rows: "
            "lower method.sample_train_batch_size or raise method.num_video_per_prompt"
        )
    g = torch.Generator().manual_seed(int(seed))
    chosen = [rows[i] for i in torch.randperm(len(rows), generator=g)[:unique].tolist()]
    repeated = [r for r in chosen for _ in range(repeats)]
    order = torch.randperm(len(repeated), generator=g).tolist()
    shuffled = [int(repeated[i]) for i in order]
    return shuffled[rank * batch_size : (rank + 1) * batch_size]


def randn_fastvideo(shape: Sequence[int], generator: Any, device: torch.device) -> torch.Tensor:
    """Noise for latents [B, C, T, H, W], drawn as FastVideo draws it ([B, T, C, H, W])."""
    b, c, t, h, w = shape
    return randn((b, t, c, h, w), generator, device).permute(0, 2, 1, 3, 4)


@dataclass
class SamplingSchedule:
    timesteps: torch.Tensor  # [S] float32, the values the model is given
    sigmas: torch.Tensor  # [S + 1] float32, the last 0


def sampling_schedule(shift: float, spec: Any, device: torch.device) -> SamplingSchedule:
    """The schedule of `method.sampling` (num_steps, or its timesteps / sigmas) for a table of `shift`."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=float(shift), use_dynamic_shifting=False)
    kwargs: dict[str, Any] = {"device": device}
    if spec.timesteps is not None:
        kwargs["timesteps"] = list(spec.timesteps)
    if spec.sigmas is not None:
        kwargs["sigmas"] = list(spec.sigmas)
    kwargs["num_inference_steps"] = spec.schedule_length()
    scheduler.set_timesteps(**kwargs)
    return SamplingSchedule(scheduler.timesteps.to(device, torch.float32), scheduler.sigmas.to(device, torch.float32))


@torch.no_grad()
def sample_policy(
    role: ModelBase, tb: TrainingBatch, shape: Sequence[int], schedule: SamplingSchedule, trajectory: str,
    generator: Any, *, predict: Optional[Any] = None,
) -> torch.Tensor:
    """Clean latents [B, C, T, H, W] of `role` from pure noise along `schedule`: `ode` steps Euler on
    the velocity (x += (sigma_next - sigma) * v, in fp32); `sde_reflow` predicts x0 at each step and
    noises it to the next step's level with fresh noise (the training table's entry nearest to it),
    returning the last x0. `predict(role, x, t, tb)` replaces `role.predict_noise` where given."""
    device = tb.conditioning.text.device if tb.conditioning.text is not None else None
    current = randn_fastvideo(shape, generator, device)
    batch = current.shape[0]
    k = tb.conditioning.clean_frames

    def velocity(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        t_in = t.reshape(1).expand(batch).contiguous()
        if k:  # image-to-video by frame replacement: the condition frames go in clean, at timestep 0
            x, t_in = with_clean_condition(x, t_in, tb.conditioning)
        if predict is not None:
            return predict(role, x, t_in, tb)
        return role.predict_noise(x, t_in, tb, conditional=True, attn_kind="dense")

    timesteps = schedule.timesteps
    if trajectory == "ode":
        for i, t in enumerate(timesteps):
            v = velocity(current, t)
            dt = schedule.sigmas[i + 1] - schedule.sigmas[i]
            current = (current.float() + dt * v).to(v.dtype)
        return with_clean_condition(current, None, tb.conditioning)[0] if k else current
    table = role.training_table(current.shape)
    x0 = current
    for i, t in enumerate(timesteps):
        v = velocity(current, t)
        x0 = table.x0_from_velocity(current, v, t.reshape(1).expand(batch))
        if i < len(timesteps) - 1:
            noise = randn_fastvideo(shape, generator, device)
            current = table.add_noise_at(x0, noise, timesteps[i + 1].reshape(1))
    return with_clean_condition(x0, None, tb.conditioning)[0] if k else x0


# Where an image-to-video conditioning keeps the clean latent frames of its condition.
CLEAN_CONDITION = "clean_condition"


def with_clean_condition(x: torch.Tensor, t: Optional[torch.Tensor], cond: Any) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """x [B, C, T, H, W] with its first `cond.clean_frames` frames replaced by the clean condition,
    and the timestep [B] made per frame [B, T] with 0 on those frames (as the family's
    image-to-video pipeline feeds them)."""
    k = cond.clean_frames
    clean = cond.extras[CLEAN_CONDITION].to(x.dtype)
    x = torch.cat([clean, x[:, :, k:]], dim=2)
    if t is None:
        return x, None
    per_frame = t.float().reshape(-1, 1).expand(x.shape[0], x.shape[2]).clone()
    per_frame[:, :k] = 0.0
    return x, per_frame
