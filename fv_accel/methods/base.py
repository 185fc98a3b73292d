"""TrainingMethod: owns the math (noise, timestep sampling, noising, the loss, the held-out loss),
never the model's internals. The student is reached only through the model contract
(`fv_accel/models/base.py`): `prepare_batch` (clean latents + conditioning), `forward`, `backward`.

Random draws per step, on one generator per rank (`seed + rank`) or one per sample: noise
[B, C, T, H, W], then `u` [B] (then, in DFSFT, the chunk indices): REFERENCE.md section 2.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal, Optional, Union

import torch
from accelerate import PartialState

from fv_accel.models.base import Conditioning, ModelBase, TrainingBatch
from fv_accel.models.context_parallel import data_parallel_layout
from fv_accel.schedulers import FlowMatchTable, GeneratorLike, randn
from fv_accel.seeding import sample_generator_seed

LogScalar = Union[float, int]


def flow_matching_loss(
    pred: torch.Tensor,
    clean: torch.Tensor,
    noisy: torch.Tensor,
    noise: torch.Tensor,
    sigmas: torch.Tensor,
    *,
    precondition_outputs: bool,
    reduce_dims: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """Squared error in fp32 of the velocity (or, preconditioned, of x0_hat = x_t - sigma * pred).

    `sigmas` is [B] or per frame [B, T]; `reduce_dims=None` averages every element, otherwise only
    over the given dims (DFSFT keeps [B, T]).
    """
    pred = pred.float()
    if precondition_outputs:
        sigma = FlowMatchTable.expand_sigma(sigmas.float(), pred.ndim)
        err = noisy.float() - sigma * pred - clean.float()
    else:
        err = pred - (noise.float() - clean.float())
    sq = err.pow(2)
    return sq.mean() if reduce_dims is None else sq.mean(dim=reduce_dims)


def _parse_ratio(raw: Any, key: str) -> float:
    if isinstance(raw, bool):
        raise ValueError(f"method.{key} must be a number in [0, 1], got bool {raw!r}")
    if isinstance(raw, (int, float)):
        value = float(raw)
    elif isinstance(raw, str):
        try:
            value = float(raw.strip())
        except ValueError:
            raise ValueError(f"method.{key} must be a number in [0, 1], got {raw!r}") from None
    else:
        raise ValueError(f"method.{key} must be a number in [0, 1], got {type(raw).__name__} {raw!r}")
    if not (0.0 <= value <= 1.0) or math.isnan(value):
        raise ValueError(f"method.{key} must be in [0, 1], got {raw!r}")
    return value


def parse_timestep_index_range(min_raw: Any, max_raw: Any, num_train_timesteps: int = 1000) -> tuple[int, int]:
    """The half-open table-index range [lo, hi + 1) from the timestep ratios. Defaults give [0, N)."""
    lo_ratio = _parse_ratio(0.0 if min_raw is None else min_raw, "min_timestep_ratio")
    hi_ratio = _parse_ratio(1.0 if max_raw is None else max_raw, "max_timestep_ratio")
    if hi_ratio < lo_ratio:
        raise ValueError(
            f"method.max_timestep_ratio ({hi_ratio}) must be >= method.min_timestep_ratio ({lo_ratio})"
        )
    n = num_train_timesteps
    lo = min(max(int(lo_ratio * n), 0), n - 1)
    hi = min(max(int(hi_ratio * n), 0), n - 1)
    if hi <= lo:
        hi = min(n - 1, lo + 1)
    return lo, hi + 1


# Redraws of the rejected samples before giving up (a range of one index in 1000 needs ~1000 on average).
MAX_REJECTION_ROUNDS = 100_000


class TrainingMethod:
    """Base of the training methods: the random stream, the table, noising and the losses."""

    def __init__(self, *, cfg: Any, role_models: dict[str, ModelBase]) -> None:
        self.cfg = cfg
        self.role_models = role_models
        # The seed's methods read `method_config.get(...)`: keep a plain mapping of the section.
        self.method_config: dict[str, Any] = dataclasses.asdict(cfg.method)
        self.training_config = cfg.training
        state = PartialState()
        self.device = state.device
        self.process_index = state.process_index
        self.seed = int(cfg.training.data.seed)
        self.noise_rng = cfg.training.loop.noise_rng
        # One generator per data-parallel rank seeded seed + rank (FastVideo's "cuda_generator", on
        # the device): the processes of one context-parallel group draw the same noise and timesteps.
        self.dp_size, self.dp_rank = data_parallel_layout(cfg.training.model.context_parallel, state.num_processes, self.process_index)
        self.cuda_generator = torch.Generator(device=self.device).manual_seed(self.seed + self.dp_rank)
        # The training table of the scheduler adapter (the training shift, REFERENCE.md section 1).
        # The student gives it per latent shape (a resolution-dependent shift differs by bucket);
        # `noise_to` selects the batch's. Until then it is the table of a one-token latent, used only
        # for what every shift shares (its length) and for static-shift students' timestep bounds.
        student = role_models.get("student")
        self.table = None if student is None else student.training_table(torch.Size([1, 1, 1, 1, 1]))
        # Built by fv_accel.build (build_optimizer / build_lr_scheduler) and prepared by Accelerate.
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: Any = None

    @property
    def student(self) -> ModelBase:
        return self.role_models["student"]

    # DFSFT's chunk size; None for a method that noises the whole clip at one level.
    chunk_size: Optional[int] = None

    def _require_trainable_student(self, label: str) -> None:
        if "student" not in self.role_models:
            raise ValueError(f"{label} requires role 'student'")
        if not self.student._trainable:
            raise ValueError(f"{label} requires student to be trainable")

    def _init_student(self) -> None:
        """The student reads its preprocessors; the index range follows the recipe and the student;
        under VSA the student starts at the ramp's sparsity before the first step."""
        self.student.init_preprocessors(self.training_config)
        self._timestep_index_range = self._index_range()
        self.set_vsa_step(0)

    def _infer_attn_kind(self) -> Literal["dense", "vsa"]:
        """"vsa" when the recipe trains with video sparse attention (`training.vsa.sparsity` > 0:
        the student has VSA installed, fv_accel/vsa.py), else "dense"."""
        if not self.training_config.vsa.enabled:
            return "dense"
        if not self.student.vsa_controllers:
            raise ValueError(f"training.vsa.sparsity: the {self.student.family} student has no video sparse attention installed")
        return "vsa"

    # ---- video sparse attention ----
    # The attention kind (`_infer_attn_kind`, set by each method's constructor); dense until then.
    _attn_kind: Literal["dense", "vsa"] = "dense"
    # The sparsity of the step being trained under VSA; None with dense attention.
    vsa_sparsity: Optional[float] = None

    def set_vsa_step(self, step: int) -> Optional[float]:
        """Under VSA: the sparsity of optimizer step `step` (1-based; 0 before the first) from the
        recipe's ramp, set on the student's attention and returned; None with dense attention."""
        if self._attn_kind != "vsa":
            return None
        from fv_accel.vsa import ramp_sparsity

        spec = self.training_config.vsa
        self.vsa_sparsity = ramp_sparsity(step, spec.sparsity, spec.decay_rate, spec.decay_interval_steps)
        self.student.set_vsa_sparsity(self.vsa_sparsity)
        return self.vsa_sparsity

    def attach_vsa_metadata(self, tb: TrainingBatch) -> TrainingBatch:
        """Under VSA, the forward's `attn_metadata_vsa` (token grid, tiles, the step's sparsity)."""
        if self._attn_kind == "vsa":
            from fv_accel.vsa import VSAMetadata

            tb.attn_metadata_vsa = VSAMetadata.of(tb.noisy_model_input.shape, self.student.patch_size, self.vsa_sparsity)
        return tb

    # ---- the timestep range ----
    def _index_range(self) -> tuple[int, int]:
        """[lo, hi) of table indices to train on: the recipe's ratios, within the student's range
        (a Wan 2.2 expert trains only on its own side of the boundary)."""
        n = self.table.num_train_timesteps
        mc = self.method_config
        recipe = parse_timestep_index_range(mc.get("min_timestep_ratio", 0.0), mc.get("max_timestep_ratio", 1.0), n)
        bounds = self.student.timestep_bounds()
        if bounds is None:
            return recipe
        t_lo, t_hi = bounds
        inside = ((self.table.timesteps >= t_lo) & (self.table.timesteps < t_hi)).nonzero().flatten()
        if inside.numel() == 0:
            raise ValueError(f"the student's timestep range [{t_lo:g}, {t_hi:g}) holds no entry of the training table")
        student = (int(inside.min()), int(inside.max()) + 1)
        if recipe == (0, n):
            return student
        if not (student[0] <= recipe[0] and recipe[1] <= student[1]):
            ratios = (mc.get("min_timestep_ratio"), mc.get("max_timestep_ratio"))
            raise ValueError(
                f"method.min_timestep_ratio/max_timestep_ratio {ratios[0]}/{ratios[1]} select table indices "
                f"[{recipe[0]}, {recipe[1]}), outside the student's range [{student[0]}, {student[1]}) "
                f"(timesteps [{t_lo:g}, {t_hi:g}), {self.student.describe_timestep_bounds()}): "
                f"choose ratios inside it, or leave them at 0.0/1.0 to train the student's whole range"
            )
        return recipe

    # ---- random draws ----
    def batch_generator(self, batch: dict) -> Union[torch.Generator, list[torch.Generator]]:
        """The generator(s) this micro-batch draws from (see `training.loop.noise_rng`)."""
        if self.noise_rng == "rank":
            return self.cuda_generator
        indices = batch["sample_index"].tolist()
        epochs = batch["epoch"].tolist()
        return [
            torch.Generator(device=self.device).manual_seed(sample_generator_seed(self.seed, e, i))
            for e, i in zip(epochs, indices)
        ]

    def sample_homogeneous_indices(
        self, batch_size: int, generator: GeneratorLike, device: torch.device, *, in_range: bool = True
    ) -> torch.Tensor:
        """One table index per sample from the recipe's density, restricted to the index range by
        rejection (only rejected samples are redrawn), so the density keeps its shape inside it."""
        tm = self.training_config.model
        density = dict(
            weighting_scheme=tm.weighting_scheme, logit_mean=tm.logit_mean, logit_std=tm.logit_std, mode_scale=tm.mode_scale
        )
        idx = self.table.sample_homogeneous_indices(batch_size, generator, device, **density)
        lo, hi = self._timestep_index_range
        if not in_range or (lo, hi) == (0, self.table.num_train_timesteps):
            return idx
        per_sample = not isinstance(generator, torch.Generator)
        for _ in range(MAX_REJECTION_ROUNDS):
            rejected = ((idx < lo) | (idx >= hi)).nonzero().flatten()
            if rejected.numel() == 0:
                return idx
            gens = [generator[int(i)] for i in rejected] if per_sample else generator
            idx[rejected] = self.table.sample_homogeneous_indices(rejected.numel(), gens, device, **density)
        raise RuntimeError(
            f"timestep sampling: no draw of training.model.weighting_scheme {tm.weighting_scheme!r} fell in table "
            f"indices [{lo}, {hi}) after {MAX_REJECTION_ROUNDS} rounds; widen the range or change the density"
        )

    # ---- noising ----
    def prepare(
        self, batch: dict, generator: GeneratorLike, *, in_range: bool = True, clean: Optional[TrainingBatch] = None
    ) -> TrainingBatch:
        """Clean latents and conditioning from the student (the data's; `clean` where the method
        gives its own, as DMD2's rollout start), then noise [B, C, T, H, W] and one homogeneous table
        index per sample from `generator` (in that order), noised, then the audio's noise where
        there is audio. With `in_range=False` the index is one plain draw (DFSFT discards it and
        draws per chunk)."""
        tb = self.student.prepare_batch(batch, latents_source="data") if clean is None else clean
        if tb.latents is None or tb.conditioning is None:
            raise RuntimeError("prepare_batch() must set TrainingBatch.latents and .conditioning")
        tb.noise = randn(tb.latents.shape, generator, tb.latents.device)
        idx = self.sample_homogeneous_indices(tb.latents.shape[0], generator, tb.latents.device, in_range=in_range)
        return self.noise_audio(self.noise_to(tb, idx), generator)

    # ---- audio (families that make sound with the picture: LTX-2) ----
    def noise_audio(self, tb: TrainingBatch, generator: GeneratorLike) -> TrainingBatch:
        """Where the student gave clean audio latents (`tb.extras["audio"]`: an `AudioLatents`), draw
        their noise after every video draw and noise them at the sample's level (the highest of its
        frames': LTX2ImageToVideoPipeline's audio timestep beside a clean first frame). A sample
        without sound gets pure noise (sigma 1). The noisy audio and its sigmas go to the conditioning
        (`audio_noisy`, `audio_sigmas`) for the family's forward."""
        audio = tb.extras.get("audio")
        if audio is None:
            return tb
        return self.noise_audio_with(tb, randn(audio.latents.shape, generator, audio.latents.device))

    def noise_audio_with(self, tb: TrainingBatch, noise: torch.Tensor) -> TrainingBatch:
        """`noise_audio` with the audio noise given."""
        audio = tb.extras["audio"]
        sigma = tb.sigmas if tb.sigmas.ndim == 1 else tb.sigmas.amax(dim=1)
        sigma = self.student.audio_sigmas(sigma)  # the audio's own level at this step (MiniMax-H3's shift)
        sigma = torch.where(audio.present, sigma, torch.ones_like(sigma))
        s = sigma.view(-1, *([1] * (audio.latents.ndim - 1)))
        tb.extras["audio_noise"] = noise
        tb.conditioning.extras["audio_noisy"] = (1.0 - s) * audio.latents + s * noise
        tb.conditioning.extras["audio_sigmas"] = sigma
        return tb

    def audio_loss(self, tb: TrainingBatch) -> Optional[torch.Tensor]:
        """The audio velocity's mean squared error over the samples with sound, where the student
        trains its audio (`train_audio`); None otherwise (or when no sample of the batch has sound)."""
        if not self.student.trains_audio:
            return None
        return self.audio_error(tb)

    def audio_error(self, tb: TrainingBatch) -> Optional[torch.Tensor]:
        """The audio velocity's mean squared error over the samples with sound (None without any)."""
        audio = tb.extras.get("audio")
        pred = tb.conditioning.extras.get("audio_prediction") if tb.conditioning is not None else None
        if audio is None or pred is None or not bool(audio.present.any()):
            return None
        err = (pred.float() - (tb.extras["audio_noise"].float() - audio.latents.float())).pow(2)
        per_sample = err.flatten(1).mean(dim=1)
        return per_sample[audio.present].mean()

    def with_audio_loss(self, video_loss: torch.Tensor, tb: TrainingBatch, loss_key: str) -> tuple[dict, dict, dict]:
        """The step result of `video_loss`, plus (joint training) the audio loss weighted by
        `training.audio.loss_weight` in the total, both logged (`video_loss`, `audio_loss`) with the
        share of the batch's samples that have sound (`audio_share`). A batch without sound adds an
        audio loss of 0 that still reaches every audio parameter, so that the processes of a
        data-parallel run all log the same keys and reduce gradients of the same parameters."""
        pred = tb.conditioning.extras.get("audio_prediction") if tb.conditioning is not None else None
        if not self.student.trains_audio or pred is None:
            return self._step_result(video_loss, tb, loss_key)
        audio = self.audio_loss(tb)
        if audio is None:
            audio = pred.float().sum() * 0.0
        total = video_loss + float(self.training_config.audio.loss_weight) * audio
        loss_map, outputs, metrics = self._step_result(total, tb, loss_key)
        loss_map.update(video_loss=video_loss, audio_loss=audio)
        metrics["audio_share"] = tb.extras["audio"].present.float().mean()
        return loss_map, outputs, metrics

    def noise_to(self, tb: TrainingBatch, idx: torch.Tensor) -> TrainingBatch:
        """Set the noise level (table indices [B] or per frame [B, T]) and noise the clean latents.

        Clean condition frames (`conditioning.clean_frames`) stay x0 at timestep 0 and index -1;
        the per-sample level then becomes per frame."""
        table = self.table = self.student.training_table(tb.latents.shape)
        k = tb.conditioning.clean_frames if tb.conditioning is not None else 0
        if k:
            num_frames = tb.latents.shape[2]
            if idx.ndim == 1:
                idx = idx[:, None].expand(-1, num_frames).clone()
            idx[:, :k] = -1
            clean = idx < 0
            safe = idx.clamp_min(0)
            tb.sigmas = table.sigmas_at(safe).masked_fill(clean, 0.0)
            tb.timesteps = table.timesteps_at(safe).masked_fill(clean, 0.0)
        else:
            tb.sigmas = table.sigmas_at(idx)
            tb.timesteps = table.timesteps_at(idx)
        tb.timestep_indices = idx
        tb.noisy_model_input = table.add_noise(tb.latents, tb.noise, tb.sigmas)
        return tb

    # ---- losses ----
    def _loss(self, pred: torch.Tensor, tb: TrainingBatch, reduce_dims: tuple[int, ...] | None) -> torch.Tensor:
        return flow_matching_loss(
            pred,
            tb.latents,
            tb.noisy_model_input,
            tb.noise,
            tb.sigmas,
            precondition_outputs=bool(self.training_config.model.precondition_outputs),
            reduce_dims=reduce_dims,
        )

    def per_frame_loss(self, pred: torch.Tensor, tb: TrainingBatch) -> torch.Tensor:
        """[B, T]: each frame's mean squared error (velocity, or x0 with precondition_outputs)."""
        return self._loss(pred, tb, (1, 3, 4))

    def unweighted_loss(self, pred: torch.Tensor, tb: TrainingBatch) -> torch.Tensor:
        """The mean squared error over every element of the frames that carry a loss."""
        k = tb.conditioning.clean_frames if tb.conditioning is not None else 0
        return self.per_frame_loss(pred, tb)[:, k:].mean() if k else self._loss(pred, tb, None)

    @torch.no_grad()
    def heldout_loss(
        self, latents: torch.Tensor, noise: torch.Tensor, idx: torch.Tensor, conditioning: Conditioning,
        audio: Any = None, audio_noise: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """The unweighted training loss of clean `latents` noised with the given `noise` to table
        indices `idx` ([B], or per frame [B, T]): the held-out evaluation's score. With the clean
        `audio` of a family that makes sound (and its `audio_noise`), the audio is noised at the
        samples' levels and its loss, where a sample has sound, is left in
        `conditioning.extras["audio_loss"]`; the video's is returned."""
        tb = TrainingBatch(latents=latents, noise=noise, conditioning=conditioning)
        self.noise_to(tb, idx.clone())
        if audio is not None:
            tb.extras["audio"] = audio
            self.noise_audio_with(tb, audio_noise)
        pred = self.student.forward(tb.noisy_model_input, tb.timesteps, conditioning)
        if audio is not None:
            conditioning.extras["audio_loss"] = self.audio_error(tb)
        return self.unweighted_loss(pred, tb)

    def _step_result(
        self, loss: torch.Tensor, tb: Any, loss_key: str
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
        """The (loss_map, outputs, metrics) every method's single_train_step returns."""
        loss_map = {"total_loss": loss, loss_key: loss}
        metadata = tb.attn_metadata_vsa if self._attn_kind == "vsa" else tb.attn_metadata
        outputs: dict[str, Any] = {"_fv_backward": (tb.timesteps, metadata), "training_batch": tb}
        # Tensors, not floats: converting here would sync the device every micro-step.
        metrics: dict[str, Any] = {"mean_sigma": tb.sigmas.detach().float().mean()}
        return loss_map, outputs, metrics

    # ---- the public face (seed) ----
    def single_train_step(
        self, batch: dict[str, Any], iteration: int
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, LogScalar]]:
        raise NotImplementedError

    def backward(
        self, loss_map: dict[str, torch.Tensor], outputs: dict[str, Any], *, grad_accum_rounds: int = 1
    ) -> None:
        grad_accum_rounds = max(1, int(grad_accum_rounds))
        self.student.backward(loss_map["total_loss"], outputs.get("_fv_backward"), grad_accum_rounds=grad_accum_rounds)

    # ---- what the trainer steps, clips and checkpoints: the method owns its optimizers ----
    # The roles that train, by name (each prepared by the engine with its optimizer and schedule).
    def trainable_roles(self) -> dict[str, ModelBase]:
        return {"student": self.student}

    @property
    def optimizer_dict(self) -> dict[str, Any]:
        return {"student": self.optimizer}

    @property
    def lr_scheduler_dict(self) -> dict[str, Any]:
        return {"student": self.lr_scheduler}

    def set_optimizer(self, role: str, optimizer: Any, lr_scheduler: Any) -> None:
        """A role's optimizer and LR schedule (as the engine's prepare returned them)."""
        if role != "student":
            raise KeyError(f"{type(self).__name__} has no optimizer for role {role!r}")
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler

    def get_optimizers(self, iteration: int) -> list[Any]:
        """The optimizers that step at `iteration` (the 1-based step number)."""
        del iteration
        return [self.optimizer]

    def get_lr_schedulers(self, iteration: int) -> list[Any]:
        """The LR schedules that step at `iteration`."""
        del iteration
        return [self.lr_scheduler]

    def get_grad_clip_targets(self, iteration: int) -> dict[str, torch.nn.Module]:
        """The modules whose gradients are clipped (each to the recipe's max norm) at `iteration`."""
        del iteration
        return {"student": self.student.transformer}

    def lr_scheduler_steps(self, step: int) -> dict[str, int]:
        """How many steps each LR schedule has taken after `step` optimizer steps (resume checks it)."""
        return {"student": step}

    # Where the student's VAE and text encoder come from (a Hub id or folder; set by the build).
    model_source: Optional[str] = None

    def train_batches(self, loader: Any, device: torch.device, step: int) -> Any:
        """The micro-batches the trainer's steps consume from optimizer step `step` on (an iterator
        with `close()`): the loader's batches, read ahead on a background thread."""
        from fv_accel.data.loader import BatchPrefetcher

        del step
        return BatchPrefetcher(loader, device)

    def on_step_end(self, step: int) -> None:
        """After optimizer step `step` (1-based) is counted, before callbacks and checkpoints; nothing here."""

    def check_data(self, loader: Any) -> None:
        """Refuse, in one line, training data this method cannot use (called once the loader is built)."""

    def write_final_files(self, output_dir: Any) -> None:
        """Files of the method's own beside the final weights (main process); none here."""

    def saved_roles(self) -> dict[str, ModelBase]:
        """Roles written beside the student's final weights, by output subfolder (none here)."""
        return {}

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The method's own per-rank state saved with each checkpoint (its extra generators); none here."""
        return {}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore what `state_tensors` saved."""

    # Which recipe keys change this method's math (checked on resume).
    def math_signature(self) -> dict[str, Any]:
        return {
            "method.name": self.cfg.method.name,
            "models.student.flow_shift": self.student.describe_training_shift(),
            "training.loop.max_train_steps": self.training_config.loop.max_train_steps,
            "training.optimizer.lr_scheduler": self.training_config.optimizer.lr_scheduler,
            **self._vsa_signature(),
        }

    def _vsa_signature(self) -> dict[str, Any]:
        """Under VSA, its ramp (a resume that changes it changes the math); nothing when dense."""
        if self._attn_kind != "vsa":
            return {}
        spec = self.training_config.vsa
        return {"method.vsa": {"sparsity": spec.sparsity, "decay_rate": spec.decay_rate,
                               "decay_interval_steps": spec.decay_interval_steps}}
