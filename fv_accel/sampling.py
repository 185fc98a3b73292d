"""Sampling videos from the live student: diffusers' WanPipeline (SFT) and diffusion forcing (DFSFT).

Both samplers use the same sigma schedule: diffusers' `FlowMatchEulerDiscreteScheduler` built with
the *sampling* shift (`callbacks.validation.sampling_flow_shift`, distinct from the training shift
`models.student.flow_shift`) and `set_timesteps(num_inference_steps)`.

Diffusion forcing (Chen et al. 2024; SkyReels-V2): the latent frames are cut into chunks of
`chunk_size` frames (as in DFSFT training) and each chunk runs its own Euler schedule. Chunk `k`
starts `ar_step` denoising rounds after chunk `k-1`, so earlier chunks are always cleaner than
later ones; `ar_step=None` waits until the previous chunk is clean (chunk-by-chunk autoregression)
and `ar_step=0` moves all chunks together (ordinary sampling). Finished chunks stay in the
sequence as clean context, optionally re-noised to `context_noise` (a sigma) so that the model
sees slightly noisy context, as when it was trained.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

# predict(x [B, C, T, H, W], per-frame timesteps [B, T], text [B, L, D]) -> velocity like x
Predictor = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sampling_scheduler(shift: float, num_train_timesteps: int = 1000) -> FlowMatchEulerDiscreteScheduler:
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=num_train_timesteps, shift=float(shift))


def sampling_sigmas(num_inference_steps: int, shift: float) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(sigmas [S+1] ending at 0, timesteps [S], num_train_timesteps) of the sampling schedule."""
    scheduler = sampling_scheduler(shift)
    scheduler.set_timesteps(num_inference_steps, device="cpu")
    sigmas = scheduler.sigmas.to(torch.float32).clone()
    timesteps = scheduler.timesteps.to(torch.float32).clone()
    return sigmas, timesteps, int(scheduler.config.num_train_timesteps)


def chunk_bounds(num_frames: int, chunk_size: int) -> list[tuple[int, int]]:
    """[start, end) latent frames of each chunk; chunks start at frame 0, the last may be shorter."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return [(s, min(s + chunk_size, num_frames)) for s in range(0, num_frames, chunk_size)]


def diffusion_forcing_schedule(num_chunks: int, num_inference_steps: int, ar_step: Optional[int]) -> torch.Tensor:
    """Step index of every chunk at every round: [R, K] long.

    Round `r` moves chunk `k` from step `r - k * a` to the next (a = `ar_step`, or the number of
    steps for chunk-by-chunk sampling). A value < 0 means the chunk has not started (pure noise)
    and a value >= `num_inference_steps` means it is finished (clean context). Every round moves
    at least one chunk; R = S + (K - 1) * a.
    """
    steps = int(num_inference_steps)
    if steps < 1:
        raise ValueError(f"num_inference_steps must be >= 1, got {num_inference_steps}")
    if ar_step is not None and ar_step < 0:
        raise ValueError(f"ar_step must be >= 0 or None, got {ar_step}")
    offset = steps if ar_step is None else min(int(ar_step), steps)
    rounds = steps + (num_chunks - 1) * offset
    r = torch.arange(rounds)[:, None]
    k = torch.arange(num_chunks)[None, :]
    return r - k * offset


@torch.no_grad()
def sample_diffusion_forcing(
    predict: Predictor,
    noise: torch.Tensor,
    text: torch.Tensor,
    *,
    chunk_size: int,
    num_inference_steps: int,
    shift: float,
    guidance_scale: float = 1.0,
    negative_text: Optional[torch.Tensor] = None,
    ar_step: Optional[int] = None,
    context_noise: float = 0.0,
    generator: Optional[torch.Generator] = None,
    causal: bool = False,
) -> torch.Tensor:
    """Denoise `noise` [B, C, T, H, W] chunk by chunk; returns the clean latents (fp32).

    Each round calls the model once on the sequence with per-frame timesteps (twice with
    classifier-free guidance) and takes one Euler step `x += (sigma_next - sigma) * v` on the
    frames of the chunks that move this round; other frames are left as they are. A bidirectional
    model sees the whole sequence, chunks not yet started as pure noise (as in DFSFT training);
    a block-causal one (`causal=True`) only the frames up to the last started chunk, since later
    frames cannot change its output. The only draw from `generator` is the context noise (when
    `context_noise > 0`), made once up front.
    """
    if noise.ndim != 5:
        raise ValueError(f"noise must be [B, C, T, H, W], got {tuple(noise.shape)}")
    if not 0.0 <= context_noise < 1.0:
        raise ValueError(f"context_noise must be a sigma in [0, 1), got {context_noise}")
    use_cfg = guidance_scale > 1.0 and negative_text is not None
    sigmas, timesteps, n_train = sampling_sigmas(num_inference_steps, shift)
    sigmas, timesteps = sigmas.to(noise.device), timesteps.to(noise.device)
    bsz, num_frames = noise.shape[0], noise.shape[2]
    bounds = chunk_bounds(num_frames, chunk_size)
    frame_chunk = torch.tensor([k for k, (s, e) in enumerate(bounds) for _ in range(s, e)], device=noise.device)
    schedule = diffusion_forcing_schedule(len(bounds), num_inference_steps, ar_step).to(noise.device)
    steps = int(num_inference_steps)

    x = noise.to(torch.float32).clone()
    ctx_eps = None
    if context_noise > 0:
        ctx_eps = torch.randn(x.shape, generator=generator, device=x.device, dtype=torch.float32)
    ctx_sigma = torch.tensor(float(context_noise), device=x.device)

    for chunk_steps in schedule:
        frame_steps = chunk_steps[frame_chunk]  # [T]
        done = frame_steps >= steps
        idx = frame_steps.clamp(0, steps - 1)
        sigma_now = torch.where(done, ctx_sigma, sigmas[idx])
        t_frames = torch.where(done, ctx_sigma * n_train, timesteps[idx])
        model_in = x
        if ctx_eps is not None and bool(done.any()):
            s = sigma_now[None, None, :, None, None]
            noised = (1.0 - s) * x + s * ctx_eps
            model_in = torch.where(done[None, None, :, None, None], noised, x)
        t_in = t_frames[None].expand(bsz, -1)
        end = num_frames
        if causal:
            end = int((frame_steps >= 0).nonzero().max()) + 1
            model_in, t_in = model_in[:, :, :end], t_in[:, :end]
        v = predict(model_in, t_in, text).float()
        if use_cfg:
            v_uncond = predict(model_in, t_in, negative_text).float()
            v = v_uncond + guidance_scale * (v - v_uncond)
        if end < num_frames:
            v = torch.cat([v, v.new_zeros(*v.shape[:2], num_frames - end, *v.shape[3:])], dim=2)
        moving = (frame_steps >= 0) & ~done
        dt = torch.where(moving, sigmas[(idx + 1).clamp(max=steps)] - sigmas[idx], torch.zeros_like(sigma_now))
        x = x + dt[None, None, :, None, None] * v
    return x


@torch.no_grad()
def sample_wan_pipeline(
    transformer: torch.nn.Module,
    vae: torch.nn.Module,
    prompt_embeds: torch.Tensor,
    *,
    negative_prompt_embeds: Optional[torch.Tensor],
    height: int,
    width: int,
    num_frames: int,
    num_inference_steps: int,
    guidance_scale: float,
    shift: float,
    generator: torch.Generator,
) -> torch.Tensor:
    """diffusers' WanPipeline around a live transformer; returns the (normalised) latents.

    Prompts come pre-encoded (the text encoder is not kept in memory during training); decoding
    is left to `decode_latents` so that both samplers denormalise with the student's statistics.
    """
    from diffusers import WanPipeline

    pipe = WanPipeline(
        tokenizer=None,
        text_encoder=None,
        vae=vae,
        scheduler=sampling_scheduler(shift),
        transformer=transformer,
    )
    return pipeline_latents(
        pipe,
        prompt_embeds,
        negative_prompt_embeds,
        height=height,
        width=width,
        num_frames=num_frames,
        num_inference_steps=num_inference_steps,
        guidance_scale=guidance_scale,
        generator=generator,
    )


@torch.no_grad()
def pipeline_latents(
    pipe,
    prompt_embeds: torch.Tensor,
    negative_prompt_embeds: Optional[torch.Tensor],
    *,
    height: int,
    width: int,
    num_frames: int,
    num_inference_steps: int,
    guidance_scale: float,
    generator: torch.Generator,
    **call,
) -> torch.Tensor:
    """A diffusers video pipeline's latents (no decoding) for pre-encoded prompts; the negative
    prompt only with guidance. `call` passes the pipeline's own inputs (e.g. `image`)."""
    pipe.set_progress_bar_config(disable=True)
    out = pipe(
        prompt_embeds=prompt_embeds,
        negative_prompt_embeds=negative_prompt_embeds if guidance_scale > 1.0 else None,
        height=height,
        width=width,
        num_frames=num_frames,
        num_inference_steps=num_inference_steps,
        guidance_scale=guidance_scale,
        generator=generator,
        output_type="latent",
        return_dict=False,
        **call,
    )[0]
    return out.float()


