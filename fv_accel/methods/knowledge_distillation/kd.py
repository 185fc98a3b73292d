"""KDMethod and KDCausalMethod: regress a student onto its teacher's ODE trajectories (CausVid's
ODE initialisation), FastVideo 0.2.1's `knowledge_distillation/kd.py` semantics and key names.

The teacher's trajectories are a dataset of their own (`cache.py`), written once per row on first
use (at build, before the engine shards anything) or by `python -m fv_accel.kd_cache RECIPE`; the
training loader then serves each row with its trajectory.

Per step, draws from the step's generator (FastVideo's `cuda_generator`), in this order: the step
index (KD: one of `t_list[:-1]` for the batch; causal KD: one per block of `num_frames_per_block`
latent frames per sample), then the SFT preparation's noise and `u`, which KD does not use (FastVideo
draws them in `prepare_batch`). The student predicts from the cached state at that timestep; its x0
(sigma from the dense 1000-entry grid of the training shift, nearest entry) is regressed onto the
teacher's final x0: loss `0.5 * MSE`.

Where ours differs from FastVideo's: the teacher's guidance is applied (FastVideo parses
`teacher_guidance_scale` and never uses it; at 1.0 the two agree); `t_list` is checked against the
teacher's timesteps when the method is built (FastVideo fails at the first step); the flow shift is
the student's training shift (FastVideo's `pipeline.flow_shift`, 0 unless set, is a broken schedule);
`prepare_batch` takes no `current_vsa_sparsity` (FastVideo's step passes it and raises TypeError).
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from fv_accel.methods.base import LogScalar, TrainingMethod
from fv_accel.methods.knowledge_distillation import cache as kd_cache
from fv_accel.models.base import ModelBase, TrainingBatch
from fv_accel.seeding import derived_seed

logger = logging.getLogger(__name__)


def _int_list(raw: Any, key: str, example: str) -> list[int]:
    if not isinstance(raw, list) or not raw or any(isinstance(v, bool) or not isinstance(v, int) for v in raw):
        raise ValueError(f"method.{key} must be a non-empty list of integer timesteps, e.g. {example}; got {raw!r}")
    return [int(v) for v in raw]


def _positive_int(raw: Any, key: str) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < 1:
        raise ValueError(f"method.{key} must be an integer >= 1, got {raw!r}")
    return int(raw)


class KDMethod(TrainingMethod):
    """Knowledge distillation: the student's x0 at a cached teacher state against the teacher's final x0."""

    def __init__(self, *, cfg: Any, role_models: dict[str, ModelBase]) -> None:
        super().__init__(cfg=cfg, role_models=role_models)
        label = type(self).__name__
        self._require_trainable_student(label)
        self.teacher = role_models.get("teacher")
        if self.teacher is None:
            raise ValueError(f"{label} requires role 'teacher' (models.teacher)")
        if self.teacher._trainable:
            raise ValueError(f"{label} requires teacher to be non-trainable (models.teacher.trainable: false)")
        self._attn_kind = "dense"
        self._parse_keys(cfg.method)
        self._init_student()
        self.teacher.init_preprocessors(self.training_config)
        self.teacher.transformer.eval()
        self._cache_dataset: Any = None

    def _parse_keys(self, mc: Any) -> None:
        self._t_list = _int_list(mc.t_list, "t_list", "[995, 937, 833, 625, 0]")
        steps = len(self._t_list) - 1 if mc.student_sample_steps is None else mc.student_sample_steps
        self._num_steps = _positive_int(steps, "student_sample_steps")
        if len(self._t_list) != self._num_steps + 1:
            raise ValueError(
                f"method.t_list has {len(self._t_list)} entries but method.student_sample_steps is {self._num_steps}: "
                f"t_list holds student_sample_steps + 1 timesteps (the last, usually 0, is never trained on)"
            )
        if not mc.teacher_path_cache:
            raise ValueError("method.teacher_path_cache must be set: the folder the teacher's trajectories are written to")
        self._cache_dir = Path(str(mc.teacher_path_cache))
        self._guidance = float(mc.teacher_guidance_scale)
        self._teacher_steps = _positive_int(mc.teacher_inference_steps, "teacher_inference_steps")
        if mc.kd_cache_keep not in kd_cache.KEEP_MODES:
            raise ValueError(f"method.kd_cache_keep must be one of {list(kd_cache.KEEP_MODES)}, got {mc.kd_cache_keep!r}")
        self._keep = str(mc.kd_cache_keep)
        shift = float(self.student.training_table(torch.Size([1, 1, 1, 1, 1])).shift)
        if shift <= 0:
            raise ValueError(
                f"models.student.flow_shift is {shift:g}: KD's teacher ODE and x0 need a positive shift "
                "(FastVideo's default 0 is a broken schedule); set models.student.flow_shift, e.g. 5.0 for Wan 2.1 T2V 1.3B"
            )
        self._shift = shift
        self._teacher_timesteps = kd_cache.teacher_timesteps(self._teacher_steps, shift)
        where = f"teacher's {self._teacher_steps} ODE timesteps at shift {shift:g} (method.teacher_inference_steps)"
        kd_cache.check_t_list(self._t_list, self._teacher_timesteps, where)

    # ---- the cache ----
    def cache_spec(self, loader: Any) -> kd_cache.CacheSpec:
        """The cache of this run's rows: every row of the loader's dataset."""
        from fv_accel.data.fingerprint import dataset_fingerprint

        dataset = loader.dataset
        shapes = self._row_shapes(loader)
        if len(set(shapes)) != 1:
            raise ValueError(
                f"training.data.data_path: the KD cache takes rows of one latent shape, the data has {sorted(set(shapes))}; "
                "set training.data.num_latent_t / num_height / num_width to keep one"
            )
        source = self.cfg.models.teacher
        fingerprint = {
            "teacher": source.init_from or "inline models.teacher.transformer_config",
            "teacher_sha256": self.teacher.weights_sha256(),
            "teacher_guidance_scale": self._guidance,
            "teacher_inference_steps": self._teacher_steps,
            "flow_shift": self._shift,
            "rows": dataset_fingerprint(dataset),
            "seed": self.seed,
            "kd_cache_keep": self._keep,
            "dtype": str(kd_cache.STORED_DTYPE).replace("torch.", ""),
        }
        stored = kd_cache.kept_steps(self._teacher_timesteps, self._t_list, self._keep)
        return kd_cache.CacheSpec(self._cache_dir, len(dataset), shapes[0], self._teacher_timesteps, stored, fingerprint)

    def _row_shapes(self, loader: Any) -> list[tuple[int, ...]]:
        dataset = loader.dataset
        if getattr(loader, "preprocessed_data_type", None) == "text_only":
            from fv_accel.data.loader import rollout_latent_shape

            shape = tuple(rollout_latent_shape(self.cfg, self.student.in_channels))
            return [shape] * len(dataset)
        parts = getattr(dataset, "parts", None) or [dataset]
        return [tuple(int(v) for v in s) for part in parts for s in part.latent_shapes]

    def check_data(self, loader: Any) -> None:
        """The cache of the loader's rows: checked against this teacher and its settings, the
        missing samples written (each process its own rows), then served with the loader's batches."""
        spec = self.cache_spec(loader)
        with without_caption_dropout(loader.dataset):  # the teacher follows each row's own caption
            ensure_cache(self, spec, loader.dataset)
        self._cache_dataset = kd_cache.KDCacheDataset(spec)

    def train_batches(self, loader: Any, device: torch.device, step: int) -> Any:
        from fv_accel.data.loader import BatchPrefetcher

        del step
        if self._cache_dataset is None:
            raise RuntimeError("the KD cache was not prepared: check_data(loader) runs at build")
        return BatchPrefetcher(kd_cache.TrajectoryBatches(loader, self._cache_dataset), device)

    def make_sample(self, dataset: Any, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row `index`'s teacher trajectory: (states [S, C, T, H, W], final x0 [C, T, H, W])."""
        from fv_accel.data.loader import collate
        from fv_accel.seeding import derived_seed

        batch = collate([dataset[(index, 0, 0)]])
        shape = (1, *self._spec_shape)
        cond = self.teacher.build_conditioning(batch)
        tb = TrainingBatch(conditioning=cond)
        if self._guidance != 1.0:
            tb.unconditional = negative_conditioning(cond, dataset, self.training_config.data.text_max_length, self.device)
        gen = torch.Generator(device=self.device).manual_seed(derived_seed(self.seed, index, "kd_cache"))
        noise = torch.randn(shape, generator=gen, device=self.device)
        settings = kd_cache.TrajectorySettings(self._teacher_timesteps, self._guidance, self.student.training_table(torch.Size(shape)))
        with torch.no_grad():
            return kd_cache.teacher_trajectory(self.teacher, tb, noise, settings)

    _spec_shape: tuple[int, ...] = ()

    # ---- the step ----
    def _step_generator(self, generator: Any, iteration: int) -> torch.Generator:
        """The generator of batch-wide draws (the step index): the rank's (FastVideo's), or under
        `noise_rng: sample` one of (seed, step), the same on every rank and for every micro-batch of the
        step, so that N processes train as one does."""
        if isinstance(generator, list):
            return torch.Generator(device=self.device).manual_seed(derived_seed(self.seed, iteration, "kd_step"))
        return generator

    def _trajectory_index(self, batch: dict, t: int) -> int:
        cached = [int(v) for v in batch["trajectory_timesteps"][0].tolist()]
        return kd_cache.check_t_list([t, 0], cached, "cached timesteps")[t]

    def _prepared(self, batch: dict, generator: Any, target: torch.Tensor, noisy: torch.Tensor,
                  timesteps: torch.Tensor) -> TrainingBatch:
        """The student's conditioning with the SFT preparation's draws (noise, u: unused, as in
        FastVideo's prepare_batch), then the cached state and the KD timesteps."""
        clean = TrainingBatch(latents=target, conditioning=self.student.build_conditioning(batch))
        tb = self.prepare(batch, generator, in_range=False, clean=clean)
        table = self.student.training_table(noisy.shape)
        tb.noisy_model_input = noisy
        tb.timesteps = timesteps
        tb.sigmas = table.nearest_sigmas(timesteps.reshape(-1), timesteps.numel()).to(noisy.device).view(timesteps.shape)
        return tb

    def _x0(self, tb: TrainingBatch, velocity: torch.Tensor) -> torch.Tensor:
        """x0 = x_t - sigma * v in fp64 (sigma per sample or per frame, nearest on the dense grid)."""
        noisy, t = tb.noisy_model_input, tb.timesteps
        table = self.student.training_table(noisy.shape)
        sigma = table.nearest_sigmas(t.reshape(-1), t.numel(), torch.float64).to(noisy.device).view(t.shape)
        x0 = noisy.double() - table.expand_sigma(sigma, noisy.ndim) * velocity.double()
        return x0.to(velocity.dtype)

    def _loss_step(self, tb: TrainingBatch, target: torch.Tensor) -> tuple[dict, dict, dict]:
        velocity = self.student.predict_noise(tb.noisy_model_input, tb.timesteps, tb, conditional=True, attn_kind="dense")
        loss = 0.5 * F.mse_loss(self._x0(tb, velocity).float(), target.float())
        return self._step_result(loss, tb, "kd_loss")

    def single_train_step(
        self, batch: dict[str, Any], iteration: int
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, LogScalar]]:
        device = self.device
        generator = self.batch_generator(batch)
        step_i = int(torch.randint(0, self._num_steps, (1,), generator=self._step_generator(generator, iteration), device=device).item())
        t = self._t_list[step_i]
        k = self._trajectory_index(batch, t)
        noisy = batch["trajectory_latents"][:, k].to(device=device, dtype=torch.float32)
        target = batch["real"].to(device=device, dtype=torch.float32)
        tb = self._prepared(batch, generator, target, noisy, torch.full((noisy.shape[0],), float(t), device=device))
        loss_map, outputs, metrics = self._loss_step(tb, target)
        metrics["kd_step_idx"] = float(step_i)
        return loss_map, outputs, metrics

    def write_final_files(self, output_dir: Any) -> None:
        """`student_steps.json`: the student's few timesteps (t_list without its last) and sigmas,
        stepped as an Euler ODE, which `python -m fv_accel.generate` samples it at."""
        from fv_accel.methods.distribution_matching.dmd2 import STUDENT_STEPS_FILE, write_json_atomically

        table = self.student.training_table(torch.Size([1, 1, 1, 1, 1]))
        steps = [float(t) for t in self._t_list[:-1]]
        sigmas = [float(s) for s in table.nearest_sigmas(torch.tensor(steps), len(steps))]
        record = {"method": self.cfg.method.name, "timesteps": steps, "sigmas": sigmas, "student_sample_type": "ode", "context_noise": 0.0}
        write_json_atomically(Path(output_dir) / STUDENT_STEPS_FILE, record)

    def math_signature(self) -> dict[str, Any]:
        sig = super().math_signature()
        sig.update({
            "method.t_list": self._t_list,
            "method.teacher_inference_steps": self._teacher_steps,
            "method.teacher_guidance_scale": self._guidance,
            "method.kd_cache_keep": self._keep,
        })
        return sig


