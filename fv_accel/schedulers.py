"""Flow-matching scheduler adapter: the one place that knows sigmas and timesteps.

Built on diffusers' `FlowMatchEulerDiscreteScheduler` (no dynamic shifting). Index 0 of the table
is pure noise (sigma 1, t 1000); index N-1 is the cleanest (REFERENCE.md section 1).

Random draws accept either one `torch.Generator` (the rank's stream) or a list with one generator
per sample (the `noise_rng: sample` mode, where every sample's draws depend only on its own key).
"""

from __future__ import annotations

import math
from typing import Sequence, Union

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.training_utils import compute_density_for_timestep_sampling

GeneratorLike = Union[torch.Generator, Sequence[torch.Generator]]


def _per_sample(generator: GeneratorLike) -> bool:
    return not isinstance(generator, torch.Generator)


def randn(shape: Sequence[int], generator: GeneratorLike, device: torch.device) -> torch.Tensor:
    """Standard normal noise of `shape` ([B, ...]) in fp32."""
    if not _per_sample(generator):
        return torch.randn(tuple(shape), generator=generator, device=device, dtype=torch.float32)
    if len(generator) != shape[0]:
        raise ValueError(f"{len(generator)} per-sample generators for a batch of {shape[0]}")
    return torch.cat(
        [torch.randn((1, *shape[1:]), generator=g, device=device, dtype=torch.float32) for g in generator]
    )


def randint(low: int, high: int, shape: Sequence[int], generator: GeneratorLike, device: torch.device) -> torch.Tensor:
    if not _per_sample(generator):
        return torch.randint(low, high, tuple(shape), generator=generator, device=device)
    return torch.cat([torch.randint(low, high, (1, *shape[1:]), generator=g, device=device) for g in generator])


def calculate_shift(tokens: int, base_seq_len: int, max_seq_len: int, base_shift: float, max_shift: float) -> float:
    """diffusers' `mu` of resolution-dependent shifting: linear in the token count."""
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return tokens * slope + (base_shift - slope * base_seq_len)


def scheduler_shift(config: dict, tokens: int) -> float:
    """The static shift a flow-matching scheduler config applies to latents of `tokens` tokens.

    With `use_dynamic_shifting`, diffusers maps sigma to exp(mu) / (exp(mu) + 1/sigma - 1) (the
    exponential time shift), which is the static map shift * s / (1 + (shift - 1) * s) with
    shift = exp(mu)."""
    if config.get("use_dynamic_shifting"):
        if config.get("time_shift_type", "exponential") != "exponential":
            raise ValueError(f"scheduler time_shift_type {config.get('time_shift_type')!r} is not supported (exponential only)")
        mu = calculate_shift(
            tokens,
            int(config.get("base_image_seq_len", 256)),
            int(config.get("max_image_seq_len", 4096)),
            float(config.get("base_shift", 0.5)),
            float(config.get("max_shift", 1.15)),
        )
        return math.exp(mu)
    shift = config.get("shift", config.get("flow_shift"))
    return 1.0 if shift is None else float(shift)


