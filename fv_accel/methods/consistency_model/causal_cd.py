"""CausalConsistencyDistillationMethod (`method.name: causal_cd`, Causal Forcing++): a block-causal
student learns to map a noisy clip to the x0 that a frozen EMA copy of itself predicts one teacher
CFG Euler step later, every forward teacher-forced over the clean history (the clean latents as the
context of a teacher-forcing forward, `predict_noise_teacher_forcing`). No ODE trajectories, no cache.

Roles: `student` (trained), `teacher` (frozen: the Euler step) and `ema` (frozen for the optimizer,
moved toward the student after each optimizer step from `ema_start_step` on), all three from one
teacher-forcing run (the output of `method.name: tfsft`).

One step, FastVideo 0.2.1's `CausalConsistencyDistillationMethod`: the schedule is its
`SelfForcingFlowMatchScheduler` of `discrete_cd_N` steps (sigma_k = shift s / (1 + (shift - 1) s),
s = linspace(1, 0, N + 1)[k], t_k = 1000 sigma_k), shift `models.student.flow_shift`, else 5 (not the
family's). Random draws on the step's generator: FastVideo's `prepare_batch` draws (noise and the
SFT timestep, unused: kept so the stream is FastVideo's), one index k in [0, N - 1) for the whole
batch, then the noise (drawn as [B, T, C, H, W]). Under `training.loop.noise_rng: sample` k comes
from a generator of (seed, step) and the noise from each sample's. With x_t = (1 - sigma_k) x0 + sigma_k eps:
    v     = v_uncond + guidance_scale (v_cond - v_uncond)          teacher, no gradient
    x_t'  = x_t - (t_k - t_k+1) / 1000 * v                         one Euler step
    loss  = mean((x_t - sigma_k v_student(x_t) - (x_t' - sigma_k+1 v_ema(x_t')))^2)
FastVideo's traps kept (the golden test covers them): the loss has no 0.5 factor; the teacher's
unconditional pass reads the batch's negative prompt (the dataset's stored unconditional text, the
student's in FastVideo), with no `cfg_uncond` policy; the EMA update (ema <- d ema + (1 - d) student)
runs after the optimizer step of every step >= `ema_start_step` (1-based). With guidance_scale 1 the
unconditional pass is skipped (v is the conditional one, as the formula gives).

The EMA's weights travel in every checkpoint (`state_tensors`, this process's shards under FSDP2), so
a resumed run equals a straight one. With a LoRA student the EMA is a second, frozen adapter over
the student's one base (`EmaAdapterView`), the built `models.ema` dropped. The final output holds the student (FastVideo's chain exports
the CD student for Self-Forcing to start from); the EMA is the training target only.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from fv_accel.methods.base import LogScalar, TrainingMethod
from fv_accel.models.base import ModelBase, TrainingBatch, reshard_fsdp_units
from fv_accel.schedulers import randn
from fv_accel.seeding import derived_seed

ROLES = ("student", "teacher", "ema")
# With a LoRA student, the EMA's adapter beside the trained one.
EMA_ADAPTER = "ema"
# The schedule's shift where models.student.flow_shift is unset (FastVideo's causal CD: 5, not the family's).
DEFAULT_FLOW_SHIFT = 5.0


def consistency_schedule(num_steps: int, shift: float, num_train_timesteps: int = 1000) -> tuple[torch.Tensor, torch.Tensor]:
    """(sigmas, timesteps) [N], float32, the noisiest first: FastVideo's SelfForcingFlowMatchScheduler
    (sigma_min 0, sigma_max 1, extra_one_step) at `shift` (its float32 operations, in its order)."""
    sigmas = torch.linspace(1.0, 0.0, num_steps + 1)[:-1]
    sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
    return sigmas, sigmas * num_train_timesteps


def parse_cd_recipe(mc: Any) -> dict[str, Any]:
    """The method's keys, checked: each bad value a ValueError naming `method.<key>`."""

    def number(key: str) -> float:
        raw = getattr(mc, key)
        if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not math.isfinite(float(raw)):
            raise ValueError(f"method.{key} must be a number, got {raw!r}")
        return float(raw)

    def integer(key: str, low: int) -> int:
        raw = getattr(mc, key)
        if isinstance(raw, bool) or not isinstance(raw, int) or raw < low:
            raise ValueError(f"method.{key} must be an integer >= {low}, got {raw!r}")
        return int(raw)

    out = {
        "guidance_scale": number("guidance_scale"),
        "discrete_cd_N": integer("discrete_cd_N", 2),
        "ema_decay": number("ema_decay"),
        "ema_start_step": integer("ema_start_step", 0),
    }
    if not 0.0 <= out["ema_decay"] <= 1.0:
        raise ValueError(f"method.ema_decay must be in [0, 1], got {mc.ema_decay!r}")
    return out


