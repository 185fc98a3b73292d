"""Sampling videos from the live student: the family's stock diffusers pipeline, a whole-clip
scheduler loop, and diffusion forcing (DFSFT).

What sample videos step with is a `SamplingSchedule` (`resolve_sampling_schedule`): by default the
model repo's own scheduler class and config (`callbacks.validation.scheduler: repo`; Wan repos ship
UniPCMultistepScheduler), or FlowMatchEulerDiscreteScheduler (`euler`), at the repo's shift unless
`callbacks.validation.sampling_flow_shift` sets one (the *sampling* shift, distinct from the
training shift `models.student.flow_shift`). Whole clips step with that scheduler, in the family's
pipeline or in `sample_with_scheduler`.

Diffusion forcing (Chen et al. 2024; SkyReels-V2): the latent frames are cut into chunks of
`chunk_size` frames (as in DFSFT training) and each chunk runs its own Euler schedule (the sigmas of
FlowMatchEulerDiscreteScheduler at the schedule's shift; a multistep scheduler is not stepped per
chunk here). Chunk `k` starts `ar_step` denoising rounds after chunk `k-1`, so earlier chunks are
always cleaner than later ones; `ar_step=None` waits until the previous chunk is clean
(chunk-by-chunk autoregression) and `ar_step=0` moves all chunks together (ordinary sampling).
Finished chunks stay in the sequence as clean context, optionally re-noised to `context_noise` (a
sigma) so that the model sees slightly noisy context, as when it was trained.

Few-step students (DMD2) sample with `few_step_sample`: at each timestep of the student's list the
model predicts the clean clip, which is re-noised with fresh noise to the next timestep's sigma
(`dmd_denoising_timesteps` gives the list, raw or warped through the training table).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from fv_accel.schedulers import FlowMatchTable, randn, scheduler_shift

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


# Keys of a flow-matching scheduler config that Euler keeps when it replaces the repo's class.
_EULER_KEYS = ("num_train_timesteps", "use_dynamic_shifting", "base_shift", "max_shift", "base_image_seq_len",
               "max_image_seq_len", "time_shift_type")


def _shift_key(cls: type) -> Optional[str]:
    """The constructor argument holding a scheduler class's static shift: `flow_shift` (UniPC and
    the other multistep solvers with flow sigmas), `shift` (flow-match Euler), or None."""
    params = inspect.signature(cls.__init__).parameters
    return next((key for key in ("flow_shift", "shift") if key in params), None)


@dataclass(frozen=True)
class SamplingSchedule:
    """The scheduler sample videos step with: a diffusers class name and its full config (defaults
    filled in, the recipe's shift applied), and where it comes from (for the log)."""

    class_name: str
    config: dict
    origin: str

    def build(self) -> Any:
        """A fresh scheduler (multistep schedulers keep state between steps: one per sample)."""
        import diffusers

        return getattr(diffusers, self.class_name).from_config(self.config)

    @property
    def dynamic(self) -> bool:
        return bool(self.config.get("use_dynamic_shifting"))

    def euler_shift(self, tokens: int) -> float:
        """The static shift of Euler steps on this schedule (the diffusion-forcing sampler's); with
        resolution-dependent shifting, the one for `tokens` transformer tokens."""
        return scheduler_shift(self.config, tokens)

    def describe(self) -> str:
        if self.dynamic:
            keys = ("base_shift", "max_shift", "base_image_seq_len", "max_image_seq_len")
            shift = "resolution-dependent shift (" + ", ".join(f"{k} {self.config.get(k)}" for k in keys) + ")"
        else:
            import diffusers

            shift = f"{_shift_key(getattr(diffusers, self.class_name)) or 'shift'} {scheduler_shift(self.config, 0):g}"
        return f"{self.class_name} at {shift} ({self.origin})"


def resolve_sampling_schedule(
    repo_config: Optional[dict],
    *,
    scheduler: str = "repo",
    shift: Optional[float] = None,
    fallback_config: Optional[dict] = None,
    origin: str = "the model repo",
) -> SamplingSchedule:
    """What sample videos step with (`callbacks.validation.scheduler` and `sampling_flow_shift`).

    `repo_config` is the repo's scheduler_config.json (None: it has none; then `fallback_config`,
    the family's default, else Euler at shift 3). `scheduler` "repo" keeps its class and config,
    "euler" swaps the class for FlowMatchEulerDiscreteScheduler at the repo's shift. A number
    `shift` replaces the shift (a static one: it turns resolution-dependent shifting off)."""
    import diffusers
    from diffusers.schedulers.scheduling_utils import SchedulerMixin

    if repo_config is None:
        repo_config = fallback_config or {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0}
        origin = f"the family's default: {origin} has no scheduler config"
    else:
        origin = f"the repo's scheduler config, {origin}"
    name = repo_config.get("_class_name")
    cls = getattr(diffusers, name, None) if isinstance(name, str) else None
    if not (isinstance(cls, type) and issubclass(cls, SchedulerMixin)):
        raise ValueError(f"{origin}: scheduler class {name!r} is not a diffusers scheduler")
    config = dict(cls.from_config({k: v for k, v in repo_config.items() if not k.startswith("_")}).config)
    if scheduler == "euler" and cls is not FlowMatchEulerDiscreteScheduler:
        euler = {k: config[k] for k in _EULER_KEYS if k in config}
        config, cls = {**euler, "shift": scheduler_shift(config, 0)}, FlowMatchEulerDiscreteScheduler
        origin = f"Euler in place of {name}, at the shift of {origin}"
    if shift is not None:
        key = _shift_key(cls)
        if key is None:
            raise ValueError(
                f"callbacks.validation.sampling_flow_shift: {shift}: {cls.__name__} ({origin}) has no shift to set; "
                "leave it null"
            )
        config = {**config, key: float(shift)}
        if "use_dynamic_shifting" in inspect.signature(cls.__init__).parameters:
            config["use_dynamic_shifting"] = False
        origin = f"{origin}; the shift from callbacks.validation.sampling_flow_shift"
    config = {k: v for k, v in dict(cls.from_config(config).config).items() if not k.startswith("_")}
    return SamplingSchedule(cls.__name__, config, origin)


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
def sample_with_scheduler(
    predict: Predictor,
    noise: torch.Tensor,
    text: Any,
    scheduler: Any,
    *,
    num_inference_steps: int,
    guidance_scale: float = 1.0,
    negative_text: Any = None,
) -> torch.Tensor:
    """Denoise the whole clip `noise` [B, C, T, H, W] with a diffusers scheduler of any class
    (Euler, UniPC, ...) as the stock video pipelines' loops do: at each of the scheduler's
    timesteps one model call (two with classifier-free guidance) with that timestep on every
    frame, then `scheduler.step`. Returns the clean latents (fp32)."""
    use_cfg = guidance_scale > 1.0 and negative_text is not None
    scheduler.set_timesteps(num_inference_steps, device=noise.device)
    x = noise.to(torch.float32).clone()
    bsz, num_frames = x.shape[0], x.shape[2]
    for t in scheduler.timesteps:
        t_in = t.to(torch.float32).expand(bsz, num_frames)
        v = predict(x, t_in, text).float()
        if use_cfg:
            v_uncond = predict(x, t_in, negative_text).float()
            v = v_uncond + guidance_scale * (v - v_uncond)
        x = scheduler.step(v, t, x, return_dict=False)[0].to(torch.float32)
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
    scheduler: Any,
    generator: torch.Generator,
) -> torch.Tensor:
    """diffusers' WanPipeline around a live transformer with `scheduler`; returns the (normalised)
    latents.

    Prompts come pre-encoded (the text encoder is not kept in memory during training); decoding
    is left to `decode_latents` so that both samplers denormalise with the student's statistics.
    """
    from diffusers import WanPipeline

    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=vae, scheduler=scheduler, transformer=transformer)
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


