"""Reward training's validation (`method.validation`): the rewards of held-out prompts, never
trained on, sampled by the student (with its EMA where the run keeps one and `method.ema.validation`
is on) at `num_steps` of the method's sampler, every `every_steps` optimizer steps and at the last
step.

Each prompt is sampled `videos_per_prompt` times, sample v from its own generator seeded with
(seed, prompt, v), so every validation sees the same starting noises and the figures move only
with the weights. Logged: `validation/reward/<name>` (the mean over prompts and samples) and
`<name>_std` (the spread over samples), and once, at the start, the same figures of the reference
(`validation/reference/reward/<name>`: where the run started). Reward hacking shows beside them:
the KL term to the reference (logged by the method every step) and the sample watch, which compares
the samples' temporal variation and colour spread with the reference's on both sides (below
`callbacks.validation.collapse_ratio` times the reference's: collapse; above its inverse:
divergence) in one warning line naming the step, the figure and both values.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from fv_accel.trainer import TrainerCallback

logger = logging.getLogger(__name__)


class RewardValidationCallback(TrainerCallback):
    def __init__(self, cfg: Any, ema: Any = None):
        self.cfg = cfg
        self.spec = cfg.method.validation
        self.ema = ema
        self.prompts: list[str] = []
        self.conditioning: list[Any] = []
        self.shapes: list[tuple[int, ...]] = []
        self.reference: Optional[dict[str, float]] = None
        self.history: list[tuple[int, dict[str, float]]] = []

    # ---- the held-out prompts ----
    def on_train_start(self, trainer: Any) -> None:
        method = trainer.method
        self.prompts, self.conditioning, self.shapes = held_out_conditioning(self.cfg, method, trainer.dataloader)
        if trainer.start_step == 0 or self.reference is None:
            figures = self.evaluate(trainer, method.reference, use_ema=False)
            self.reference = figures
            if trainer.accelerator.is_main_process:
                trainer.log_metrics({f"validation/reference/{k}": v for k, v in figures.items()}, trainer.step)
                logger.info("held-out prompts (%d, %d samples each), the reference's: %s", len(self.prompts),
                            self.spec.videos_per_prompt, describe(figures))

    def on_step_end(self, trainer: Any, step: int, logs: dict) -> None:
        every = self.spec.every_steps
        last = step == self.cfg.training.loop.max_train_steps
        if not every or (step % every and not last):
            return
        figures = self.evaluate(trainer, trainer.method.student, use_ema=True, step=step)
        self.history.append((step, figures))
        if trainer.accelerator.is_main_process:
            trainer.log_metrics({f"validation/{k}": v for k, v in figures.items()}, step)
            logger.info("step %d: held-out prompts: %s", step, describe(figures))
        self.watch(trainer, step, figures)

    # ---- sampling and scoring ----
    @torch.no_grad()
    def evaluate(self, trainer: Any, role: Any, *, use_ema: bool, step: Optional[int] = None) -> dict[str, float]:
        """The rewards (mean and spread over samples) and the samples' video statistics of `role`."""
        from fv_accel.methods.rl.sampling import sample_policy, sampling_schedule
        from fv_accel.models.base import TrainingBatch
        from fv_accel.validation import video_statistics

        method, spec = trainer.method, self.spec
        n = spec.videos_per_prompt
        sampling = _with_steps(self.cfg.method.sampling, spec.num_steps)
        scores: dict[str, list[float]] = {}
        stats: list[tuple[float, float]] = []
        with_ema = use_ema and self.cfg.method.ema.validation and self.ema is not None and self.ema.ema is not None
        context = self.ema.applied() if with_ema else contextlib.nullcontext()
        was_training = role.transformer.training
        role.transformer.eval()
        with context:
            for p, (prompt, cond, latent) in enumerate(zip(self.prompts, self.conditioning, self.shapes)):
                # In batches of at most `batch_size`; each sample's own generator keeps the figures the same.
                for start in range(0, n, spec.batch_size):
                    k = min(spec.batch_size, n - start)
                    shape = (k, *latent)
                    tb = TrainingBatch(conditioning=_repeat(cond, k))
                    gens = [torch.Generator(device=method.device).manual_seed(_seed(spec.seed, p, start + v)) for v in range(k)]
                    schedule = sampling_schedule(method.sampling_shift(shape), sampling, method.device)
                    x0 = sample_policy(role, tb, shape, schedule, sampling.trajectory, gens, predict=method.predict_override)
                    clips = method.decode_for_reward(x0)
                    result, invalid = method.score(clips, [prompt] * k)
                    for name, value in result.items():
                        kept = value[~invalid.to(value.device)]
                        scores.setdefault(name, []).extend(kept.float().cpu().tolist())
                    frames = clips.numpy() if isinstance(clips, torch.Tensor) else clips
                    stats += [video_statistics(f) for f in frames] if frames.ndim == 5 else []
                    if start == 0 and step is not None and spec.log_samples and trainer.accelerator.is_main_process and frames.ndim == 5:
                        self.write_sample(trainer, step, p, frames[0])
        role.transformer.train(was_training)
        figures = {f"reward/{k}": float(np.mean(v)) if v else float("nan") for k, v in scores.items()}
        figures.update({f"reward/{k}_std": float(np.std(v)) if v else float("nan") for k, v in scores.items()})
        if stats:
            figures["temporal_variation"] = float(np.mean([s[0] for s in stats]))
            figures["colour_spread"] = float(np.mean([s[1] for s in stats]))
        return figures

    def write_sample(self, trainer: Any, step: int, p: int, frames: np.ndarray) -> Path:
        from fv_accel.data.video import write_video

        out = Path(trainer.output_dir) / "samples" / f"step-{step:06d}"
        return write_video(out / f"heldout-{p:02d}.mp4", frames, fps=self.cfg.callbacks.validation.fps)

    # ---- the sample watch ----
    def watch(self, trainer: Any, step: int, figures: dict[str, float]) -> None:
        """One warning when the samples' temporal variation or colour spread leave
        [ratio, 1 / ratio] times the reference's (callbacks.validation.collapse_ratio); with
        stop_on_collapse the run stops with a checkpoint."""
        if not self.reference or "temporal_variation" not in figures:
            return
        from fv_accel.validation import sample_watch_message

        val = self.cfg.callbacks.validation
        message = sample_watch_message(step, "the student's held-out samples", figures, self.reference, "the reference's",
                                       float(val.collapse_ratio))
        if message is None:
            return
        logger.warning("%s", message)
        if val.stop_on_collapse:
            trainer.request_stop(f"callbacks.validation.stop_on_collapse ({message})")

    def summary(self) -> dict[str, Any]:
        if not self.history:
            return {}
        step, last = self.history[-1]
        out = {f"held-out {k} (step {step})": round(v, 4) for k, v in last.items() if k.startswith("reward/")}
        if self.reference:
            out.update({f"held-out {k} (reference)": round(v, 4) for k, v in self.reference.items() if k.startswith("reward/")})
        return out


