"""KV-cached autoregressive rollout of block-causal students.

Chunk by chunk (a chunk = the student's causal block of latent frames), each chunk is denoised
from its noise over the sampling steps (flow-matching Euler on diffusers' schedule at the sampling
shift, `fv_accel.sampling.sampling_sigmas`), attending to cached keys/values of the finished
chunks; when a chunk is done, one more forward of the clean chunk (re-noised to `context_noise`
if > 0, at timestep `context_noise * N`) writes its keys/values into the cache.

It gives the same video as the uncached sampler, `fv_accel.sampling.sample_diffusion_forcing`
with `ar_step=None` (chunk-by-chunk), which runs the whole sequence at every step under the
block-causal mask: finished chunks as context, the current chunk noisy, later chunks pure noise
(invisible to earlier ones). `causal_reference_sampler` wraps it with the same accounting, so
the two can be compared number for number and timed.

`iter_kv_cached_rollout` yields each chunk as soon as it is denoised (streaming generation,
`fv_accel.generate`); `kv_cached_rollout` puts its chunks together, so both give the same video.
Either steps on the sampling schedule or on an explicit sigma list (a few-step student's
scheduler), with Euler steps or, with `renoise`, the few-step sampler's re-noising.

Classifier-free guidance runs a second branch on `negative_text`, with its own cache. The only
draw from `generator` is the context noise (when `context_noise > 0`), one [B, C, T, H, W] tensor
up front, as in the uncached sampler.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

from fv_accel.models.attention import KVCache
from fv_accel.models.base import TrainingBatch
from fv_accel.sampling import chunk_bounds, sample_diffusion_forcing, sampling_sigmas


@dataclass
class RolloutResult:
    latents: torch.Tensor  # [B, C, T, H, W], fp32
    seconds: float
    forward_calls: int
    forward_frames: int  # latent frames x batch that went through the transformer


class _CountingPredictor:
    """The student as a `sampling.Predictor`, counting its work."""

    def __init__(self, student: Any):
        if getattr(student, "causal_attention", None) is None:
            raise ValueError("autoregressive rollout needs a block-causal student (models.student.causal: true)")
        self.student = student
        self.calls = 0
        self.frames = 0

    def __call__(self, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.frames += x.shape[0] * x.shape[2]
        return self.student.predict_noise(x, t, TrainingBatch(encoder_hidden_states=text), conditional=True)


def _check_guidance(guidance_scale: float, negative_text: Optional[torch.Tensor]) -> bool:
    if guidance_scale > 1.0 and negative_text is None:
        raise ValueError("guidance_scale > 1 needs negative_text (e.g. the empty prompt's embedding)")
    return guidance_scale > 1.0


@torch.no_grad()
def causal_reference_sampler(
    student: Any,
    noise: torch.Tensor,
    text: torch.Tensor,
    *,
    num_steps: int,
    shift: float,
    guidance_scale: float = 1.0,
    negative_text: Optional[torch.Tensor] = None,
    context_noise: float = 0.0,
    generator: Optional[torch.Generator] = None,
) -> RolloutResult:
    """Uncached chunk-by-chunk sampling: the full sequence through the causal student every step."""
    _check_guidance(guidance_scale, negative_text)
    predict = _CountingPredictor(student)
    start = time.perf_counter()
    latents = sample_diffusion_forcing(
        predict,
        noise,
        text,
        chunk_size=student.causal_block_size,
        num_inference_steps=num_steps,
        shift=shift,
        guidance_scale=guidance_scale,
        negative_text=negative_text,
        ar_step=None,
        context_noise=context_noise,
        generator=generator,
    )
    return RolloutResult(latents, time.perf_counter() - start, predict.calls, predict.frames)


@dataclass
class RolloutChunk:
    """One finished chunk of a streamed rollout."""

    start: int  # latent frames [start, end) of the video
    end: int
    latents: torch.Tensor  # [B, C, end - start, H, W], fp32
    cached_frames: int  # latent frames the (conditional) KV cache holds once this chunk is written


def explicit_schedule(sigmas: Any, num_train: int = 1000) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(sigmas [S+1] ending at 0, timesteps [S], num_train_timesteps) of a given sigma list: a
    scheduler's own (e.g. a few-step student's `scheduler.sigmas` after `set_timesteps`)."""
    sigmas = torch.as_tensor(sigmas, dtype=torch.float32).flatten().clone()
    if sigmas.numel() < 2 or float(sigmas[-1]) != 0.0 or bool((sigmas[1:] >= sigmas[:-1]).any()):
        raise ValueError(f"sigmas {sigmas.tolist()}: need a strictly descending list ending at 0")
    return sigmas, sigmas[:-1] * num_train, num_train