class KDCausalMethod(KDMethod):
    """KD of a block-causal student: one step index per block of `num_frames_per_block` latent
    frames per sample (FastVideo's `_sample_per_frame_step_idx`), the per-frame timesteps given to
    the student, which attends block-causally over the whole clip in one forward."""

    def __init__(self, *, cfg: Any, role_models: dict[str, ModelBase]) -> None:
        super().__init__(cfg=cfg, role_models=role_models)
        block = getattr(self.student, "causal_block_size", None)
        if block is None:
            raise ValueError("method.name kd_causal needs a block-causal student: set models.student.causal: true")
        raw = cfg.method.num_frames_per_block
        self._block = block if raw is None else _positive_int(raw, "num_frames_per_block")
        if self._block != block:
            raise ValueError(
                f"method.num_frames_per_block ({self._block}) must equal the student's causal block size "
                f"(method.chunk_size, {block})"
            )
        if not self.student.capabilities.per_frame_timesteps:
            raise ValueError(f"kd_causal: the {self.student.family} family cannot take a timestep per latent frame")

    def sample_block_indices(self, batch_size: int, num_frames: int, generator: torch.Generator) -> torch.Tensor:
        """[B, T] step indices in [0, K): one per block of frames, repeated over its frames."""
        blocks = -(-num_frames // self._block)
        idx = torch.randint(0, self._num_steps, (batch_size, blocks), generator=generator, device=self.device)
        return idx.repeat_interleave(self._block, dim=1)[:, :num_frames]

    def single_train_step(
        self, batch: dict[str, Any], iteration: int
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, LogScalar]]:
        del iteration  # the block indices are per sample: each sample's generator under `noise_rng: sample`
        device = self.device
        traj = batch["trajectory_latents"]  # [B, S, C, T, H, W]
        bsz, _, channels, frames = traj.shape[:4]
        cols = torch.tensor([self._trajectory_index(batch, t) for t in self._t_list[:-1]], dtype=torch.long)
        relevant = traj[:, cols].to(device=device, dtype=torch.float32)  # [B, K, C, T, H, W]
        generator = self.batch_generator(batch)
        if isinstance(generator, list):
            idx = torch.cat([self.sample_block_indices(1, frames, g) for g in generator])  # [B, T]
        else:
            idx = self.sample_block_indices(bsz, frames, generator)
        gather = idx[:, None, None, :, None, None].expand(bsz, 1, channels, frames, *relevant.shape[-2:])
        noisy = torch.gather(relevant, 1, gather).squeeze(1)
        target = batch["real"].to(device=device, dtype=torch.float32)
        t_values = torch.tensor(self._t_list[:-1], dtype=torch.float32, device=device)
        tb = self._prepared(batch, generator, target, noisy, t_values[idx])
        loss_map, outputs, metrics = self._loss_step(tb, target)
        metrics["kd_mean_step_idx"] = float(idx.float().mean())
        return loss_map, outputs, metrics

    def math_signature(self) -> dict[str, Any]:
        sig = super().math_signature()
        sig["method.num_frames_per_block"] = self._block
        return sig