class FlowMatchTable:
    """The training table: sigma_i and t_i for i = 0..N-1, descending noise."""

    def __init__(self, shift: float, num_train_timesteps: int = 1000):
        self.shift = float(shift)
        self.num_train_timesteps = int(num_train_timesteps)
        self.scheduler = FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=self.num_train_timesteps, shift=self.shift, use_dynamic_shifting=False
        )
        # The scheduler keeps the table in fp32; index i <-> u_i = (N - i) / N.
        self.sigmas = self.scheduler.sigmas[: self.num_train_timesteps].to(torch.float32).clone()
        self.timesteps = self.scheduler.timesteps[: self.num_train_timesteps].to(torch.float32).clone()
        if self.sigmas.numel() != self.num_train_timesteps:
            raise RuntimeError("unexpected scheduler table length")

    # ---- homogeneous sampling (FineTuneMethod) ----
    def sample_homogeneous_indices(
        self,
        batch_size: int,
        generator: GeneratorLike,
        device: torch.device,
        weighting_scheme: str = "uniform",
        logit_mean: float = 0.0,
        logit_std: float = 1.0,
        mode_scale: float = 1.0,
    ) -> torch.Tensor:
        """i = floor(u * N) with u from diffusers' density helper; shape [B], long."""
        gens = generator if _per_sample(generator) else [generator]
        sizes = [1] * batch_size if _per_sample(generator) else [batch_size]
        us = [
            compute_density_for_timestep_sampling(
                weighting_scheme=weighting_scheme,
                batch_size=n,
                logit_mean=logit_mean,
                logit_std=logit_std,
                mode_scale=mode_scale,
                device=device,
                generator=g,
            )
            for g, n in zip(gens, sizes)
        ]
        u = torch.cat(us)
        idx = (u * self.num_train_timesteps).long()
        return idx.clamp_(0, self.num_train_timesteps - 1)

    # ---- per-chunk sampling (DiffusionForcingSFTMethod) ----
    def sample_chunk_indices(
        self,
        batch_size: int,
        num_frames: int,
        chunk_size: int,
        index_range: tuple[int, int],
        generator: GeneratorLike,
        device: torch.device,
    ) -> torch.Tensor:
        """One index per chunk of `chunk_size` consecutive latent frames, repeated over its frames.

        Returns [B, T] long; chunks start at frame 0 and the last one may be shorter.
        """
        num_chunks = math.ceil(num_frames / chunk_size)
        lo, hi = index_range
        idx_chunk = randint(lo, hi, (batch_size, num_chunks), generator, device)
        return idx_chunk.repeat_interleave(chunk_size, dim=1)[:, :num_frames]

    # ---- lookups ----
    def sigmas_at(self, idx: torch.Tensor) -> torch.Tensor:
        return self.sigmas.to(idx.device)[idx]

    def timesteps_at(self, idx: torch.Tensor) -> torch.Tensor:
        return self.timesteps.to(idx.device)[idx]

    @staticmethod
    def expand_sigma(sigma: torch.Tensor, ndim: int = 5) -> torch.Tensor:
        """[B] -> [B,1,1,1,1]; [B,T] -> [B,1,T,1,1] (latents are [B,C,T,H,W])."""
        if sigma.ndim == 1:
            return sigma.view(-1, *([1] * (ndim - 1)))
        if sigma.ndim == 2:
            return sigma[:, None, :, None, None]
        raise ValueError(f"sigma must be [B] or [B, T], got shape {tuple(sigma.shape)}")

    def add_noise(self, clean: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        """Rectified flow: x_t = (1 - sigma) * x0 + sigma * eps, sigma [B] or per frame [B, T]."""
        s = self.expand_sigma(sigma.to(clean.dtype), clean.ndim)
        return (1.0 - s) * clean + s * noise

    # ---- timesteps given as values (distillation: step lists, shifted score timesteps) ----
    def nearest_sigmas(self, timestep: torch.Tensor, batch_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[B] sigmas of the table entries nearest to `timestep` (one value [1], or [B]): the lookup
        of a timestep that need not lie on the table (ties go to the noisier entry). The distance is
        taken in `dtype` (FastVideo's add_noise compares in fp32, its x0 conversion in fp64)."""
        t = timestep.reshape(-1).to(dtype)
        if t.numel() == 1:
            t = t.expand(batch_size)
        table = self.timesteps.to(device=t.device, dtype=dtype)
        nearest = torch.argmin((table[None, :] - t[:, None]).abs(), dim=1)
        return self.sigmas.to(device=t.device, dtype=dtype)[nearest]

    def add_noise_at(self, clean: torch.Tensor, noise: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        """x_t = (1 - sigma) * x0 + sigma * eps at the table entry nearest to `timestep`, in the
        noise's dtype."""
        sigma = self.nearest_sigmas(timestep, clean.shape[0]).to(clean.device)
        s = self.expand_sigma(sigma, clean.ndim)
        return ((1 - s) * clean + s * noise).type_as(noise)

    def x0_from_velocity(self, noisy: torch.Tensor, velocity: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        """x0_hat = x_t - sigma * v (computed in fp64, returned in the velocity's dtype), sigma at
        the table entry nearest to `timestep`."""
        sigma = self.nearest_sigmas(timestep, noisy.shape[0], torch.float64).to(noisy.device)
        x0 = noisy.double() - self.expand_sigma(sigma, noisy.ndim) * velocity.double()
        return x0.to(velocity.dtype)

    def shift_timestep(self, timestep: torch.Tensor) -> torch.Tensor:
        """A timestep value of the unshifted scale [0, N] under this table's shift:
        N * s * u / (1 + (s - 1) * u), u = t / N (the identity at shift 1)."""
        if self.shift == 1:
            return timestep
        n = self.num_train_timesteps
        u = timestep / n
        return n * (self.shift * u / (1 + (self.shift - 1) * u))

    def warp_steps(self, steps: torch.Tensor) -> torch.Tensor:
        """A few-step list given as unshifted values [N ... 1] read through the table:
        t = [t_0 .. t_{N-1}, 0][N - step] (step N -> t_0, the pure-noise entry)."""
        extended = torch.cat([self.timesteps, torch.zeros(1)]).to(steps.device)
        return extended[self.num_train_timesteps - steps]

    # ---- DFSFT weights ----
    def dfsft_weights(self, mode: str = "index") -> torch.Tensor:
        """Bell weights over the index x = 0..N-1, normalised to mean 1 (REFERENCE.md section 4).

        mode "index": the bell on the index (FastVideo); "timestep": on the timestep value t_x
        (Causal-Forcing). The two agree only at shift 1.
        """
        n = self.num_train_timesteps
        if mode == "index":
            x = torch.arange(n, dtype=torch.float64)
        elif mode == "timestep":
            x = self.timesteps.to(torch.float64)
        else:
            raise ValueError(f"method.weighting: expected 'index' or 'timestep', got {mode!r}")
        y = torch.exp(-2.0 * ((x - n / 2) / n) ** 2)
        y_shifted = y - y.min()
        return (y_shifted * n / y_shifted.sum()).to(torch.float32)