# ---- few-step students (distillation) ----
def few_step_schedule(sigmas: list[float], origin: str) -> SamplingSchedule:
    """The diffusers scheduler that samples a few-step student as its training rollout does: at each
    step x0 = x_t - sigma_k * v, then re-noised to the next sigma with fresh noise (FastVideo's
    DMD sampler; diffusers' FlowMatchLCMScheduler.step). `sigmas` are the student's step sigmas,
    from 1.0 down, evenly spaced (a step list evenly spaced in t, e.g. [1000, 750, 500, 250]):
    FlowMatchLCMScheduler gives them at shift 1 with `shift_terminal` the last sigma. Another
    spacing has no stock scheduler config and is a ValueError naming the sigmas."""
    k = len(sigmas)
    expected = [1.0 - i * (1.0 - sigmas[-1]) / (k - 1) for i in range(k)] if k > 1 else [1.0]
    if abs(sigmas[0] - 1.0) > 1e-6 or any(abs(a - b) > 1e-4 for a, b in zip(sigmas, expected)):
        raise ValueError(
            f"{origin}: the student's step sigmas {[round(s, 4) for s in sigmas]} are not evenly spaced from 1.0, so no "
            "stock diffusers scheduler steps them (use a step list evenly spaced in t without warp_denoising_step, "
            "e.g. [1000, 750, 500, 250])"
        )
    from diffusers import FlowMatchLCMScheduler

    config = {"num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": False,
              "shift_terminal": float(sigmas[-1]) if k > 1 else None}
    config = {k_: v for k_, v in dict(FlowMatchLCMScheduler.from_config(config).config).items() if not k_.startswith("_")}
    return SamplingSchedule("FlowMatchLCMScheduler", config, origin)