@contextlib.contextmanager
def without_caption_dropout(dataset: Any) -> Any:
    """The dataset (and a mix's parts) with `training_cfg_rate` off while the teacher writes the cache."""
    parts = [dataset, *(getattr(dataset, "parts", None) or [])]
    rates = [getattr(part, "cfg_rate", None) for part in parts]
    try:
        for part, rate in zip(parts, rates):
            if rate is not None:
                part.cfg_rate = 0.0
        yield dataset
    finally:
        for part, rate in zip(parts, rates):
            if rate is not None:
                part.cfg_rate = rate


def negative_conditioning(cond: Any, dataset: Any, text_max_length: int, device: torch.device) -> Any:
    """The unconditional branch of the teacher's guidance: the dataset's stored unconditional text
    (the pipeline's negative prompt, written by preprocessing), else the text zeroed."""
    import dataclasses

    from fv_accel.data.loader import pad_text
    from fv_accel.data.schema import read_unconditional_text

    path = getattr(dataset, "data_path", None)
    columns = read_unconditional_text(path) if path is not None else None
    if columns is None or "text_embedding" not in columns:
        return cond.unconditional()
    text, mask = pad_text(columns["text_embedding"].float(), text_max_length)
    return dataclasses.replace(cond, text=text[None].to(device), text_mask=mask[None].to(device=device, dtype=torch.long))