def check_teacher_forcing_role(name: str, role: ModelBase) -> None:
    """A role of causal CD runs the teacher-forcing forward: a block-causal model of a family that has
    one. Anything else is refused in one line naming models.<name>."""
    if not hasattr(role, "predict_noise_teacher_forcing"):
        raise ValueError(
            f"models.{name}: method.name causal_cd runs every forward teacher-forced, and the {role.family} family has "
            "no teacher-forcing forward (supported: families with predict_noise_teacher_forcing, e.g. wan)"
        )
    if getattr(role, "causal_block_size", None) is None:
        raise ValueError(
            f"models.{name}: method.name causal_cd needs a block-causal model: set models.{name}.causal: true "
            "and method.chunk_size (the teacher-forcing run's block size)"
        )


class CausalConsistencyDistillationMethod(TrainingMethod):
    """Causal consistency distillation over a student, a frozen teacher and the student's EMA."""

    def __init__(self, *, cfg: Any, role_models: dict[str, ModelBase]) -> None:
        super().__init__(cfg=cfg, role_models=role_models)
        missing = [r for r in ROLES if r not in role_models]
        if missing:
            raise ValueError(f"CausalConsistencyDistillationMethod requires roles {', '.join(ROLES)}; missing {', '.join(missing)}")
        self._require_trainable_student("CausalConsistencyDistillationMethod")
        self.teacher, self.ema = role_models["teacher"], role_models["ema"]
        for name in ("teacher", "ema"):
            if role_models[name]._trainable:
                raise ValueError(f"method.name causal_cd: models.{name} is frozen; remove models.{name}.trainable: true")
        self.lora = bool(cfg.models.student.lora.enable)
        if self.lora:
            # The EMA of a LoRA student is a second adapter over its one base (the built models.ema is dropped).
            from fv_accel.models.lora import add_frozen_adapter

            add_frozen_adapter(self.student.transformer, EMA_ADAPTER)
            self.role_models = {k: v for k, v in role_models.items() if k != "ema"}
            self.ema = EmaAdapterView(self.student)
        for name in ROLES:
            check_teacher_forcing_role(name, self.ema if name == "ema" else role_models[name])
        if getattr(self.student, "condition_frames", 0):
            raise ValueError(
                "models.student: method.name causal_cd distils text-to-video students (FastVideo's); this one is "
                "image-to-video (clean condition frames): distil it with dmd2"
            )
        self.recipe = parse_cd_recipe(cfg.method)
        shift = cfg.models.student.flow_shift
        self.flow_shift = float(shift) if shift else DEFAULT_FLOW_SHIFT
        self._attn_kind = self._infer_attn_kind()
        self._init_student()
        for role in (self.teacher, self.ema):
            if not isinstance(role, EmaAdapterView):
                role.init_preprocessors(self.training_config)
                role.transformer.eval()
        self.num_train_timesteps = int(self.table.num_train_timesteps)
        self.sigmas, self.timesteps = consistency_schedule(self.recipe["discrete_cd_N"], self.flow_shift, self.num_train_timesteps)

    def check_data(self, loader: Any) -> None:
        """Every forward is teacher-forced over the data's clean latents: a text-only dataset is refused."""
        from fv_accel.config import ConfigError

        dataset = getattr(loader, "dataset", loader)
        if getattr(dataset, "text_only", False):
            raise ConfigError(
                f"training.data.data_path {dataset.data_path}: a text-only dataset, and method.name causal_cd "
                "teacher-forces every forward over the clips' clean latents: preprocess clips with their videos "
                "(python -m fv_accel.preprocess --input ...)"
            )

    # ---- draws ----
    def draw_step_index(self, generator: Any, iteration: int) -> int:
        """The schedule index k in [0, N - 1) of the whole batch: from the rank's generator (FastVideo's),
        or under `noise_rng: sample` from a generator of (seed, step), the same on every rank and for every
        micro-batch of the step, so that N processes train as one does."""
        n = self.recipe["discrete_cd_N"]
        if isinstance(generator, list):
            generator = torch.Generator(device=self.device).manual_seed(derived_seed(self.seed, iteration, "causal_cd_k"))
        return int(torch.randint(0, n - 1, (1,), generator=generator, device=self.device)[0])

    # ---- the roles' teacher-forced predictions ----
    def predict_flow(self, role: ModelBase, x_t: torch.Tensor, timesteps: torch.Tensor, tb: TrainingBatch, *,
                     conditional: bool) -> torch.Tensor:
        """A role's flow for x_t [B, C, T, H, W] at per-frame `timesteps` [B, T], teacher-forced over the
        batch's clean latents (the context, at timestep 0)."""
        context_t = torch.zeros_like(timesteps)
        _, flow = role.predict_noise_teacher_forcing(tb.latents, context_t, x_t, timesteps, tb, conditional=conditional)
        return flow

    def unconditional(self, batch: dict[str, Any], tb: TrainingBatch) -> Any:
        """The teacher's unconditional branch: the dataset's stored negative prompt, else the text zeroed."""
        import dataclasses

        negative = batch.get("negative_text_embedding")
        if negative is None:
            return tb.conditioning.unconditional()
        mask = batch.get("negative_text_attention_mask")
        return dataclasses.replace(
            tb.conditioning, text=negative.to(device=self.device, dtype=torch.float32),
            text_mask=None if mask is None else mask.to(device=self.device, dtype=torch.long),
        )

    # ---- the step ----
    def single_train_step(
        self, batch: dict[str, Any], iteration: int
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, LogScalar]]:
        generator = self.batch_generator(batch)
        tb = self.attach_vsa_metadata(self.prepare(batch, generator, in_range=False))
        tb.unconditional = self.unconditional(batch, tb)
        clean = tb.latents
        b, c, t, h, w = clean.shape
        k = self.draw_step_index(generator, iteration)
        noise = randn((b, t, c, h, w), generator, clean.device).permute(0, 2, 1, 3, 4).to(clean.dtype)
        sigmas, timesteps = self.sigmas.to(clean.device), self.timesteps.to(clean.device)
        sigma_t, sigma_next = sigmas[k], sigmas[k + 1]
        t_now = timesteps[k] * torch.ones(b, t, device=clean.device)
        t_next = timesteps[k + 1] * torch.ones(b, t, device=clean.device)
        latent_t = (1.0 - sigma_t) * clean + sigma_t * noise
        with torch.no_grad():
            v = self.predict_flow(self.teacher, latent_t, t_now, tb, conditional=True)
            guidance = self.recipe["guidance_scale"]
            if guidance != 1.0:
                v_uncond = self.predict_flow(self.teacher, latent_t, t_now, tb, conditional=False)
                v = v_uncond + guidance * (v - v_uncond)
            dt = (timesteps[k] - timesteps[k + 1]) / float(self.num_train_timesteps)
            latent_next = latent_t - dt * v
        flow = self.predict_flow(self.student, latent_t, t_now, tb, conditional=True)
        x0_t = latent_t - sigma_t * flow
        with torch.no_grad():
            x0_next = latent_next - sigma_next * self.predict_flow(self.ema, latent_next, t_next, tb, conditional=True)
        loss = F.mse_loss(x0_t.float(), x0_next.float())
        tb.timesteps, tb.sigmas = t_now, sigma_t.expand(b)
        loss_map, outputs, metrics = self._step_result(loss, tb, "causal_cd_loss")
        metrics["cd_timestep"] = timesteps[k]
        return loss_map, outputs, metrics

    # ---- the EMA ----
    def on_step_end(self, step: int) -> None:
        """After optimizer step `step` (1-based): the EMA follows the student from ema_start_step on."""
        if step >= self.recipe["ema_start_step"]:
            self.update_ema()

    def ema_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(student, ema) parameters, each this process's shards under FSDP2 (read at each call:
        the engine's prepare replaces the parameters); with LoRA the trained adapter's and the EMA
        adapter's."""
        reshard_fsdp_units(self.student.transformer)
        if self.lora:
            from fv_accel.models.lora import adapter_pairs

            return adapter_pairs(self.student.transformer, EMA_ADAPTER)
        reshard_fsdp_units(self.ema.transformer)
        return list(zip(self.student.transformer.parameters(), self.ema.transformer.parameters(), strict=True))

    @torch.no_grad()
    def update_ema(self) -> None:
        """ema <- decay * ema + (1 - decay) * student (FastVideo's in-place order of operations)."""
        decay = self.recipe["ema_decay"]
        for src, tgt in self.ema_pairs():
            tgt.mul_(decay).add_(src.detach().to(tgt.dtype), alpha=1.0 - decay)

    # ---- checkpoints ----
    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The EMA's weights (this process's part): it changes every step, unlike a frozen role's source."""
        return {f"ema.{i}": local_tensor(ema).detach().clone() for i, (_, ema) in enumerate(self.ema_pairs())}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        saved = {key[len("ema."):]: value for key, value in tensors.items() if key.startswith("ema.")}
        pairs = self.ema_pairs()
        if len(saved) != len(pairs):
            raise RuntimeError(
                f"the checkpoint holds {len(saved)} EMA tensors for models.ema's {len(pairs)} parameters: "
                "it was saved by another model or method"
            )
        with torch.no_grad():
            for i, (_, param) in enumerate(pairs):
                local_tensor(param).copy_(saved[str(i)].to(param.device))

    def math_signature(self) -> dict[str, Any]:
        sig = super().math_signature()
        sig.update({f"method.{key}": value for key, value in self.recipe.items()})
        sig["method.consistency_flow_shift"] = self.flow_shift  # models.student.flow_shift, else 5
        return sig


class EmaAdapterView:
    """The EMA of a LoRA student: the student's transformer computing through the frozen adapter
    `EMA_ADAPTER` over the same base (the trained adapter untouched)."""

    _trainable = False
    role = "ema"

    def __init__(self, student: ModelBase):
        self.student = student

    @property
    def family(self) -> str:
        return self.student.family

    @property
    def causal_block_size(self) -> Any:
        return self.student.causal_block_size

    def predict_noise_teacher_forcing(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        from fv_accel.models.lora import adapter_view

        with adapter_view(self.student._unwrapped(), EMA_ADAPTER):
            return self.student.predict_noise_teacher_forcing(*args, **kwargs)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This process's part of a tensor (a DTensor's local shard under FSDP2)."""
    return t.to_local() if hasattr(t, "to_local") else t