def describe(figures: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.4f}" for k, v in figures.items())


def _seed(seed: int, prompt: int, sample: int) -> int:
    from fv_accel.seeding import derived_seed

    return derived_seed(seed, "nft-validation", prompt, sample)


def _repeat(cond: Any, n: int) -> Any:
    return cond.select(torch.zeros(n, dtype=torch.long, device=cond.text.device))


def _with_steps(sampling: Any, num_steps: int) -> Any:
    import dataclasses

    return dataclasses.replace(sampling, num_steps=int(num_steps), timesteps=None, sigmas=None)


def held_out_conditioning(cfg: Any, method: Any, loader: Any) -> tuple[list[str], list[Any], list[tuple[int, ...]]]:
    """The held-out prompts, their conditioning (one sample each) and latent shapes [C, T, H, W]
    (the row's, or the recipe's for text-only rows): `method.validation.prompts`
    taken from the training rows that hold them (the method never trains on those rows), else the
    first `num_prompts` rows of `method.validation.data_path`."""
    from fv_accel.data.loader import LatentDataset, collate

    spec = cfg.method.validation
    if spec.prompts:
        rows = {p: r[0] for p, r in method.caption_rows(loader.dataset).items()}
        missing = [p for p in spec.prompts if p not in rows]
        if missing:
            raise ValueError(f"method.validation.prompts: {missing[0]!r} is the caption of no row of the training data "
                             "(its text embedding comes from there); use a caption of the dataset or method.validation.data_path")
        items = [loader.dataset[(rows[p], 0, 0)] for p in spec.prompts]
    else:
        dataset = LatentDataset(spec.data_path, text_max_length=cfg.training.data.text_max_length)
        items = [dataset[(i, 0, 0)] for i in range(min(spec.num_prompts, len(dataset)))]
    sampled = [method.conditioning_of(collate([item])) for item in items]
    return [str(item.get("caption", "")) for item in items], [c for c, _ in sampled], [shape[1:] for _, shape in sampled]
