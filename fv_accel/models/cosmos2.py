"""The Cosmos-Predict2 family (`cosmos2`): `CosmosTransformer3DModel` of nvidia/Cosmos-Predict2-*-Video2World.

Conventions, read from diffusers' Cosmos2VideoToWorldPipeline (0.42):
- The pipeline runs EDM (variance-exploding) latents `x = x0 + sigma * eps`, sigma from 80 to
  0.002 on Karras steps, and feeds the transformer `c_in * x = x / (1 + sigma)` at timestep
  `s = sigma / (1 + sigma)` (a float in [0, 1]); then `x0_hat = c_skip * x + c_out * out` with
  `c_skip = 1 - s`, `c_out = -s`. In rectified-flow terms the transformer sees
  `x_s = (1 - s) x0 + s eps` at `s` and `x0_hat = x_s - s * out`: its output is the flow velocity
  `eps - x0` of REFERENCE.md, at sigma = s. So `forward` passes `x_t` as is, the timestep as
  `t / 1000`, and returns the output unchanged (no sign flip, no rescaling).
- Latents are normalised as `(x - latents_mean) / latents_std * sigma_data` (sigma_data 1.0).
- Video2World conditions on leading latent frames by frame replacement: they enter clean, with
  `condition_mask` 1 (a 17th input channel) and the timestep `sigma_conditioning /
  (sigma_conditioning + 1)` (sigma_conditioning 1e-4), and their output is replaced by the
  condition. Here they are the contract's `Conditioning.clean_frames` (1: the pipeline's
  `image=` input): the method gives them t = 0, `forward` turns that into the pipeline's values.
- `padding_mask` is all zeros (the pipeline's); `fps` the pipeline's default (16).
- The transformer takes its timestep as [B, 1, T, 1, 1], one per latent frame (AdaLN per frame),
  which is how the pipeline calls it: per-frame timesteps work (diffusion forcing).
"""

from __future__ import annotations

import inspect
import math
import types
from typing import Any, Optional

import torch
import torch.nn.functional as F


def _pipeline_default(name: str) -> Any:
    from diffusers import Cosmos2VideoToWorldPipeline

    return inspect.signature(Cosmos2VideoToWorldPipeline.__call__).parameters[name].default


# The pipeline's call defaults: the frame rate it gives the RoPE and the noise level of the
# condition frames.
PIPELINE_FPS: int = _pipeline_default("fps")
SIGMA_CONDITIONING: float = _pipeline_default("sigma_conditioning")
# The condition frames' timestep, as the pipeline computes it (t = sigma / (sigma + 1)).
CONDITION_TIMESTEP: float = SIGMA_CONDITIONING / (SIGMA_CONDITIONING + 1.0)
NUM_TRAIN_TIMESTEPS = 1000


def install_padding_mask_resize() -> bool:
    """Let `CosmosTransformer3DModel` run without torchvision; returns True where it was needed.

    With `concat_padding_mask` (every Cosmos-Predict2 model) diffusers' transformer resizes the
    padding mask to the latent size with `torchvision.transforms.functional.resize(...,
    InterpolationMode.NEAREST)`, through a module-level `transforms` bound only when torchvision
    is installed (this project does not depend on it). Without it, this binds a `transforms`
    whose `functional.resize` is `torch.nn.functional.interpolate(mode="nearest")`, what
    torchvision's tensor resize runs for NEAREST. The masks fv_accel and the pipeline pass are all
    zeros, so the resized mask is zeros either way.
    """
    from diffusers.models.transformers import transformer_cosmos

    if hasattr(transformer_cosmos, "transforms"):
        return False

    def resize(img: torch.Tensor, size: list[int], interpolation: str = "nearest", **_: Any) -> torch.Tensor:
        if interpolation != "nearest":
            raise ValueError(f"only nearest resizing is provided without torchvision, not {interpolation!r}")
        return F.interpolate(img, size=list(size), mode="nearest")

    transformer_cosmos.transforms = types.SimpleNamespace(
        functional=types.SimpleNamespace(resize=resize),
        InterpolationMode=types.SimpleNamespace(NEAREST="nearest"),
    )
    return True