def _cached_frames(cache: KVCache, tokens_per_frame: int) -> int:
    segments = cache.segments.get(0, [])
    return sum(k.shape[2] // tokens_per_frame for _, k, _ in segments)


@torch.no_grad()
def iter_kv_cached_rollout(
    student: Any,
    noise: torch.Tensor,
    text: torch.Tensor,
    *,
    num_steps: int = 0,
    shift: float = 3.0,
    guidance_scale: float = 1.0,
    negative_text: Optional[torch.Tensor] = None,
    context_noise: float = 0.0,
    generator: Optional[torch.Generator] = None,
    sigmas: Optional[Any] = None,
    renoise: bool = False,
    predictor: Optional[_CountingPredictor] = None,
    timesteps: Optional[Any] = None,
    context_timestep: Optional[float] = None,
) -> Iterator[RolloutChunk]:
    """The KV-cached rollout, yielding each chunk as soon as it is denoised (before its keys/values
    are written, so a consumer can decode it while nothing else waits on it).

    Steps: Euler `x += (sigma_next - sigma) * v` on the sampling schedule (`num_steps` at `shift`),
    or on an explicit `sigmas` list [S+1] ending at 0 (`explicit_schedule`). With `renoise` (a
    few-step student's sampler, diffusers' FlowMatchLCMScheduler.step) each step predicts the clean
    chunk `x0 = x - sigma * v` and re-noises it to the next sigma with fresh noise drawn from
    `generator` (after the context noise); the last step returns x0. `predictor` (a
    `_CountingPredictor` of `student`) counts the work for the caller. With explicit `sigmas`, the
    model's `timesteps` [S] may be given too (a distilled student's own step values, e.g. 750 where
    its table's sigma is 0.7503), else sigma * N; `context_timestep` is the timestep the refresh
    forward is given (else context_noise * N)."""
    if noise.ndim != 5:
        raise ValueError(f"noise must be [B, C, T, H, W], got {tuple(noise.shape)}")
    if not 0.0 <= context_noise < 1.0:
        raise ValueError(f"context_noise must be a sigma in [0, 1), got {context_noise}")
    guided = _check_guidance(guidance_scale, negative_text)
    predict = predictor or _CountingPredictor(student)
    controller = student.causal_attention
    if sigmas is None:
        sigmas, timesteps, num_train = sampling_sigmas(num_steps, shift)
    else:
        sigmas, derived, num_train = explicit_schedule(sigmas)
        timesteps = derived if timesteps is None else torch.as_tensor(timesteps, dtype=torch.float32).flatten()
        if timesteps.numel() != derived.numel():
            raise ValueError(f"timesteps {timesteps.tolist()}: one per step of sigmas {sigmas.tolist()}")
    if context_timestep is None:
        context_timestep = context_noise * num_train
    steps = timesteps.numel()
    x_all = noise.to(torch.float32).clone()
    bsz = x_all.shape[0]
    context_eps = None
    if context_noise > 0:
        context_eps = torch.randn(x_all.shape, generator=generator, device=x_all.device, dtype=torch.float32)
    branches = [(text, KVCache())] + ([(negative_text, KVCache())] if guided else [])
    chunks = chunk_bounds(x_all.shape[2], student.causal_block_size)
    p_h, p_w = student.patch_size[1], student.patch_size[2]
    tokens_per_frame = (x_all.shape[3] // p_h) * (x_all.shape[4] // p_w)

    for k, (start, end) in enumerate(chunks):
        x = x_all[:, :, start:end]
        for i in range(steps):
            t = timesteps[i].to(x.device).expand(bsz, end - start)
            outs = []
            for branch_text, cache in branches:
                with controller.kv_cache(cache, start):
                    outs.append(predict(x, t, branch_text).float())
            v = outs[0] if not guided else outs[1] + guidance_scale * (outs[0] - outs[1])
            if not renoise:
                x = x + (sigmas[i + 1] - sigmas[i]).to(x.device) * v
                continue
            x = x - sigmas[i].to(x.device) * v
            if i + 1 < steps:
                eps = torch.randn(x.shape, generator=generator, device=x.device, dtype=torch.float32)
                x = (1.0 - sigmas[i + 1].to(x.device)) * x + sigmas[i + 1].to(x.device) * eps
        x_all[:, :, start:end] = x
        if k + 1 < len(chunks):
            # Refresh: the finished chunk, as later chunks see it, writes its keys/values.
            context = x
            if context_eps is not None:
                context = (1.0 - context_noise) * x + context_noise * context_eps[:, :, start:end]
            t = torch.full((bsz, end - start), float(context_timestep), device=x.device)
            for branch_text, cache in branches:
                with controller.kv_cache(cache, start, write=True):
                    predict(context, t, branch_text)
        yield RolloutChunk(start, end, x, _cached_frames(branches[0][1], tokens_per_frame))


@torch.no_grad()
def kv_cached_rollout(
    student: Any,
    noise: torch.Tensor,
    text: torch.Tensor,
    *,
    num_steps: int = 0,
    shift: float = 3.0,
    guidance_scale: float = 1.0,
    negative_text: Optional[torch.Tensor] = None,
    context_noise: float = 0.0,
    generator: Optional[torch.Generator] = None,
    sigmas: Optional[Any] = None,
    renoise: bool = False,
    timesteps: Optional[Any] = None,
    context_timestep: Optional[float] = None,
) -> RolloutResult:
    """Chunk-by-chunk sampling with a KV cache of the finished chunks (same video, less work): the
    chunks of `iter_kv_cached_rollout`, put together."""
    start_time = time.perf_counter()
    predict = _CountingPredictor(student)
    latents = noise.to(torch.float32).clone()
    for chunk in iter_kv_cached_rollout(
        student, noise, text, num_steps=num_steps, shift=shift, guidance_scale=guidance_scale,
        negative_text=negative_text, context_noise=context_noise, generator=generator, sigmas=sigmas,
        renoise=renoise, predictor=predict, timesteps=timesteps, context_timestep=context_timestep,
    ):
        latents[:, :, chunk.start : chunk.end] = chunk.latents
    return RolloutResult(latents, time.perf_counter() - start_time, predict.calls, predict.frames)