def dmd_denoising_timesteps(steps: Any, table: FlowMatchTable, warp: bool = False) -> torch.Tensor:
    """A few-step student's timesteps [K] (fp32, descending) from its step list (values in
    (0, num_train_timesteps], e.g. [1000, 750, 500, 250]): the values themselves, or with `warp`
    (FastVideo's `warp_denoising_step`) the training table's timestep at index N - value, so that
    1000 is pure noise and the others move up the shifted table (shift 3: 750 -> 900)."""
    values = torch.as_tensor(list(steps), dtype=torch.float32).flatten()
    n = table.num_train_timesteps
    if values.numel() < 1 or bool(((values <= 0) | (values > n)).any()):
        raise ValueError(f"denoising steps {values.tolist()}: each must be in (0, {n}]")
    if bool((values[1:] >= values[:-1]).any()):
        raise ValueError(f"denoising steps {values.tolist()}: must be strictly descending")
    if not warp:
        return values
    return table.warp_steps(values.round().long())


def table_sigma(timesteps: torch.Tensor, table: FlowMatchTable) -> torch.Tensor:
    """The sigma of each timestep: the training table's entry with the nearest timestep."""
    t = torch.as_tensor(timesteps, dtype=torch.float32)
    return table.nearest_sigmas(t, t.numel()).reshape(t.shape)


@torch.no_grad()
def few_step_sample(
    predict_velocity: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    noise: torch.Tensor,
    timesteps: Any,
    table: FlowMatchTable,
    generator: Any = None,
) -> torch.Tensor:
    """The few-step sampler of DMD students (FastVideo's DMD sampling) from `noise` [B, C, T, H, W]
    at `timesteps` [K] (descending, e.g. from `dmd_denoising_timesteps`); returns the clean
    latents (fp32).

    At step k the model's velocity gives the clean clip `x0 = x_k - sigma_k * v(x_k, t_k)` (sigma_k:
    the table's entry nearest t_k); before the next step it is re-noised with fresh noise,
    `x_{k+1} = (1 - sigma_{k+1}) * x0 + sigma_{k+1} * eps`, eps drawn from `generator` (one
    torch.Generator or one per sample, as `schedulers.randn`). `predict_velocity(x, t)` takes the
    per-frame timesteps t [B, T] and returns the velocity like x (the text is bound in it). One
    model call per step; K steps draw K - 1 noises."""
    if noise.ndim != 5:
        raise ValueError(f"noise must be [B, C, T, H, W], got {tuple(noise.shape)}")
    t_list = torch.as_tensor(timesteps, dtype=torch.float32).flatten()
    if t_list.numel() < 1:
        raise ValueError("few_step_sample needs at least one timestep")
    sigmas = table_sigma(t_list, table)
    x = noise.to(torch.float32).clone()
    bsz, num_frames = x.shape[0], x.shape[2]
    x0 = x
    for k in range(t_list.numel()):
        t_in = t_list[k].to(x.device).expand(bsz, num_frames)
        x0 = x - float(sigmas[k]) * predict_velocity(x, t_in).float()
        if k + 1 < t_list.numel():
            eps = randn(x.shape, generator, x.device) if generator is not None else torch.randn_like(x)
            s = float(sigmas[k + 1])
            x = (1.0 - s) * x0 + s * eps
    return x0


@torch.no_grad()
def euler_sample(
    predict_velocity: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    noise: torch.Tensor,
    num_inference_steps: int,
    shift: float = 3.0,
) -> torch.Tensor:
    """Euler flow-matching sampling of a whole clip in `num_inference_steps` model calls at sampling
    `shift` (FlowMatchEulerDiscreteScheduler through `sample_with_scheduler`); `predict_velocity`
    as in `few_step_sample`. Returns the clean latents (fp32)."""
    return sample_with_scheduler(
        lambda x, t, _text: predict_velocity(x, t), noise, None, sampling_scheduler(shift),
        num_inference_steps=num_inference_steps,
    )
