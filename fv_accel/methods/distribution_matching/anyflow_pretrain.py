"""AnyFlowPretrainMethod: flow-map pretraining of an any-step student from data (stage 1 of
AnyFlow), with FastVideo 0.2.1's semantics and key names (`method.name: anyflow_pretrain`).

The student predicts the average velocity u(x_t, t, r) from t down to r (`predict_velocity_with_r`
of the AnyFlow family; r = t is the instantaneous velocity), so that x_r = x_t - (t - r) / N * u.
Per step, every draw from the method's generator in this order:
1. the SFT preparation's draws (`TrainingMethod.prepare`), unused here: noise [B, C, T, H, W],
   then `u` [B] (FastVideo's `prepare_batch` draws them too and throws them away);
2. u1 [B], u2 [B] uniform: t = max(u1, u2), r = min(u1, u2) on [0, 1]; the first
   int(diffusion_ratio * B) samples take r = t (flow matching), the next
   int(consistency_ratio * B) take r = 0 (a jump to clean data), the rest keep (t, r);
   both go through the shift s * x / (1 + (s - 1) * x) (s: the student's training shift) and
   times N: absolute timesteps, continuous (not table entries);
3. the noise [B, C, T, H, W], drawn in FastVideo's [B, T, C, H, W] layout; x_t = (1 - t/N) x0 + t/N eps.

Target (central difference, no gradient): with v = eps - x0 and d = epsilon (absolute units),
    dF/dt = (u(x_t + v d/N, t + d, r) - u(x_t - v d/N, t - d, r)) / (2 d g)
    target = v - (t - r) * dF/dt
where g is `fuse_guidance_scale`: the prediction trained is the guided one
(u_cond - (1 - g) u_uncond) / g, the unconditional branch without gradient. t +/- d is not clamped
(t + d can pass N), as in FastVideo.

Loss: per-sample mean squared error times a weight of t / N (uniform, gaussian or beta08
t sqrt(1 - t)), the weights rescaled per batch to sum to N (so at batch 1 the weight is N whatever
the type); then each non-diffusion sample's loss is multiplied by the constant
mean(diffusion losses) / (its loss + 1e-5) (the mean of all samples where the batch has no
diffusion sample): its value becomes about the diffusion mean while its gradient keeps its own
direction, scaled. The total is the batch mean.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch

from fv_accel.methods.base import LogScalar, TrainingMethod
from fv_accel.models.base import ModelBase, TrainingBatch
from fv_accel.schedulers import GeneratorLike, randn

WEIGHT_TYPES = ("uniform", "gaussian", "beta08")


def require_flow_map(model: ModelBase, role: str, method: str) -> None:
    """A role that must predict the average velocity u(x_t, t, r): refused in one line otherwise."""
    if not callable(getattr(model, "predict_velocity_with_r", None)):
        raise ValueError(
            f"models.{role}: method {method} trains a flow map u(x_t, t, r), but the {model.family} family predicts "
            "one velocity per timestep: give an AnyFlow student (an AnyFlow checkpoint, or a Wan 2.1 model made into one)"
        )


def parse_branch_ratios(diffusion_ratio: Any, consistency_ratio: Any) -> tuple[float, float]:
    """`method.diffusion_ratio` and `method.consistency_ratio` as given (0 is 0), each in [0, 1],
    their sum at most 1."""
    values = []
    for key, raw in (("diffusion_ratio", diffusion_ratio), ("consistency_ratio", consistency_ratio)):
        if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not 0.0 <= float(raw) <= 1.0:
            raise ValueError(f"method.{key} must be a number in [0, 1], got {raw!r}")
        values.append(float(raw))
    if values[0] + values[1] > 1.0:
        raise ValueError(
            f"method.diffusion_ratio + method.consistency_ratio must be <= 1, got {values[0]} + {values[1]}: "
            "the rest of the batch trains the free (t, r) pairs"
        )
    return values[0], values[1]


def apply_shift(x: torch.Tensor, shift: float) -> torch.Tensor:
    """The flow-matching shift on [0, 1]: s x / (1 + (s - 1) x) (identity at s = 1)."""
    if shift == 1.0:
        return x
    return shift * x / (1.0 + (shift - 1.0) * x)


def timestep_weights(t: torch.Tensor, weight_type: str, num_train_timesteps: int) -> torch.Tensor:
    """Per-sample loss weights of absolute timesteps t [B], rescaled to sum to N over the batch."""
    x = (t.float() / num_train_timesteps).clamp(0.0, 1.0)
    if weight_type == "uniform":
        w = torch.ones_like(x)
    elif weight_type == "gaussian":
        w = torch.exp(-0.5 * ((x - 0.5) / 0.2) ** 2)
    else:  # beta08
        w = x * (1.0 - x).clamp_min(0.0).sqrt()
    return w * (float(num_train_timesteps) / w.sum().clamp_min(1e-8))


def rand(shape: tuple[int, ...], generator: GeneratorLike, device: torch.device) -> torch.Tensor:
    """Uniform [0, 1) draws [B, ...] in fp32 (one generator, or one per sample)."""
    if isinstance(generator, torch.Generator):
        return torch.rand(shape, generator=generator, device=device, dtype=torch.float32)
    return torch.cat([torch.rand((1, *shape[1:]), generator=g, device=device, dtype=torch.float32) for g in generator])


def randn_like_fastvideo(shape: torch.Size, generator: GeneratorLike, device: torch.device) -> torch.Tensor:
    """Noise for latents of our shape [B, C, T, H, W], drawn as FastVideo draws it ([B, T, C, H, W])."""
    b, c, t, h, w = shape
    return randn((b, t, c, h, w), generator, device).permute(0, 2, 1, 3, 4)


def negative_conditioning(batch: dict[str, Any], tb: TrainingBatch, device: torch.device) -> Any:
    """The unconditional branch: the pipeline's negative prompt (the dataset's stored unconditional
    text), else the text zeroed."""
    import dataclasses

    negative = batch.get("negative_text_embedding")
    if negative is None:
        return tb.conditioning.unconditional()
    mask = batch.get("negative_text_attention_mask")
    return dataclasses.replace(
        tb.conditioning,
        text=negative.to(device=device, dtype=torch.float32),
        text_mask=None if mask is None else mask.to(device=device, dtype=torch.long),
    )


class AnyFlowPretrainMethod(TrainingMethod):
    """Stage 1 of AnyFlow: the student's flow map trained on data by the central-difference target."""

    def __init__(self, *, cfg: Any, role_models: dict[str, ModelBase]) -> None:
        super().__init__(cfg=cfg, role_models=role_models)
        self._require_trainable_student("AnyFlowPretrainMethod")
        require_flow_map(self.student, "student", "anyflow_pretrain")
        mc = cfg.method
        self._diffusion_ratio, self._consistency_ratio = parse_branch_ratios(mc.diffusion_ratio, mc.consistency_ratio)
        if isinstance(mc.epsilon, bool) or not isinstance(mc.epsilon, int) or mc.epsilon < 1:
            raise ValueError(f"method.epsilon must be an integer >= 1 (absolute timestep units), got {mc.epsilon!r}")
        self._epsilon = float(mc.epsilon)
        if mc.weight_type not in WEIGHT_TYPES:
            raise ValueError(f"method.weight_type must be one of {', '.join(WEIGHT_TYPES)}, got {mc.weight_type!r}")
        self._weight_type = mc.weight_type
        g = mc.fuse_guidance_scale
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not (g > 0 and math.isfinite(g)):
            raise ValueError(f"method.fuse_guidance_scale must be a number > 0 (1.0: no guidance fused), got {g!r}")
        self._guidance = float(g)
        if (mc.min_timestep_ratio, mc.max_timestep_ratio) != (0.0, 1.0):
            raise ValueError(
                f"method.min_timestep_ratio / max_timestep_ratio ({mc.min_timestep_ratio} / {mc.max_timestep_ratio}) have no "
                "effect on anyflow_pretrain, which draws t and r over the whole schedule: remove them"
            )
        self._attn_kind: Literal["dense", "vsa"] = self._infer_attn_kind()
        self._init_student()

    # ---- the draws ----
    def sample_pairs(self, batch_size: int, generator: GeneratorLike, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(t, r) on [0, 1] (unshifted) and the diffusion / consistency masks [B]."""
        u1 = rand((batch_size,), generator, device)
        u2 = rand((batch_size,), generator, device)
        t, r = torch.maximum(u1, u2), torch.minimum(u1, u2)
        n_diff = int(self._diffusion_ratio * batch_size)
        n_cons = int(self._consistency_ratio * batch_size)
        is_diffusion = torch.zeros(batch_size, dtype=torch.bool, device=device)
        is_consistency = torch.zeros(batch_size, dtype=torch.bool, device=device)
        is_diffusion[:n_diff] = True
        is_consistency[n_diff : n_diff + n_cons] = True
        r = torch.where(is_diffusion, t, r)
        r = torch.where(is_consistency, torch.zeros_like(r), r)
        return t, r, is_diffusion, is_consistency

    # ---- the student's flow map ----
    def velocity(self, x: torch.Tensor, t: torch.Tensor, r: torch.Tensor, tb: TrainingBatch, *, conditional: bool = True) -> torch.Tensor:
        return self.student.predict_velocity_with_r(x, t, r, tb, conditional=conditional, attn_kind=self._attn_kind)

    def guided_velocity(self, x: torch.Tensor, t: torch.Tensor, r: torch.Tensor, tb: TrainingBatch) -> torch.Tensor:
        """The prediction trained: conditional, or with fused guidance g (u_c - (1 - g) u_u) / g with
        the unconditional branch u_u taken without gradient."""
        pred = self.velocity(x, t, r, tb)
        if self._guidance == 1.0:
            return pred
        with torch.no_grad():
            uncond = self.velocity(x, t, r, tb, conditional=False)
        return (pred - (1.0 - self._guidance) * uncond) / self._guidance

    @torch.no_grad()
    def central_difference(self, tb: TrainingBatch, t: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        """dF/dt from the student at (t + d, r) and (t - d, r), the sample moved along the data's
        flow by d / N; divided by 2 d and the fused guidance scale. t +/- d is not clamped."""
        n = float(self.table.num_train_timesteps)
        v = tb.noise - tb.latents
        step = v * (self._epsilon / n)
        f_plus = self.velocity(tb.noisy_model_input + step, t + self._epsilon, r, tb)
        f_minus = self.velocity(tb.noisy_model_input - step, t - self._epsilon, r, tb)
        return (f_plus - f_minus) / (2.0 * self._epsilon * self._guidance)

    # ---- the loss ----
    def balanced_loss(self, per_sample: torch.Tensor, is_diffusion: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch mean after the scale balance (module docstring) and the balance scale(s)."""
        with torch.no_grad():
            diff_mean = per_sample[is_diffusion].mean() if bool(is_diffusion.any()) else per_sample.mean()
            others = ~is_diffusion
            if bool(others.any()):
                scale = diff_mean / (per_sample[others] + 1e-5)
            else:
                scale = torch.ones((), device=per_sample.device, dtype=per_sample.dtype)
        index = others.nonzero().flatten()
        if index.numel():
            per_sample = per_sample.clone()
            per_sample[index] = per_sample[index] * scale
        return per_sample.mean(), scale

    def single_train_step(
        self, batch: dict[str, Any], iteration: int
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, LogScalar]]:
        del iteration
        generator = self.batch_generator(batch)
        tb = self.prepare(batch, generator, in_range=False)  # its noise and u are FastVideo's discarded draws
        latents = tb.latents
        b, device = latents.shape[0], latents.device
        t01, r01, is_diffusion, is_consistency = self.sample_pairs(b, generator, device)
        n = self.table.num_train_timesteps
        shift = float(self.student.training_shift(latents.shape))
        t = (apply_shift(t01, shift) * n).to(latents.dtype)
        r = (apply_shift(r01, shift) * n).to(latents.dtype)
        tb.noise = randn_like_fastvideo(latents.shape, generator, device)
        sigma = t / float(n)
        s = sigma.view(-1, 1, 1, 1, 1)
        tb.noisy_model_input = (1.0 - s) * latents + s * tb.noise
        tb.timesteps, tb.sigmas = t, sigma
        tb.extras["r_timesteps"] = r
        if self._guidance != 1.0:
            tb.unconditional = negative_conditioning(batch, tb, device)
        self.attach_vsa_metadata(tb)
        pred = self.guided_velocity(tb.noisy_model_input, t, r, tb)
        target = (tb.noise - latents) - (t - r).view(-1, 1, 1, 1, 1) * self.central_difference(tb, t, r)
        per_sample = ((pred.float() - target.float()) ** 2).reshape(b, -1).mean(dim=1)
        per_sample = per_sample * timestep_weights(t, self._weight_type, n)
        loss, scale = self.balanced_loss(per_sample, is_diffusion)
        loss_map, outputs, metrics = self._step_result(loss, tb, "anyflow_loss")
        metrics.update(
            diffusion_fraction=is_diffusion.float().mean(),
            consistency_fraction=is_consistency.float().mean(),
            scale_weight_mean=scale.detach().float().mean(),
        )
        return loss_map, outputs, metrics

    def math_signature(self) -> dict[str, Any]:
        sig = super().math_signature()
        mc = self.cfg.method
        sig.update({
            "method.diffusion_ratio": self._diffusion_ratio,
            "method.consistency_ratio": self._consistency_ratio,
            "method.epsilon": mc.epsilon,
            "method.weight_type": self._weight_type,
            "method.fuse_guidance_scale": self._guidance,
        })
        return sig


__all__ = ["AnyFlowPretrainMethod", "apply_shift", "timestep_weights", "parse_branch_ratios", "require_flow_map"]