def ensure_cache(method: KDMethod, spec: kd_cache.CacheSpec, dataset: Any) -> None:
    """Check the cache against this run, write its missing samples (process r of W: the missing rows
    r, r + W, ... in row order), wait for every process, then check that every sample is there."""
    from accelerate import PartialState

    state = PartialState()
    method._spec_shape = tuple(spec.latent_shape)
    kd_cache.check_metadata(spec)
    missing_all = [i for i in range(spec.num_samples) if not spec.is_done(i)]
    if missing_all:
        need = kd_cache.check_disk_room(spec, len(missing_all))
        if state.is_main_process:
            logger.info(
                "KD cache %s: %d of %d samples to write, %s on disk (%s per sample in bf16: %d states of %s and the final x0; "
                "FastVideo's 77-frame 448x832 Wan 2.1 sample of 48 states is ~179 MB), by %d process(es); the first sample's time gives the rest",
                spec.folder, len(missing_all), spec.num_samples, kd_cache.human_bytes(need),
                kd_cache.human_bytes(spec.bytes_per_sample()), len(spec.stored), list(spec.latent_shape), state.num_processes,
            )
            kd_cache.write_metadata(spec)
        state.wait_for_everyone()
        mine = missing_all[state.process_index :: state.num_processes]  # balanced over the processes on a restart too
        kd_cache.generate(spec, mine, lambda i: method.make_sample(dataset, i), log=state.is_main_process)
        print(f"KD cache: process {state.process_index} of {state.num_processes} wrote {len(mine)} sample(s): rows {mine}", flush=True)
        state.wait_for_everyone()
    absent = [i for i in range(spec.num_samples) if not spec.is_done(i)]
    if absent:
        raise ValueError(f"{spec.sample_path(absent[0])}: the KD cache lacks {len(absent)} sample(s); rerun `python -m fv_accel.kd_cache RECIPE`")
