"""DMD2Method: distribution-matching distillation of a teacher into a few-step student (roles
student, teacher, critic), with FastVideo 0.2.1's semantics and key names.

Per step (iteration = the 1-based step number), every draw from the method's generator
(`cuda_generator`), in this order:
1. the SFT preparation's draws (`TrainingMethod.prepare`), unused by DMD2: noise [B, C, T, H, W],
   then `u` [B] (then, for a student that makes sound, the silent audio's noise, which all roles hear);
2. when the student is updated (iteration % generator_update_interval == 0): a rollout of the
   student with gradient through its last prediction, then the DMD gradient (score timestep, noise;
   critic, teacher conditional and unconditional predictions);
3. the critic's flow-matching loss on a second, fresh rollout without gradient (score timestep, noise).

A rollout (`simulate`) draws the exit index among the few steps, the start noise, and runs every
step of the list (a fresh noise per re-noising) whatever the exit; `data_latent` draws one step
of the list and noises the data latents to it. Every noise after the preparation is drawn in
FastVideo's [B, T, C, H, W] layout and permuted to ours, so both draw the same numbers.
The score timestep is `randint(0, N)` shifted by the student's shift, clamped to [0, N], then to
the recipe's window `[int(min_ratio * N), int(max_ratio * N)]` (a clamp, not a resample).
Noising uses the student's table; each role converts its velocity to x0 with its own table.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Optional

import torch
import torch.nn.functional as F

from fv_accel.methods.base import LogScalar, TrainingMethod, _parse_ratio
from fv_accel.models.base import ModelBase, TrainingBatch
from fv_accel.schedulers import randn

ROLES = ("student", "teacher", "critic")
# Beside a distilled student's weights: its few timesteps and sigmas (read by fv_accel.generate).
STUDENT_STEPS_FILE = "student_steps.json"


def write_json_atomically(path: Any, record: Any) -> None:
    """`record` as indented JSON at `path`, through a temporary sibling renamed over it."""
    import json
    import os

    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)


def parse_cfg_uncond(raw: Any) -> Optional[dict]:
    """`method.cfg_uncond` (FastVideo's): None, or {channel: keep | zero | drop (text also
    negative_prompt), on_missing: error | ignore}; each bad value a ValueError naming it."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"method.cfg_uncond must be a mapping, got {type(raw).__name__} {raw!r}")
    out = dict(raw)
    on_missing = str(out.get("on_missing") or "error").strip().lower()
    if on_missing not in ("error", "ignore"):
        raise ValueError(f"method.cfg_uncond.on_missing must be error or ignore, got {out.get('on_missing')!r}")
    out["on_missing"] = on_missing
    for channel, policy in raw.items():
        if channel == "on_missing" or policy is None:
            continue
        allowed = {"keep", "zero", "drop"} | ({"negative_prompt"} if channel == "text" else set())
        value = str(policy).strip().lower() if isinstance(policy, str) else None
        if value not in allowed:
            raise ValueError(f"method.cfg_uncond.{channel} must be one of {sorted(allowed)}, got {policy!r}")
        out[channel] = value
    return out