install_padding_mask_resize()


class PassThroughSafetyChecker:
    """A stand-in for cosmos_guardrail's `CosmosSafetyChecker` (not installable here) that checks
    nothing: every prompt passes, every video is returned unchanged.

    Cosmos2VideoToWorldPipeline refuses to run without a safety checker and builds the guardrail
    itself when given None. fv_accel's sample videos call the pipeline with precomputed prompt
    embeddings and `output_type="latent"`, a path on which the pipeline never consults the checker
    (no prompt text to screen, no decoded video); tests load the stock pipeline with this
    stand-in, so their decoded videos are not screened either.
    """

    def to(self, *args: Any, **kwargs: Any) -> "PassThroughSafetyChecker":
        return self

    def check_text_safety(self, prompt: str) -> bool:
        return True

    def check_video_safety(self, frames: Any) -> Any:
        return frames


def transformer_timestep(t: torch.Tensor, num_frames: int, clean_frames: int) -> torch.Tensor:
    """fv_accel timesteps (t = sigma * 1000, [B] or per frame [B, T]) -> the transformer's
    [B, 1, T, 1, 1] in [0, 1]; the `clean_frames` leading (condition) frames get the pipeline's
    condition timestep."""
    t = (t if t.is_floating_point() else t.float()) / NUM_TRAIN_TIMESTEPS
    if t.ndim == 1:
        t = t[:, None].expand(-1, num_frames)
    if t.ndim != 2 or t.shape[1] != num_frames:
        raise ValueError(f"timesteps must be [B] or [B, {num_frames}], got {tuple(t.shape)}")
    if clean_frames:
        t = t.clone()
        t[:, :clean_frames] = CONDITION_TIMESTEP
    return t[:, None, :, None, None]


def condition_mask(x_t: torch.Tensor, clean_frames: int) -> torch.Tensor:
    """[B, 1, T, H, W]: 1 on the condition frames, 0 elsewhere (the pipeline's `cond_mask`)."""
    b, _, frames, h, w = x_t.shape
    mask = x_t.new_zeros(b, 1, frames, h, w)
    mask[:, :, :clean_frames] = 1.0
    return mask


def transformer_inputs(
    x_t: torch.Tensor, t: torch.Tensor, text: torch.Tensor, clean_frames: int, dtype: torch.dtype
) -> dict[str, Any]:
    """The keyword arguments of `CosmosTransformer3DModel.forward` for normalised latents x_t
    [B, C, T, H, W] at fv_accel timesteps t, as the Video2World pipeline builds them."""
    b, _, frames, h, w = x_t.shape
    return dict(
        hidden_states=x_t.to(dtype),
        timestep=transformer_timestep(t, frames, clean_frames).to(dtype),
        encoder_hidden_states=text.to(dtype),
        fps=PIPELINE_FPS,
        condition_mask=condition_mask(x_t, clean_frames).to(dtype),
        padding_mask=x_t.new_zeros(1, 1, h, w, dtype=dtype),
        return_dict=False,
    )


def edm_sigma(s: torch.Tensor | float) -> torch.Tensor | float:
    """Flow sigma s in [0, 1) -> the pipeline's EDM sigma (s = sigma / (1 + sigma))."""
    return s / (1 - s)


def video_noise_shift(latent_frames: int) -> float:
    """Cosmos-Predict2's training noise in flow terms.

    Its training draws `log sigma0 ~ N(0, 1)` and scales the EDM sigma of video batches by
    `sqrt(state_t)` (`adjust_video_noise`; state_t, the latent frames of its training clips).
    With s = sigma / (1 + sigma), sigma = k * sigma0 maps u = sigma0 / (1 + sigma0) to
    `k u / (1 + (k - 1) u)`: the shifted flow table with shift k = sqrt(latent frames), sampled
    logit-normally (logit u ~ N(0, 1))."""
    return math.sqrt(max(1, int(latent_frames)))
