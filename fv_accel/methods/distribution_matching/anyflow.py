"""AnyFlowMethod: on-policy flow-map distillation (stage 2 of AnyFlow), DMD2 with a multi-step
flow-map rollout of the student, with FastVideo 0.2.1's semantics and key names (`method.name: anyflow`).

The student (an AnyFlow flow map u(x_t, t, r), `predict_velocity_with_r`) is rolled out from pure
noise over its schedule: `method.t_list_override` as given (absolute timesteps, descending, ending
at 0), else `dmd_denoising_steps` (through the student's table with `warp_denoising_step`) with a
final 0; a schedule of more than `student_sample_steps` steps keeps its first `student_sample_steps`
entries and its last. Each step is x <- x - (t_k - t_{k+1}) / N * u(x, t_k, r) with r = t_{k+1}
(`use_mean_velocity`, the default) or r = t_k.

Per step (iteration = the 1-based step number), every draw from the method's generator in order:
1. the SFT preparation's draws (noise, u), unused, as in DMD2;
2. when the student is updated: the gradient step's index randint(0, steps), the start noise;
   the DMD gradient (score timestep, noise) on the state right after that one gradient-enabled
   step: the rollout's clean output only when that step is the last (FastVideo's choice, kept:
   the teacher and critic then score a partly denoised latent);
3. the critic's loss on a second, full rollout without gradient from a fresh start noise (score
   timestep, noise).
The rollout stops after its gradient step (FastVideo runs the remaining steps and discards them:
the same numbers, fewer forwards), except under a sharded engine (FSDP2, ZeRO-3), where every rank
runs all steps so that the ranks' forwards, collectives there, line up. Teacher and critic are plain velocity models (DMD2's
predict_x0): their x0 is the jump from t to r = 0, which is what `dmd_score_r_value` names; only
0 (or null) is accepted.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from fv_accel.methods.distribution_matching.anyflow_pretrain import require_flow_map
from fv_accel.methods.distribution_matching.dmd2 import STUDENT_STEPS_FILE, DMD2Method, write_json_atomically
from fv_accel.models.base import ModelBase, TrainingBatch


def parse_t_list(raw: Any, n: int) -> Optional[list[float]]:
    """`method.t_list_override`: None, or at least two numbers in [0, N], descending, the last 0."""
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) < 2 or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in raw):
        raise ValueError(f"method.t_list_override must be a list of at least two timesteps ending at 0, e.g. [999, 937, 833, 624, 0], got {raw!r}")
    values = [float(v) for v in raw]
    if any(not 0.0 <= v <= n for v in values) or any(b > a for a, b in zip(values, values[1:])):
        raise ValueError(f"method.t_list_override must be descending timesteps in [0, {n}], got {raw!r}")
    if values[-1] != 0.0:
        raise ValueError(
            f"method.t_list_override must end at 0 (the rollout's clean output), got {raw!r}: append 0"
        )
    return values


class AnyFlowMethod(DMD2Method):
    """DMD2 whose student is a flow map rolled out over several steps from noise."""

    def __init__(self, *, cfg: Any, role_models: dict[str, ModelBase]) -> None:
        mc = cfg.method
        # Parsed before DMD2's constructor, which reads the step list (`_parse_denoising_steps`) and
        # checks the sampling schedule.
        student = role_models.get("student")
        self._t_list = parse_t_list(mc.t_list_override, 1000 if student is None else student.training_table(torch.Size([1] * 5)).num_train_timesteps)
        steps = 4 if mc.student_sample_steps is None else mc.student_sample_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"method.student_sample_steps must be an integer >= 1, got {steps!r}")
        self._sample_steps = steps
        if not isinstance(mc.use_mean_velocity, bool):
            raise ValueError(f"method.use_mean_velocity must be true or false, got {mc.use_mean_velocity!r}")
        self._use_mean_velocity = mc.use_mean_velocity
        if student is not None:
            require_flow_map(student, "student", "anyflow")
        super().__init__(cfg=cfg, role_models=role_models)
        score_r = mc.dmd_score_r_value
        if score_r is not None and (isinstance(score_r, bool) or not isinstance(score_r, (int, float)) or float(score_r) != 0.0):
            raise ValueError(
                f"method.dmd_score_r_value: got {score_r!r}, but the teacher and critic are velocity models whose x0 "
                "prediction is the jump to r = 0: only 0 (or null) is what the method does"
            )

    def _parse_denoising_steps(self, raw: Any) -> torch.Tensor:
        """dmd_denoising_steps: optional beside t_list_override (which then sets the rollout), and
        then equal to it without its final 0, so that no configured value is ignored."""
        if self._t_list is None:
            return super()._parse_denoising_steps(raw)
        if raw is None:  # kept for the run's record (math_signature); the rollout reads the override
            return torch.tensor(self._t_list[:-1], dtype=torch.float32)
        steps = super()._parse_denoising_steps(raw)
        if [float(s) for s in raw] != self._t_list[:-1]:
            raise ValueError(
                f"method.dmd_denoising_steps {raw!r} disagrees with method.t_list_override {self._t_list!r}, which sets "
                "the rollout: remove dmd_denoising_steps or make it the override without its final 0"
            )
        return steps

    # ---- the schedule ----
    def rollout_timesteps(self, latent_shape: torch.Size) -> torch.Tensor:
        """The rollout's timesteps [K + 1] (fp32, descending, ending at 0), capped at student_sample_steps."""
        if self._t_list is not None:
            schedule = torch.tensor(self._t_list, dtype=torch.float32, device=self.device)
        else:
            schedule = self.denoising_steps(latent_shape).to(torch.float32)
            if float(schedule[-1]) != 0.0:
                schedule = torch.cat([schedule, torch.zeros(1, device=schedule.device)])
        if schedule.numel() - 1 > self._sample_steps:
            schedule = torch.cat([schedule[: self._sample_steps], schedule[-1:]])
        return schedule

    def few_step_sigmas(self, latent_shape: torch.Size) -> list[float]:
        """The sigma (t / N) of each of the student's steps (the final 0 excluded)."""
        n = float(self.table.num_train_timesteps)
        return [float(t) / n for t in self.rollout_timesteps(latent_shape)[:-1]]

    def sampling_schedule(self) -> Any:
        """diffusers' FlowMapEulerDiscreteScheduler at the student's shift, where its K-step schedule
        is the rollout's within 1.5 timesteps (FastVideo's [999, 937, 833, 624, 0] is its 4 steps at shift 5
        rounded down); another schedule is a ValueError naming it."""
        from fv_accel.sampling import SamplingSchedule
        from fv_accel.methods.distribution_matching.anyflow_pretrain import apply_shift

        one = torch.Size([1, 1, 1, 1, 1])
        rollout = self.rollout_timesteps(one).cpu()
        k, n = rollout.numel() - 1, self.table.num_train_timesteps
        shift = float(self.student.training_shift(one))
        own = apply_shift(torch.linspace(1.0, 0.0, k + 1), shift) * n
        if float((own - rollout).abs().max()) > 1.5:
            raise ValueError(
                f"the student's rollout timesteps {[round(float(t), 2) for t in rollout]} are not FlowMapEulerDiscreteScheduler's "
                f"{k} steps at shift {shift:g} ({[round(float(t), 2) for t in own]})"
            )
        config = {"num_train_timesteps": n, "shift": shift}
        return SamplingSchedule("FlowMapEulerDiscreteScheduler", config, "the student's rollout (method.t_list_override / dmd_denoising_steps)")

    def student_steps_record(self) -> dict[str, Any]:
        """What `student_steps.json` holds: the rollout's timesteps (with the final 0) and how the
        student steps between them (the flow map, r the next timestep or the current one)."""
        one = torch.Size([1, 1, 1, 1, 1])
        return {
            "method": self.cfg.method.name,
            "timesteps": [float(t) for t in self.rollout_timesteps(one)],
            "sigmas": self.few_step_sigmas(one),
            "student_sample_type": "flow_map",
            "use_mean_velocity": self._use_mean_velocity,
        }

    def write_final_files(self, output_dir: Any) -> None:
        """`student_steps.json` (the stock flow-map scheduler beside the student is the family's to write)."""
        from pathlib import Path

        write_json_atomically(Path(output_dir) / STUDENT_STEPS_FILE, self.student_steps_record())

    # ---- the rollout ----
    def student_rollout(self, tb: TrainingBatch, *, with_grad: bool) -> torch.Tensor:
        """The state right after the drawn gradient step (with_grad), or the full rollout's output."""
        latents = tb.latents
        device, b = latents.device, latents.shape[0]
        schedule = self.rollout_timesteps(latents.shape)
        steps = schedule.numel() - 1
        grad_step = int(self._randint(steps, device).item()) if with_grad else -1
        x = self._randn_like_fastvideo(latents.shape, device)
        n = float(self.table.num_train_timesteps)
        for i in range(steps):
            t_cur, t_next = schedule[i].expand(b), schedule[i + 1].expand(b)
            r = t_next if self._use_mean_velocity else t_cur
            enable = i == grad_step and torch.is_grad_enabled()
            with torch.set_grad_enabled(enable):
                v = self.student.predict_velocity_with_r(
                    x, t_cur, r, tb, conditional=True, cfg_uncond=self._cfg_uncond, attn_kind=self._attn_kind
                )
            x = x - ((t_cur - t_next) / n).view(-1, 1, 1, 1, 1) * v
            if i == grad_step:
                if not self._forwards_are_collective():
                    return x
                out, x = x, x.detach()
        return x if grad_step < 0 else out

    def _forwards_are_collective(self) -> bool:
        """Whether each student forward is a collective (an FSDP2 module, or ZeRO-3's partitioned
        parameters): every rank must then run as many forwards as the others, so the rollout runs its
        steps past the drawn gradient step (without gradient, discarded, as FastVideo runs them)
        wherever the ranks drew different steps."""
        from torch.distributed.fsdp import FSDPModule

        module = self.student.transformer
        return isinstance(module, FSDPModule) or hasattr(next(module.parameters()), "ds_numel")

    def math_signature(self) -> dict[str, Any]:
        sig = super().math_signature()
        sig.update({
            "method.rollout_timesteps": [float(t) for t in self.rollout_timesteps(torch.Size([1, 1, 1, 1, 1]))],
            "method.use_mean_velocity": self._use_mean_velocity,
        })
        return sig