class DMD2Method(TrainingMethod):
    """DMD2: a few-step student, a frozen teacher (the real score) and a trained critic (the fake score)."""

    def __init__(self, *, cfg: Any, role_models: dict[str, ModelBase]) -> None:
        super().__init__(cfg=cfg, role_models=role_models)
        missing = [r for r in ROLES if r not in role_models]
        if missing:
            raise ValueError(f"DMD2Method requires roles {', '.join(ROLES)}; missing {', '.join(missing)}")
        self.teacher = role_models["teacher"]
        self.critic = role_models["critic"]
        if not self.student._trainable:
            raise ValueError("DMD2Method requires student to be trainable (models.student.trainable)")
        if self.teacher._trainable:
            raise ValueError("DMD2Method requires teacher to be non-trainable (models.teacher.trainable: false)")
        if not self.critic._trainable:
            raise ValueError("DMD2Method requires critic to be trainable (models.critic.trainable)")
        mc = cfg.method
        if mc.rollout_mode is None:
            raise ValueError("method.rollout_mode must be set for dmd2: simulate or data_latent")
        self._rollout_mode: Literal["simulate", "data_latent"] = mc.rollout_mode
        self._cfg_uncond = parse_cfg_uncond(mc.cfg_uncond)
        self._steps = self._parse_denoising_steps(mc.dmd_denoising_steps)
        if int(mc.generator_update_interval) < 1:
            raise ValueError(f"method.generator_update_interval must be an integer >= 1, got {mc.generator_update_interval!r}")
        self._interval = int(mc.generator_update_interval)
        self._guidance = float(mc.real_score_guidance_scale)
        self._score_bounds = self._parse_score_bounds()
        self._attn_kind: Literal["dense", "vsa"] = self._infer_attn_kind()
        self._init_student()
        for role in (self.teacher, self.critic):
            role.init_preprocessors(self.training_config)
        self.teacher.transformer.eval()
        val = cfg.callbacks.validation
        if val.enable and (val.prompts or val.prompt_file):
            self.check_sample_videos()
        self._init_optimizers()

    def check_sample_videos(self) -> None:
        """Sample videos step with the stock scheduler of the student's steps: refused now, not mid-run."""
        try:
            self.sampling_schedule()
        except ValueError as err:
            raise ValueError(f"callbacks.validation.prompts: {err}; or leave the prompts out") from None

    # ---- recipe parsing ----
    def _parse_denoising_steps(self, raw: Any) -> torch.Tensor:
        n = self.table.num_train_timesteps
        if not isinstance(raw, list) or not raw:
            raise ValueError("method.dmd_denoising_steps must be a non-empty list of timesteps, e.g. [1000, 750, 500, 250]")
        if any(isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= n for s in raw):
            raise ValueError(f"method.dmd_denoising_steps must be integers in [0, {n}], got {raw!r}")
        return torch.tensor(raw, dtype=torch.long)

    def _parse_score_bounds(self) -> tuple[int, int]:
        """The score timestep window: [int(min_ratio * N), int(max_ratio * N)]."""
        mc = self.cfg.method
        lo = _parse_ratio(mc.min_timestep_ratio, "min_timestep_ratio")
        hi = _parse_ratio(mc.max_timestep_ratio, "max_timestep_ratio")
        if hi < lo:
            raise ValueError(f"method.max_timestep_ratio ({hi}) must be >= method.min_timestep_ratio ({lo})")
        n = self.table.num_train_timesteps
        return int(lo * n), int(hi * n)

    def _init_optimizers(self) -> None:
        """The student's optimizer and schedule from `training.optimizer`; the critic's from it with
        `method.fake_score_learning_rate`, `fake_score_betas` and `fake_score_lr_scheduler`."""
        from fv_accel.optim import build_lr_scheduler, build_optimizer

        mc = self.cfg.method
        for key in ("fake_score_learning_rate", "fake_score_betas", "fake_score_lr_scheduler"):
            if getattr(mc, key) is None:
                raise ValueError(f"method.{key} must be set for dmd2 (e.g. 8e-6, [0.0, 0.999], constant)")
        if mc.fake_score_learning_rate <= 0:
            raise ValueError(f"method.fake_score_learning_rate must be > 0, got {mc.fake_score_learning_rate!r}")
        if len(mc.fake_score_betas) != 2 or not all(0 <= b < 1 for b in mc.fake_score_betas):
            raise ValueError(f"method.fake_score_betas must be two numbers in [0, 1), got {mc.fake_score_betas!r}")
        self.optimizer = build_optimizer(self.cfg, self.student.trainable_parameters())
        self.lr_scheduler = build_lr_scheduler(self.cfg, self.optimizer)
        training = self.cfg.training
        critic_opt = dataclasses.replace(
            training.optimizer, learning_rate=float(mc.fake_score_learning_rate), betas=list(mc.fake_score_betas),
            lr_scheduler=str(mc.fake_score_lr_scheduler),
        )
        critic_cfg = dataclasses.replace(self.cfg, training=dataclasses.replace(training, optimizer=critic_opt))
        self.critic_optimizer = build_optimizer(critic_cfg, self.critic.trainable_parameters())
        self.critic_lr_scheduler = build_lr_scheduler(critic_cfg, self.critic_optimizer)

    # ---- what the trainer steps ----
    def trainable_roles(self) -> dict[str, ModelBase]:
        return {"student": self.student, "critic": self.critic}

    @property
    def optimizer_dict(self) -> dict[str, Any]:
        return {"student": self.optimizer, "critic": self.critic_optimizer}

    @property
    def lr_scheduler_dict(self) -> dict[str, Any]:
        return {"student": self.lr_scheduler, "critic": self.critic_lr_scheduler}

    def set_optimizer(self, role: str, optimizer: Any, lr_scheduler: Any) -> None:
        if role == "critic":
            self.critic_optimizer, self.critic_lr_scheduler = optimizer, lr_scheduler
        else:
            super().set_optimizer(role, optimizer, lr_scheduler)

    def should_update_student(self, iteration: int) -> bool:
        return iteration % self._interval == 0

    def get_optimizers(self, iteration: int) -> list[Any]:
        return [self.critic_optimizer] + ([self.optimizer] if self.should_update_student(iteration) else [])

    def get_lr_schedulers(self, iteration: int) -> list[Any]:
        return [self.critic_lr_scheduler] + ([self.lr_scheduler] if self.should_update_student(iteration) else [])

    def get_grad_clip_targets(self, iteration: int) -> dict[str, torch.nn.Module]:
        targets = {"student": self.student.transformer} if self.should_update_student(iteration) else {}
        targets["critic"] = self.critic.transformer
        return targets

    def lr_scheduler_steps(self, step: int) -> dict[str, int]:
        return {"student": step // self._interval, "critic": step}

    def saved_roles(self) -> dict[str, ModelBase]:
        return {"critic": self.critic}

    # ---- draws ----
    # The step's generator(s): the rank's `cuda_generator` (FastVideo's), or with
    # `training.loop.noise_rng: sample` one per sample, where each sample's noise comes from its own
    # and the batch-wide draws (exit step, score timestep) from the first sample's; then one process
    # with micro-batches of one equals several processes with one sample each.
    _generator: Any = None

    def _randn_like_fastvideo(self, shape: torch.Size, device: torch.device) -> torch.Tensor:
        """Noise for latents of our shape [B, C, T, H, W], drawn as FastVideo draws it ([B, T, C, H, W])."""
        b, c, t, h, w = shape
        return randn((b, t, c, h, w), self._generator, device).permute(0, 2, 1, 3, 4)

    def _randint(self, high: int, device: torch.device) -> torch.Tensor:
        generator = self._generator[0] if isinstance(self._generator, list) else self._generator
        return torch.randint(0, high, (1,), generator=generator, device=device, dtype=torch.long)

    def denoising_steps(self, latent_shape: torch.Size) -> torch.Tensor:
        """The student's few timesteps: the recipe's list, through the student's table with warp."""
        steps = self._steps
        if self.cfg.method.warp_denoising_step:
            steps = self.student.training_table(latent_shape).warp_steps(steps)
        return steps.to(self.device)

    def few_step_sigmas(self, latent_shape: torch.Size) -> list[float]:
        """The sigma of each of the student's steps (its training table's entry nearest to the step)."""
        table = self.student.training_table(latent_shape)
        return [float(table.nearest_sigmas(t.reshape(1).cpu(), 1)[0]) for t in self.denoising_steps(latent_shape)]

    def sampling_schedule(self) -> Any:
        """The diffusers scheduler that samples the student at its few steps as the rollout does
        (fv_accel.sampling.few_step_schedule): what validation and exported folders use."""
        from fv_accel.sampling import few_step_schedule

        sigmas = self.few_step_sigmas(torch.Size([1, 1, 1, 1, 1]))
        return few_step_schedule(sigmas, "the student's few steps (method.dmd_denoising_steps)")

    def student_steps_record(self) -> dict[str, Any]:
        """What `student_steps.json` holds: the student's few timesteps and sigmas and how it steps
        between them (x0 re-noised with fresh noise; clean context)."""
        one = torch.Size([1, 1, 1, 1, 1])
        return {
            "method": self.cfg.method.name,
            "timesteps": [float(t) for t in self.denoising_steps(one)],
            "sigmas": self.few_step_sigmas(one),
            "student_sample_type": "sde",
            "context_noise": 0.0,
        }

    def write_final_files(self, output_dir: Any) -> None:
        """`student_steps.json` (`student_steps_record`: what `python -m fv_accel.generate` samples the
        student at) and `scheduler/scheduler_config.json`, the stock scheduler that samples the
        student at its steps, where one does."""
        import logging
        from pathlib import Path

        write_json_atomically(Path(output_dir) / STUDENT_STEPS_FILE, self.student_steps_record())
        try:
            schedule = self.sampling_schedule()
        except ValueError as err:  # a step list no stock scheduler steps: the student is saved without one
            logging.getLogger(__name__).warning("no scheduler/ written beside the student: %s", err)
            return
        schedule.build().save_pretrained(Path(output_dir) / "scheduler")

    def sample_score_timestep(self, latent_shape: torch.Size, device: torch.device) -> torch.Tensor:
        n = self.table.num_train_timesteps
        t = self.student.training_table(latent_shape).shift_timestep(self._randint(n, device))
        return t.clamp(0, n).clamp(*self._score_bounds)

    # ---- the batch ----
    def _prepare_dmd_batch(self, batch: dict[str, Any]) -> TrainingBatch:
        """The student's conditioning and latents (the data's, or zeros of the rollout's shape in
        `simulate`) through the SFT preparation (`prepare`: noise, u, which DMD2 does not use). A
        student that makes sound (LTX-2) trains its video only: its audio branch is fed silence as
        pure noise (sigma 1), drawn after those, in every role's forward of the step."""
        if self._rollout_mode == "simulate":
            cond = self.student.build_conditioning(batch)
            clean = TrainingBatch(latents=torch.zeros(self.rollout_shape(batch), device=self.device), conditioning=cond)
            if cond.clean_frames:  # image-to-video: the data's first frames are the condition
                clean.extras["clean_condition"] = self.student.clean_latents(batch)[:, :, : cond.clean_frames]
        else:
            clean = self.student.prepare_batch(batch, latents_source="data")
            if clean.conditioning.clean_frames:
                clean.extras["clean_condition"] = clean.latents[:, :, : clean.conditioning.clean_frames]
        if self.student.has_audio:
            clean.extras["audio"] = self.student.silent_audio(clean.latents.shape[0], clean.latents.shape[2])
        tb = self.attach_vsa_metadata(self.prepare(batch, self._generator, in_range=False, clean=clean))
        tb.unconditional = self._unconditional(batch, tb)
        return tb

    def rollout_shape(self, batch: dict[str, Any]) -> tuple[int, ...]:
        """[B, C, T, H, W] of a simulated rollout: the batch's latents' shape, else the recipe's
        (training.data.num_latent_t / num_height / num_width) for prompts-only data."""
        if batch.get("vae_latent") is not None:
            return tuple(batch["vae_latent"].shape)
        if self._rollout_shape is None:
            from fv_accel.data.loader import rollout_latent_shape

            self._rollout_shape = tuple(rollout_latent_shape(self.cfg, self.student.in_channels))
        return (int(batch["sample_index"].shape[0]), *self._rollout_shape)

    _rollout_shape: Optional[tuple[int, ...]] = None

    def check_data(self, loader: Any) -> None:
        """`data_latent` rolls out from the data's latents: a text-only dataset is refused in one line;
        `simulate` on one takes its shape from the recipe (checked here, before any step)."""
        from fv_accel.data.loader import check_rollout_data, rollout_latent_shape

        check_rollout_data(self._rollout_mode, loader)
        if getattr(loader, "preprocessed_data_type", None) == "text_only":
            self._rollout_shape = tuple(rollout_latent_shape(self.cfg, self.student.in_channels))

    def _unconditional(self, batch: dict[str, Any], tb: TrainingBatch) -> Any:
        """The unconditional branch: the pipeline's negative prompt (the dataset's stored
        unconditional text, `negative_text_embedding`) by default or with cfg_uncond text
        negative_prompt; the text zeroed with `zero`; the conditional text with `keep`."""
        policy = (self._cfg_uncond or {}).get("text") or "negative_prompt"
        cond = tb.conditioning
        if policy == "keep":
            return cond
        if policy == "negative_prompt" and batch.get("negative_text_embedding") is not None:
            negative = batch["negative_text_embedding"].to(device=self.device, dtype=torch.float32)
            mask = batch.get("negative_text_attention_mask")
            return dataclasses.replace(
                cond, text=negative, text_mask=None if mask is None else mask.to(device=self.device, dtype=torch.long)
            )
        return cond.unconditional()

    # ---- the roles' predictions (an image-to-video condition kept clean, at timestep 0) ----
    def _conditioned(self, x: torch.Tensor, timestep: torch.Tensor, tb: TrainingBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """x with its first frames replaced by the clean condition, and per-frame timesteps [B, T]:
        the step's value, 0 on the condition frames (as the family's image-to-video pipeline feeds them)."""
        k = tb.conditioning.clean_frames
        x = torch.cat([tb.extras["clean_condition"].to(x.dtype), x[:, :, k:]], dim=2)
        t = timestep.float().reshape(-1)[:1].expand(x.shape[0], x.shape[2]).clone()
        t[:, :k] = 0.0
        return x, t

    def predict_x0(self, role: ModelBase, x: torch.Tensor, timestep: torch.Tensor, tb: TrainingBatch, *,
                   conditional: bool, attn_kind: str) -> torch.Tensor:
        """A role's x0 (its own `predict_x0`); with an image-to-video condition the condition frames
        go in clean at timestep 0 and come out as they went in."""
        if not tb.conditioning.clean_frames:
            return role.predict_x0(x, timestep, tb, conditional=conditional, cfg_uncond=self._cfg_uncond, attn_kind=attn_kind)
        x_in, t_in = self._conditioned(x, timestep, tb)
        velocity = role.predict_noise(x_in, t_in, tb, conditional=conditional, cfg_uncond=self._cfg_uncond, attn_kind=attn_kind)
        x0 = role.training_table(x.shape).x0_from_velocity(x_in, velocity, timestep)
        return torch.cat([x_in[:, :, : tb.conditioning.clean_frames], x0[:, :, tb.conditioning.clean_frames:]], dim=2)

    # ---- the rollout ----
    def student_rollout(self, tb: TrainingBatch, *, with_grad: bool) -> torch.Tensor:
        """The student's x0 at a drawn exit of its few steps (see the module docstring)."""
        latents = tb.latents
        device = latents.device
        steps = self.denoising_steps(latents.shape)
        predict = dict(conditional=True, attn_kind=self._attn_kind)
        student = self.student
        if self._rollout_mode == "data_latent":
            timestep = steps[self._randint(len(steps), device)]
            noisy = student.add_noise(latents, self._randn_like_fastvideo(latents.shape, device), timestep)
            return self.predict_x0(student, noisy, timestep, tb, **predict)
        exit_index = int(self._randint(len(steps), device).item())
        x = self._randn_like_fastvideo(latents.shape, device)
        start = x.clone()
        renoised: list[torch.Tensor] = []
        with torch.no_grad():
            for k in range(len(steps) - 1):
                x0 = self.predict_x0(student, x, steps[k : k + 1], tb, **predict)
                x = self.student.add_noise(x0, self._randn_like_fastvideo(latents.shape, device), steps[k + 1 : k + 2])
                renoised.append(x.clone())
        noisy = renoised[exit_index - 1] if exit_index > 0 else start
        with torch.set_grad_enabled(with_grad and torch.is_grad_enabled()):
            return self.predict_x0(student, noisy, steps[exit_index : exit_index + 1], tb, **predict)

    # ---- the losses ----
    def dmd_loss(self, generator_x0: torch.Tensor, tb: TrainingBatch) -> torch.Tensor:
        """0.5 * ||x0 - sg(x0 - g)||^2 with g = (critic x0 - teacher's guided x0) / mean|x0 - teacher's guided x0|."""
        device = generator_x0.device
        with torch.no_grad():
            timestep = self.sample_score_timestep(generator_x0.shape, device)
            noise = self._randn_like_fastvideo(generator_x0.shape, device)
            noisy = self.student.add_noise(generator_x0, noise, timestep)
            fake_x0 = self.predict_x0(self.critic, noisy, timestep, tb, conditional=True, attn_kind="dense")
            real_cond = self.predict_x0(self.teacher, noisy, timestep, tb, conditional=True, attn_kind="dense")
            real_uncond = self.predict_x0(self.teacher, noisy, timestep, tb, conditional=False, attn_kind="dense")
            real_x0 = real_uncond + (real_cond - real_uncond) * self._guidance
            k = tb.conditioning.clean_frames  # the condition frames carry no loss
            fake_x0, real_x0 = fake_x0[:, :, k:], real_x0[:, :, k:]
            denom = torch.abs(generator_x0[:, :, k:] - real_x0).mean()
            grad = torch.nan_to_num((fake_x0 - real_x0) / denom)
        x0 = generator_x0[:, :, k:].float()  # sliced outside no_grad: the student's gradient flows through it
        return 0.5 * F.mse_loss(x0, (x0 - grad.float()).detach())

    def critic_loss(self, tb: TrainingBatch) -> torch.Tensor:
        """The critic's flow-matching loss on a fresh rollout of the student (no gradient to it)."""
        with torch.no_grad():
            generator_x0 = self.student_rollout(tb, with_grad=False)
        device = generator_x0.device
        timestep = self.sample_score_timestep(generator_x0.shape, device)
        noise = self._randn_like_fastvideo(generator_x0.shape, device)
        noisy = self.student.add_noise(generator_x0, noise, timestep)
        k = tb.conditioning.clean_frames
        model_t = timestep
        if k:  # the condition frames go in clean, at timestep 0, and carry no loss
            noisy, model_t = self._conditioned(noisy, timestep, tb)
        pred = self.critic.predict_noise(noisy, model_t, tb, conditional=True, cfg_uncond=self._cfg_uncond, attn_kind="dense")
        return torch.mean((pred.float() - (noise - generator_x0).float())[:, :, k:] ** 2)

    # ---- the public face ----
    def single_train_step(
        self, batch: dict[str, Any], iteration: int
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, LogScalar]]:
        self._generator = self.batch_generator(batch)
        tb = self._prepare_dmd_batch(batch)
        update_student = self.should_update_student(iteration)
        generator_loss = torch.zeros((), device=tb.latents.device, dtype=tb.latents.dtype)
        if update_student:
            generator_loss = self.dmd_loss(self.student_rollout(tb, with_grad=True), tb)
        fake_score_loss = self.critic_loss(tb)
        loss_map = {
            "total_loss": generator_loss + fake_score_loss,
            "generator_loss": generator_loss,
            "fake_score_loss": fake_score_loss,
        }
        outputs: dict[str, Any] = {"_fv_backward": {"update_student": update_student}, "training_batch": tb}
        metrics: dict[str, Any] = {"update_student": torch.tensor(float(update_student))}
        return loss_map, outputs, metrics

    def backward(self, loss_map: dict[str, torch.Tensor], outputs: dict[str, Any], *, grad_accum_rounds: int = 1) -> None:
        rounds = max(1, int(grad_accum_rounds))
        if outputs["_fv_backward"]["update_student"]:
            self.student.backward(loss_map["generator_loss"], None, grad_accum_rounds=rounds)
        self.critic.backward(loss_map["fake_score_loss"], None, grad_accum_rounds=rounds)

    def math_signature(self) -> dict[str, Any]:
        sig = super().math_signature()
        mc = self.cfg.method
        sig.update({
            "models.teacher.flow_shift": self.teacher.describe_training_shift(),
            "models.critic.flow_shift": self.critic.describe_training_shift(),
            "method.rollout_mode": self._rollout_mode,
            "method.dmd_denoising_steps": self._steps.tolist(),
            "method.warp_denoising_step": bool(mc.warp_denoising_step),
            "method.generator_update_interval": self._interval,
            "method.real_score_guidance_scale": self._guidance,
            "method.score_timestep_bounds": list(self._score_bounds),
            "method.fake_score_lr_scheduler": mc.fake_score_lr_scheduler,
        })
        return sig