@torch.no_grad()
def decode_latents(
    vae: torch.nn.Module,
    latents: torch.Tensor,
    latents_mean: Optional[torch.Tensor] = None,
    latents_std: Optional[torch.Tensor] = None,
    decode: Any = None,
) -> np.ndarray:
    """Normalised latents [B, C, T, H, W] -> uint8 video [B, F, H, W, 3]. `decode(vae, raw)` maps raw
    latents to [B, 3, F, H, W] in [-1, 1] (a family's `decode`; default `vae.decode`)."""
    if latents_mean is None and getattr(vae.config, "latents_mean", None) is not None:
        latents_mean = torch.tensor(vae.config.latents_mean, dtype=torch.float32).view(1, -1, 1, 1, 1)
        latents_std = torch.tensor(vae.config.latents_std, dtype=torch.float32).view(1, -1, 1, 1, 1)
    vae_param = next(vae.parameters())
    z = latents.to(vae_param.device, torch.float32)
    if latents_mean is not None:
        z = z * latents_std.to(z.device) + latents_mean.to(z.device)
    z = z.to(vae_param.dtype)
    video = vae.decode(z, return_dict=False)[0] if decode is None else decode(vae, z)  # [B, 3, F, H, W] in [-1, 1]
    video = ((video.float().clamp(-1, 1) + 1.0) * 127.5).round().to(torch.uint8)
    return video.permute(0, 2, 3, 4, 1).cpu().numpy()


def latent_frames(num_frames: int, temporal_factor: int = 4) -> int:
    """Latent frames of a clip of `num_frames` (4k+1) frames for the Wan VAE."""
    return (num_frames - 1) // temporal_factor + 1


def num_rounds(num_frames_latent: int, chunk_size: int, num_inference_steps: int, ar_step: Optional[int]) -> int:
    """Model calls (per guidance branch) the diffusion-forcing sampler makes."""
    chunks = math.ceil(num_frames_latent / chunk_size)
    return int(diffusion_forcing_schedule(chunks, num_inference_steps, ar_step).shape[0])
