"""Watching a run learn: sample videos and held-out loss by noise level (`callbacks.validation`).

Both callbacks run every `every_steps` optimizer steps, at the last step, and at the start when
`at_start` is set. Neither changes training: they run under `torch.no_grad`, in eval mode, on the
unwrapped transformer, with their own CPU generators, and inside `torch.random.fork_rng` (so a
stray global draw, e.g. a dropout, cannot shift the training stream); the EMA weights, when
used, are swapped in and the trained weights restored bit for bit. A run with validation trains
exactly as one without.

Sample videos (`VideoSamplingCallback`): prompts from `prompts` and/or `prompt_file` (TXT: one
per line; JSONL: one string or object per line; JSON: a list, or {"prompts": [...]}); an object
may set `prompt`, `negative_prompt`, `height`, `width`, `frames`, `steps`, `guidance`, `seed`,
`name`. A fine-tuned student samples through its family's diffusers pipeline (e.g. `WanPipeline`)
with the model repo's own scheduler class and shift (`scheduler`, `sampling_flow_shift`; see
docs/validation-sampling.md); a DFSFT student through the diffusion-forcing sampler of
`fv_accel.sampling` (chunk by chunk, Euler steps at that shift). Videos are written
to `<output_dir>/samples/step-<n>/` as mp4 and logged to TensorBoard (animated image summaries)
and W&B (videos). `<output_dir>/samples/grid.png` (also logged as the image `validation/grid`)
shows every validation so far: a row per prompt, a column per step, each cell a strip of
GRID_FRAMES frames spread over the clip (first to last). With `distance_clips` N > 0, each
sample's distance to the training data is logged: its pixel MSE (pixels in [-1, 1]) to the
nearest of the first N training clips of its size, those clips decoded by the same VAE from their
latents (the best a model sampling through this VAE can do), and the mean squared distance of its
normalised latents to the nearest of those clips' latents (independent of the VAE's decoder);
`samples/distance` and `samples/latent_distance` are the means over the prompts,
`samples/distance/<name>` and `samples/latent_distance/<name>` each prompt's. The VAE and text
encoder come from `model_from`, else the student's `init_from`, else the model that encoded the
dataset (recorded in its `fv_dataset.json`); prompts are encoded once at the start and the text
encoder is freed.

Held-out loss (`HeldoutLossCallback`): a fixed set of clips (`heldout_data_path`; "tiny" builds
`heldout_max_samples` fresh tiny clips with the data seed + 1; or a `heldout_fraction` of the
training rows, chosen from the data seed and never seen by the training loader) is noised with fixed per-clip noise to each sigma of `heldout_sigma_buckets`
(the nearest entry of the training table) and scored with the flow-matching loss; `heldout/loss`
is the mean over buckets. DFSFT students are also scored on fixed per-chunk noise patterns
(`heldout_chunk_patterns`). Fixed noise and timesteps make the numbers comparable across steps
and across runs with the same held-out set.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union

import numpy as np
import torch

from fv_accel.models.base import Conditioning
from fv_accel.models.context_parallel import data_parallel_layout
from fv_accel.trainer import TrainerCallback

logger = logging.getLogger(__name__)

# The held-out split is drawn from the data seed with this offset (not the training order's stream).
_HELDOUT_SPLIT_SALT = 104_729


# --------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplePrompt:
    prompt: str
    negative_prompt: str
    height: int
    width: int
    num_frames: int
    sampling_steps: int
    guidance_scale: float
    seed: int
    name: str


# Accepted keys of a prompt object and the field each one sets (short names as in the brief).
PROMPT_KEYS = {
    "prompt": "prompt",
    "negative_prompt": "negative_prompt",
    "height": "height",
    "width": "width",
    "frames": "num_frames",
    "num_frames": "num_frames",
    "steps": "sampling_steps",
    "sampling_steps": "sampling_steps",
    "guidance": "guidance_scale",
    "guidance_scale": "guidance_scale",
    "seed": "seed",
    "name": "name",
}


def _prompt_file_text(path: Path) -> str:
    """The text of a prompt file; errors are one line naming the file and what is wrong with it."""
    key = "callbacks.validation.prompt_file"
    if path.is_dir():
        raise ValueError(f"{key}: '{path}' is a folder; expected a .txt, .jsonl or .json file of prompts")
    if not path.is_file():
        raise FileNotFoundError(f"{key}: '{path}' does not exist")
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise ValueError(f"{key}: '{path}' cannot be read ({err.strerror or err.__class__.__name__})") from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise ValueError(
            f"{key}: '{path}' is not UTF-8 (byte {raw[err.start:err.end].hex(' ')} at offset {err.start}, line {line}); "
            "save it as UTF-8"
        ) from None


def read_prompt_file(path: Union[str, Path]) -> list[Union[str, dict]]:
    """Entries of a TXT / JSONL / JSON prompt file (strings or objects), errors naming the line."""
    path = Path(path)
    text = _prompt_file_text(path)
    suffix = path.suffix.lower()
    if suffix == ".txt":
        return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    if suffix == ".jsonl":
        entries = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}: line {n}: not valid JSON ({err.msg})") from None
        return entries
    if suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})") from None
        if isinstance(data, dict) and set(data) == {"prompts"}:
            data = data["prompts"]
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a list of prompts or {{\"prompts\": [...]}}")
        return data
    raise ValueError(f"{path}: unknown prompt file type '{suffix}' (use .txt, .jsonl or .json)")


def _slug(text: str, limit: int = 40) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return slug[:limit].rstrip("-") or "prompt"


def resolve_prompts(entries: Sequence[Union[str, dict]], defaults: dict[str, Any], where: str) -> list[SamplePrompt]:
    """Fill each entry from `defaults` (a dict of SamplePrompt fields; `seed` is the base seed,
    prompt i defaulting to seed + i) and check it; errors name `where` and the entry."""
    prompts = []
    for i, entry in enumerate(entries):
        here = f"{where}[{i}]"
        if isinstance(entry, str):
            entry = {"prompt": entry}
        if not isinstance(entry, dict):
            raise ValueError(f"{here}: expected a prompt string or an object, got {entry!r}")
        values: dict[str, Any] = {}
        for key, value in entry.items():
            if key not in PROMPT_KEYS:
                raise ValueError(f"{here}: unknown key '{key}'; known keys: {', '.join(sorted(PROMPT_KEYS))}")
            field_name = PROMPT_KEYS[key]
            if field_name in values:
                raise ValueError(f"{here}: '{key}' sets {field_name} a second time")
            values[field_name] = value
        if not isinstance(values.get("prompt"), str) or not values["prompt"].strip():
            raise ValueError(f"{here}: needs a non-empty 'prompt'")
        merged = {**defaults, "seed": int(defaults["seed"]) + i, "name": "", **values}
        for key in ("height", "width", "num_frames", "sampling_steps", "seed"):
            value = merged[key]
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{here}: '{key}' must be an integer, got {value!r}")
        g = merged["guidance_scale"]
        if isinstance(g, bool) or not isinstance(g, (int, float)) or g < 0:
            raise ValueError(f"{here}: 'guidance' must be a number >= 0, got {g!r}")
        if merged["height"] <= 0 or merged["height"] % 16 or merged["width"] <= 0 or merged["width"] % 16:
            raise ValueError(
                f"{here}: height and width must be positive multiples of 16, got {merged['height']}x{merged['width']}"
            )
        if merged["num_frames"] < 1 or (merged["num_frames"] - 1) % 4:
            raise ValueError(f"{here}: 'frames' must be of the form 4k+1 (1, 5, 9, ...), got {merged['num_frames']}")
        if merged["sampling_steps"] < 1:
            raise ValueError(f"{here}: 'steps' must be >= 1, got {merged['sampling_steps']}")
        if not isinstance(merged["negative_prompt"], str):
            raise ValueError(f"{here}: 'negative_prompt' must be a string")
        name = merged["name"] or f"{i:02d}-{_slug(merged['prompt'])}"
        prompts.append(
            SamplePrompt(
                prompt=merged["prompt"],
                negative_prompt=merged["negative_prompt"],
                height=merged["height"],
                width=merged["width"],
                num_frames=merged["num_frames"],
                sampling_steps=merged["sampling_steps"],
                guidance_scale=float(g),
                seed=merged["seed"],
                name=_slug(name, 60),
            )
        )
    names = [p.name for p in prompts]
    if len(set(names)) != len(names):
        raise ValueError(f"{where}: prompt names must be unique, got {names}")
    return prompts


# --------------------------------------------------------------------------------------------
# Held-out split
# --------------------------------------------------------------------------------------------


def count_rows(data_path: str) -> int:
    """Rows of a Parquet dataset, from the files' metadata (nothing is loaded)."""
    from fv_accel.data.schema import parquet_files, parquet_row_counts

    return sum(parquet_row_counts(parquet_files(data_path)))


def heldout_split(num_rows: int, fraction: float, seed: int) -> list[int]:
    """The sorted row indices held out: round(fraction * rows) of them (at least one), drawn from
    `seed`. The same rows for the same dataset and seed, whatever else changes."""
    if fraction <= 0:
        return []
    count = max(1, int(round(fraction * num_rows)))
    if count >= num_rows:
        raise ValueError(
            f"callbacks.validation.heldout_fraction: {fraction} of {num_rows} rows leaves nothing to train on"
        )
    g = torch.Generator().manual_seed(int(seed) + _HELDOUT_SPLIT_SALT)
    return sorted(torch.randperm(num_rows, generator=g)[:count].tolist())


def resolve_heldout_path(cfg: Any, accelerator: Any = None) -> Optional[str]:
    """`heldout_data_path`, with "tiny" built (once, cached) as new tiny clips: the same
    distribution as the tiny training set, other clips (data seed + 1), encoded by the same model."""
    import dataclasses

    val = cfg.callbacks.validation
    if val.heldout_data_path != "tiny":
        return val.heldout_data_path
    from fv_accel.tiny import tiny_dataset

    data = dataclasses.replace(
        cfg.training.data, seed=cfg.training.data.seed + 1, tiny_num_clips=val.heldout_max_samples
    )
    context = accelerator.main_process_first() if accelerator is not None else contextlib.nullcontext()
    with context:
        return str(tiny_dataset(data, run_cfg=cfg))


def training_exclusions(cfg: Any, data_path: str) -> list[int]:
    """Rows of the training data the training loader must not see (the carved-out held-out set).

    Depends only on `heldout_fraction` and the data, not on `validation.enable`, so switching
    validation on or off never changes what the model trains on."""
    val = cfg.callbacks.validation
    if val.heldout_fraction <= 0 or val.heldout_data_path:
        return []
    return heldout_split(count_rows(data_path), val.heldout_fraction, cfg.training.data.seed)


# --------------------------------------------------------------------------------------------
# Shared: running the student for evaluation without touching training
# --------------------------------------------------------------------------------------------


def is_sharded(accelerator: Any) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)


@contextlib.contextmanager
def evaluation_mode(trainer: Any) -> Iterator[Any]:
    """The student in eval mode on its unwrapped transformer (no DDP hooks or collectives), under
    no_grad and autocast, with the global RNG state saved and restored; yields the student."""
    acc = trainer.accelerator
    student = trainer.method.student
    wrapped = student.transformer
    module = acc.unwrap_model(wrapped)
    was_training = module.training
    devices = [acc.device] if acc.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        student.transformer = module
        module.eval()
        try:
            with torch.no_grad(), acc.autocast():
                yield student
        finally:
            module.train(was_training)
            student.transformer = wrapped


def _is_due(trainer: Any, step: int, every: int) -> bool:
    return step % every == 0 or step == trainer.config.training.loop.max_train_steps


def chunk_size_of(method: Any) -> Optional[int]:
    """The chunk size of a diffusion-forcing method, None for plain fine-tuning."""
    return method.chunk_size


# --------------------------------------------------------------------------------------------
# Held-out loss by noise level
# --------------------------------------------------------------------------------------------


def chunk_pattern_sigmas(pattern: Union[str, Sequence[float]], num_chunks: int, buckets: Sequence[float]) -> list[float]:
    """Per-chunk sigmas of a named or explicit pattern.

    "ramp_up": earlier chunks cleaner (lowest to highest bucket sigma, as when sampling chunk by
    chunk); "ramp_down": the reverse; "clean_context": every chunk but the last at the lowest
    bucket sigma, the last at the middle one. A list gives the sigmas of the first chunks; the
    last value repeats for the rest."""
    lo, hi = min(buckets), max(buckets)
    if isinstance(pattern, str):
        if pattern == "ramp_up":
            return np.linspace(lo, hi, num_chunks).tolist() if num_chunks > 1 else [lo]
        if pattern == "ramp_down":
            return np.linspace(hi, lo, num_chunks).tolist() if num_chunks > 1 else [hi]
        if pattern == "clean_context":
            mid = sorted(buckets)[len(buckets) // 2]
            return [lo] * (num_chunks - 1) + [mid]
        raise ValueError(
            f"callbacks.validation.heldout_chunk_patterns: unknown pattern {pattern!r} "
            "(use ramp_up, ramp_down, clean_context or a list of sigmas)"
        )
    values = [float(v) for v in pattern]
    return (values + [values[-1]] * num_chunks)[:num_chunks]


def _pattern_name(pattern: Union[str, Sequence[float]]) -> str:
    return pattern if isinstance(pattern, str) else "sigmas_" + "_".join(f"{float(v):.2f}" for v in pattern)


def collate_one(item: dict) -> dict:
    """A one-sample batch of a dataset item (tensors get a batch dimension)."""
    return {k: v[None] if isinstance(v, torch.Tensor) else v for k, v in item.items()}


def _with_clean_frames(idx: torch.Tensor, cond: Any) -> torch.Tensor:
    """Per-frame indices [1, T'] of the noised frames, with the clean condition frames (-1) in front."""
    if not cond.clean_frames:
        return idx
    return torch.cat([idx.new_full((idx.shape[0], cond.clean_frames), -1), idx], dim=1)


class HeldoutLossCallback(TrainerCallback):
    """Held-out flow-matching loss at fixed noise and fixed timesteps, per sigma bucket."""

    def __init__(self, cfg: Any, data_path: str, heldout_path: Optional[str] = None):
        """`heldout_path`: the resolved `heldout_data_path` (see `resolve_heldout_path`)."""
        from fv_accel.data.loader import LatentDataset

        val = cfg.callbacks.validation
        self.every = val.every_steps
        self.at_start = val.at_start
        self.seed = val.seed
        self.buckets = [float(s) for s in val.heldout_sigma_buckets]
        self.patterns = list(val.heldout_chunk_patterns)
        self.precondition = bool(cfg.training.model.precondition_outputs)
        if heldout_path or val.heldout_data_path:
            self.source = heldout_path or val.heldout_data_path
            self.dataset = LatentDataset(self.source, text_max_length=cfg.training.data.text_max_length)
            rows = list(range(len(self.dataset)))
        else:
            rows = heldout_split(count_rows(data_path), val.heldout_fraction, cfg.training.data.seed)
            self.dataset = LatentDataset(data_path, text_max_length=cfg.training.data.text_max_length)
            self.source = f"{data_path} ({val.heldout_fraction:g} held out)"
        self.rows = rows[: val.heldout_max_samples]
        self.best: Optional[tuple[float, int]] = None
        self.first: Optional[tuple[float, int]] = None
        self.last: Optional[tuple[float, int]] = None

    # ---- the evaluation (collective: every rank calls it) ----
    def _evaluations(self, table: Any, num_frames: int, chunk_size: Optional[int]) -> list[tuple[str, torch.Tensor]]:
        """(log key, table indices) per evaluation: [1] for SFT, per frame [T] for DFSFT."""

        def nearest(sigma: float) -> int:
            return int((table.sigmas - sigma).abs().argmin())

        evals = []
        for s in self.buckets:
            idx = torch.tensor([nearest(s)])
            evals.append((f"heldout/sigma_{s:.2f}", idx if chunk_size is None else idx.repeat(num_frames)))
        if chunk_size is not None:
            from fv_accel.sampling import chunk_bounds

            bounds = chunk_bounds(num_frames, chunk_size)
            for pattern in self.patterns:
                sigmas = chunk_pattern_sigmas(pattern, len(bounds), self.buckets)
                idx = torch.tensor([nearest(sigmas[k]) for k, (s, e) in enumerate(bounds) for _ in range(s, e)])
                evals.append((f"heldout/chunks_{_pattern_name(pattern)}", idx))
        return evals

    def evaluate(self, trainer: Any) -> dict[str, float]:
        """Mean loss per evaluation over the held-out clips; identical on every rank."""
        from fv_accel.seeding import sample_generator_seed

        acc = trainer.accelerator
        method = trainer.method
        chunk_size = chunk_size_of(method)
        # The processes of one context-parallel group evaluate the same clips, together.
        cp = trainer.config.training.model.context_parallel
        world, rank = data_parallel_layout(cp, acc.num_processes, acc.process_index)
        # Every rank runs the same number of forwards (sharded engines need it): pad with weight 0.
        per_rank = math.ceil(len(self.rows) / world)
        sums: Optional[torch.Tensor] = None
        keys: list[str] = []
        from tqdm.auto import tqdm

        # The main process's share of the clips, under the training bar (leave=False: gone when done),
        # on a terminal only (disable=None): a log file gets the result line alone.
        slots = tqdm(
            range(rank, per_rank * world, world), desc="held-out", unit="clip", leave=False,
            disable=None if acc.is_local_main_process else True, dynamic_ncols=True,
        )
        with evaluation_mode(trainer) as student:
            device = acc.device
            # Under VSA: the run's sparse view, then the dense view of the same weights (sparsity 0).
            views = (False, True) if student.vsa_controllers else (False,)
            for slot in slots:
                real = slot < len(self.rows)
                row = self.rows[slot] if real else self.rows[0]
                batch = collate_one(self.dataset[(row, 0, 0)])
                latents = student.clean_latents(batch)
                cond = student.build_conditioning(batch)
                # Fixed noise per clip, drawn on the CPU: the same numbers on any device and rank count.
                g = torch.Generator().manual_seed(sample_generator_seed(self.seed, 0, row))
                noise = torch.randn(latents.shape, generator=g, dtype=torch.float32).to(device)
                # A family that makes sound: the clip's audio, its noise drawn after the video's.
                audio = student.clean_audio(batch, latents.shape[2])
                sound = {} if audio is None else dict(
                    audio=audio, audio_noise=torch.randn(audio.latents.shape, generator=g).to(device)
                )
                evals = self._evaluations(method.table, latents.shape[2] - cond.clean_frames, chunk_size)
                if sums is None:
                    keys = [k.replace("heldout/", "heldout/dense_" if dense else "heldout/") for dense in views for k, _ in evals]
                    sums = torch.zeros(2 * len(keys) + 1, dtype=torch.float64, device=device)  # video, audio, clips with sound
                for v, dense in enumerate(views):
                    with student.vsa_view(dense):
                        for j, (_, idx) in enumerate(evals):
                            idx = idx.to(device) if chunk_size is None else _with_clean_frames(idx.to(device)[None], cond)
                            loss = method.heldout_loss(latents, noise, idx, cond, **sound)
                            audio_loss = cond.extras.pop("audio_loss", None)
                            if real:
                                sums[v * len(evals) + j] += loss.double()
                                if audio_loss is not None:
                                    sums[len(keys) + v * len(evals) + j] += audio_loss.double()
                if real and audio is not None and bool(audio.present.any()):
                    sums[-1] += 1
        assert sums is not None  # every rank has per_rank >= 1 slots (the held-out set is never empty)
        total = acc.reduce(sums, reduction="sum") / cp.degree if acc.num_processes > 1 else sums
        means = (total[: len(keys)] / len(self.rows)).tolist()
        out = dict(zip(keys, means))
        if float(total[-1]) > 0:  # the audio loss apart, over the clips with sound
            audio_means = (total[len(keys) : -1] / total[-1]).tolist()
            out.update({k.replace("heldout/", "heldout/audio_"): m for k, m in zip(keys, audio_means)})
            audio_buckets = [k for k in out if k.startswith("heldout/audio_sigma_")]
            out["heldout/audio_loss"] = float(np.mean([out[k] for k in audio_buckets]))
        bucket_keys = [k for k in keys if k.startswith("heldout/sigma_")]
        out["heldout/loss"] = float(np.mean([out[k] for k in bucket_keys]))
        dense_keys = [k for k in keys if k.startswith("heldout/dense_sigma_")]
        if dense_keys:
            out["heldout/dense_loss"] = float(np.mean([out[k] for k in dense_keys]))
        return out

    def _run(self, trainer: Any, step: int) -> None:
        t0 = time.perf_counter()
        logs = self.evaluate(trainer)
        logs["heldout/time_s"] = time.perf_counter() - t0
        loss = logs["heldout/loss"]
        if self.first is None:
            self.first = (loss, step)
        self.last = (loss, step)
        if self.best is None or loss < self.best[0]:
            self.best = (loss, step)
        trainer.log_metrics(logs, step)
        if trainer.accelerator.is_main_process:
            logger.info(
                "step %d held-out loss %.4f (%s)",
                step,
                loss,
                ", ".join(f"{k.split('/', 1)[1]} {v:.4f}" for k, v in logs.items() if k not in ("heldout/loss", "heldout/time_s")),
            )

    def on_train_start(self, trainer: Any) -> None:
        if trainer.accelerator.is_main_process:
            logger.info("held-out loss on %d clip(s) of %s, sigma buckets %s", len(self.rows), self.source, self.buckets)
        if self.at_start:
            self._run(trainer, trainer.step)

    def on_step_end(self, trainer: Any, step: int, logs: dict) -> None:
        if _is_due(trainer, step, self.every):
            self._run(trainer, step)

    def summary(self) -> dict[str, Any]:
        if self.best is None:
            return {}
        return {
            "first_heldout_loss": self.first[0],
            "last_heldout_loss": self.last[0],
            "best_heldout_loss": self.best[0],
            "best_heldout_step": self.best[1],
        }


# --------------------------------------------------------------------------------------------
# Sample videos
# --------------------------------------------------------------------------------------------


def sampling_model_source(cfg: Any, data_path: Optional[str]) -> Optional[str]:
    """Where the VAE and text encoder come from (see the module docstring), or None."""
    from fv_accel.data.schema import read_dataset_info

    val, st = cfg.callbacks.validation, cfg.models.student
    if val.model_from:
        return val.model_from
    # A run folder of ours (transformer/ without vae/: a distillation teacher's run) has no VAE or
    # text encoder: the dataset's encoding model has them.
    run_folder = st.init_from and Path(st.init_from).is_dir() and not (Path(st.init_from) / "vae").is_dir()
    if st.init_from and not run_folder:
        return st.init_from
    if data_path:
        return read_dataset_info(data_path).get("model")
    return None


def repo_sampling_schedule(source: str, val: Any, family: type, revision: Optional[str] = None) -> Any:
    """The scheduler sample videos step with (a `fv_accel.sampling.SamplingSchedule`):
    `callbacks.validation.scheduler` and `sampling_flow_shift` (`val`) over the scheduler config of
    the model repo `source` (the one the VAE comes from), else over the family's default."""
    from fv_accel.models.loading import fetch_config
    from fv_accel.sampling import resolve_sampling_schedule

    config = fetch_config(source, "scheduler", revision=revision, required=False, filename="scheduler_config.json")
    return resolve_sampling_schedule(
        config,
        scheduler=val.scheduler,
        shift=val.sampling_flow_shift,
        fallback_config=family.default_scheduler_config(),
        origin=f"{source} scheduler/scheduler_config.json",
    )


def vae_scale_factors(model_source: Optional[str]) -> tuple[int, int]:
    """(spatial, temporal) compression of the model's VAE (Wan 2.1: 8, 4; Wan 2.2 TI2V: 16, 4), as its
    family reads it from the repo's configs."""
    from fv_accel.models import family_of_repo

    if not model_source:
        return 8, 4
    spec = family_of_repo(model_source).encoding_spec(model_source)
    return int(spec.scale_factor_spatial), int(spec.scale_factor_temporal)


def prompt_columns(columns: dict[str, torch.Tensor], text_max_length: int) -> dict[str, torch.Tensor]:
    """A one-sample batch of a family encoder's caption columns, padded as the loader pads them."""
    from fv_accel.data.loader import pad_text

    batch: dict[str, torch.Tensor] = {}
    for name, value in columns.items():
        if name in TEXT_SEQUENCE_MASKS:
            padded, mask = pad_text(value.float(), text_max_length)
            batch[name], batch[TEXT_SEQUENCE_MASKS[name]] = padded[None], mask[None]
        else:
            batch[name] = value.float()[None]
    return batch


# Text sequences the loader pads, and the name of each one's mask in a batch.
TEXT_SEQUENCE_MASKS = {"text_embedding": "text_attention_mask", "text_embedding_2": "text_attention_mask_2"}


def default_video_size(data_path: str, spatial: int = 8, temporal: int = 4, cfg: Any = None) -> tuple[int, int, int]:
    """(height, width, frames) of the first training clip, from its latent shape; for a text-only
    dataset (no clip), the rollout's (`cfg`'s training.data.num_* keys, rollout_latent_shape)."""
    from fv_accel.data.loader import LatentDataset, rollout_latent_shape

    dataset = LatentDataset(data_path)
    if dataset.text_only:
        if cfg is None:
            raise ValueError(f"'{data_path}' is a text-only dataset: the sample size needs the recipe's training.data.num_* keys")
        c, t, h, w = rollout_latent_shape(cfg, 1, data_path)
    else:
        c, t, h, w = dataset.latent_shapes[0]
    return h * spatial, w * spatial, (t - 1) * temporal + 1


def gif_bytes(frames: np.ndarray, fps: float) -> bytes:
    """uint8 [F, H, W, 3] as an animated GIF (TensorBoard shows GIF image summaries as videos)."""
    import io

    from PIL import Image

    images = [Image.fromarray(f) for f in frames]
    buf = io.BytesIO()
    images[0].save(
        buf, format="GIF", save_all=True, append_images=images[1:], duration=max(1, int(1000 / fps)), loop=0
    )
    return buf.getvalue()


def log_videos(accelerator: Any, videos: list[tuple[str, np.ndarray, Path]], step: int, fps: float) -> None:
    """Send videos to the trackers: TensorBoard (GIF image summary) and W&B (the mp4 files)."""
    for tracker in accelerator.trackers:
        if tracker.name == "tensorboard":
            from tensorboard.compat.proto.summary_pb2 import Summary

            writer = tracker.writer
            for name, frames, _ in videos:
                image = Summary.Image(
                    height=int(frames.shape[1]),
                    width=int(frames.shape[2]),
                    colorspace=3,
                    encoded_image_string=gif_bytes(frames, fps),
                )
                summary = Summary(value=[Summary.Value(tag=f"validation/{name}", image=image)])
                writer._get_file_writer().add_summary(summary, step)
            writer.flush()
        elif tracker.name == "wandb":
            import wandb

            tracker.run.log(
                {f"validation/{name}": wandb.Video(str(path), format="mp4") for name, _, path in videos}, step=step
            )


# Frames of each clip in a cell of the sample grid (evenly spaced, first to last).
GRID_FRAMES = 5
_GRID_GAP = 4  # pixels between cells (1 between the frames of a cell)
_GRID_HEADER = 14  # pixels of the header row ("step N")


def grid_cell(frames: np.ndarray, count: int = GRID_FRAMES) -> np.ndarray:
    """uint8 [F, H, W, 3] -> a strip of `count` evenly spaced frames [H, count * (W + 1) - 1, 3]."""
    picks = np.unique(np.linspace(0, len(frames) - 1, count).round().astype(int))
    h, w = frames.shape[1:3]
    strip = np.full((h, len(picks) * (w + 1) - 1, 3), 255, dtype=np.uint8)
    for k, f in enumerate(picks):
        strip[:, k * (w + 1) : k * (w + 1) + w] = frames[f]
    return strip


def sample_grid(columns: Sequence[tuple[int, Sequence[np.ndarray]]]) -> np.ndarray:
    """The sample grid as uint8 [H, W, 3]: `columns` are (step, one clip per prompt), the same
    prompts in the same order at every step; row r is prompt r, column c the c-th step, under a
    header naming the step."""
    return grid_of_cells([(step, [grid_cell(clip) for clip in clips]) for step, clips in columns])


def grid_of_cells(columns: Sequence[tuple[int, Sequence[np.ndarray]]]) -> np.ndarray:
    """sample_grid of columns whose clips are already strips (grid_cell)."""
    from PIL import Image, ImageDraw

    cells = [col for _, col in columns]
    rows = len(cells[0])
    row_h = [max(col[r].shape[0] for col in cells) for r in range(rows)]
    col_w = [max(c.shape[1] for c in col) for col in cells]
    height = _GRID_HEADER + sum(row_h) + _GRID_GAP * rows
    width = sum(col_w) + _GRID_GAP * (len(cells) + 1)
    grid = np.full((height, width, 3), 255, dtype=np.uint8)
    x = _GRID_GAP
    for (step, _), col, w in zip(columns, cells, col_w):
        y = _GRID_HEADER
        for r, cell in enumerate(col):
            grid[y : y + cell.shape[0], x : x + cell.shape[1]] = cell
            y += row_h[r] + _GRID_GAP
        x += w + _GRID_GAP
    image = Image.fromarray(grid)
    draw = ImageDraw.Draw(image)
    x = _GRID_GAP
    for (step, _), w in zip(columns, col_w):
        draw.text((x, 1), f"step {step}", fill=(0, 0, 0))
        x += w + _GRID_GAP
    return np.asarray(image)


def clip_distance(sample: np.ndarray, references: Sequence[np.ndarray]) -> Optional[float]:
    """Pixel MSE (pixels in [-1, 1]) of a uint8 clip [F, H, W, 3] to the nearest reference clip
    of its shape; None when no reference has its shape."""
    return nearest_mse(_pixels(sample), [_pixels(r) for r in references if r.shape == sample.shape])


def _pixels(frames: np.ndarray) -> np.ndarray:
    """uint8 frames -> float32 pixels in [-1, 1]."""
    return frames.astype(np.float32) / 127.5 - 1.0


def nearest_mse(x: Any, references: Sequence[Any]) -> Optional[float]:
    """Mean squared error of `x` (an array or tensor) to the nearest of `references` of its shape;
    None when none has its shape."""
    scores = [float(((x - r) ** 2).mean()) for r in references if r.shape == x.shape]
    return min(scores) if scores else None


class VideoSamplingCallback(TrainerCallback):
    """Sample videos from the live student (EMA weights when available) at validation steps."""

    def __init__(self, cfg: Any, data_path: Optional[str], ema: Any = None):
        val = cfg.callbacks.validation
        self.cfg = cfg
        self.val = val
        self.ema = ema if val.use_ema else None
        entries: list[Union[str, dict]] = list(val.prompts)
        where = "callbacks.validation.prompts"
        if val.prompt_file:
            entries += read_prompt_file(val.prompt_file)
            where = f"{where} + {val.prompt_file}"
        height, width, frames = val.height, val.width, val.num_frames
        self.model_source = sampling_model_source(cfg, data_path)
        if None in (height, width, frames) and data_path:
            dh, dw, df = default_video_size(data_path, *vae_scale_factors(self.model_source), cfg=cfg)
            height, width, frames = height or dh, width or dw, frames or df
        defaults = dict(
            negative_prompt=val.negative_prompt,
            height=height,
            width=width,
            num_frames=frames,
            sampling_steps=val.sampling_steps,
            guidance_scale=val.guidance_scale,
            seed=val.seed,
        )
        self.prompts = resolve_prompts(entries, defaults, where)
        if self.prompts and not self.model_source:
            # Held-out loss still works; only the videos need a VAE and a text encoder.
            logger.warning(
                "callbacks.validation: no sample videos: no VAE/text encoder to sample with (the student has "
                "no init_from and the dataset records no model); set callbacks.validation.model_from"
            )
            self.prompts = []
        self.data_path = data_path
        self.vae = None
        self.embeddings: dict[str, torch.Tensor] = {}
        self.written: list[Path] = []
        # An image-to-video student samples from the first frame of a training clip (see _load).
        self.condition: Optional[dict] = None
        # (step, one grid_cell strip per prompt) of every validation so far: the sample grid's columns.
        self.grid_columns: list[tuple[int, list[np.ndarray]]] = []
        # (latents, decoded clip as pixels in [-1, 1]) of the first `distance_clips` training clips,
        # decoded once.
        self.references: Optional[list[tuple[torch.Tensor, np.ndarray]]] = None
        # (step, samples/distance, samples/latent_distance) of every validation
        self.distances: list[tuple[int, float, float]] = []
        # A few-step student (distillation): the scheduler and step count it samples with (the
        # method's `sampling_schedule`), and the teacher's (temporal variation, colour spread) on the
        # same prompts and seeds, measured once.
        self.student_schedule: Any = None
        self.student_steps = 0
        self.teacher_statistics: Optional[tuple[float, float]] = None

    def _samples_here(self, acc: Any) -> bool:
        # Sharded weights and context parallelism need every rank in each forward; otherwise the
        # main process samples alone.
        return acc.is_main_process or is_sharded(acc) or self.cfg.training.model.context_parallel.degree > 1

    def _load(self, trainer: Any) -> None:
        """Load the student family's VAE (kept on the CPU between validations) and encode every prompt
        once with its text encoder(s)."""
        acc = trainer.accelerator
        source = self.model_source
        revision = self.cfg.models.student.revision if source == self.cfg.models.student.init_from else None
        family = type(trainer.method.student)
        # Same lookup as the student's (cache honoured offline); errors name the model and what to do.
        text_dtype = torch.bfloat16 if acc.device.type == "cuda" else torch.float32
        encoder = family.make_encoder(source, device=acc.device, dtype=text_dtype, revision=revision)
        texts = sorted({p.prompt for p in self.prompts} | {p.negative_prompt for p in self.prompts})
        with torch.no_grad():
            for text in texts:
                columns = {k: v.float().cpu() for k, v in encoder.encode_caption(text).items()}
                self.embeddings[text] = prompt_columns(columns, self.cfg.training.data.text_max_length)
        # All of it in fp32 with `.float()`: diffusers' `.to` given a dtype warns, at every call,
        # about the modules a model keeps in fp32 (here fp32 like the rest).
        self.vae = encoder.vae.to("cpu").float().eval().requires_grad_(False)
        self.spatial, self.temporal = int(encoder.spec.scale_factor_spatial), int(encoder.spec.scale_factor_temporal)
        del encoder
        self.schedule = repo_sampling_schedule(source, self.val, family, revision=revision)
        few_step = getattr(trainer.method, "sampling_schedule", None)
        if few_step is not None:
            self.student_schedule = few_step()
            self.student_steps = len(trainer.method.few_step_sigmas(torch.Size([1, 1, 1, 1, 1])))
        if trainer.method.student.capabilities.image_conditioning:
            self._load_condition(spatial=self.spatial, temporal=self.temporal)

    def describe_sampler(self, trainer: Any) -> str:
        """What the sample videos step with, for the log at start."""
        if self.student_schedule is not None and getattr(trainer.method.student, "causal_attention", None) is not None:
            return (
                f"the block-causal student at its {self.student_steps} steps without guidance, streamed chunk by chunk "
                f"over its KV cache (the method's sampler); the teacher once, at {self.val.sampling_steps} steps with "
                f"{self.schedule.describe()}"
            )
        if self.student_schedule is not None:
            return (
                f"the student at its {self.student_steps} steps without guidance through the {trainer.method.student.family} "
                f"family's diffusers pipeline with {self.student_schedule.class_name} ({self.student_schedule.origin}); "
                f"the teacher once, at {self.val.sampling_steps} steps with {self.schedule.describe()}"
            )
        chunk_size = chunk_size_of(trainer.method)
        if chunk_size is None:
            return (
                f"whole clips through the {trainer.method.student.family} family's diffusers pipeline (or the same "
                f"loop over the student where that pipeline cannot take its inputs) with {self.schedule.describe()}"
            )
        if self.schedule.dynamic:
            shift = "the static shift of its resolution-dependent rule at each sample's token count"
        else:
            shift = f"shift {self.schedule.euler_shift(0):g}"
        text = (
            f"the diffusion-forcing sampler (fv_accel.sampling; chunks of {chunk_size} latent frames, ar_step "
            f"{self.val.ar_step}) steps each chunk with Euler on FlowMatchEulerDiscreteScheduler's sigmas at {shift}, "
            f"the shift of {self.schedule.describe()}"
        )
        if self.schedule.class_name != "FlowMatchEulerDiscreteScheduler":
            text += f"; {self.schedule.class_name} itself is not used for chunk-by-chunk sampling"
        return text

    def _load_condition(self, *, spatial: int, temporal: int) -> None:
        """The first clip of the training data conditions every image-to-video sample; the samples
        take its size (the condition fixes it)."""
        import dataclasses

        from fv_accel.data.loader import LatentDataset

        self.condition = collate_one(LatentDataset(self.data_path, text_max_length=self.cfg.training.data.text_max_length)[(0, 0, 0)])
        _, t, h, w = self.condition["vae_latent"].shape[1:]
        size = dict(height=h * spatial, width=w * spatial, num_frames=(t - 1) * temporal + 1)
        self.prompts = [dataclasses.replace(p, **size) for p in self.prompts]
        logger.info(
            "image-to-video samples start from the first frame of %s row 0 (%dx%d, %d frames)",
            self.data_path, size["height"], size["width"], size["num_frames"],
        )

    def on_train_start(self, trainer: Any) -> None:
        if not self.prompts:
            return
        if self._samples_here(trainer.accelerator):
            self._load(trainer)
            if trainer.accelerator.is_main_process:
                logger.info(
                    "sample videos: %s | training shift %s (models.student.flow_shift, else the family's)",
                    self.describe_sampler(trainer), trainer.method.student.describe_training_shift(),
                )
        if self.val.at_start:
            self.sample(trainer, trainer.step)

    def on_step_end(self, trainer: Any, step: int, logs: dict) -> None:
        if self.prompts and _is_due(trainer, step, self.val.every_steps):
            self.sample(trainer, step)

    def _sample_few_step(self, trainer: Any, student: Any, p: SamplePrompt) -> torch.Tensor:
        """A few-step student's sample, as the stock pipeline with the exported scheduler makes it:
        the start noise from the prompt's seed, each re-noising from the global generator seeded
        with seed + 1 (the pipeline draws it there; `evaluation_mode` restores the global state)."""
        import dataclasses

        torch.manual_seed(p.seed + 1)
        few = dataclasses.replace(p, sampling_steps=self.student_steps, guidance_scale=1.0)
        streams = getattr(trainer.method, "sample", None)
        if getattr(student, "causal_attention", None) is not None and streams is not None:
            # A block-causal student streams: chunk by chunk over its KV cache (the method's sampler),
            # the start noise from the prompt's seed, the re-noising from the global generator as above.
            from fv_accel.models.base import TrainingBatch
            from fv_accel.sampling import latent_frames

            cond = student.build_conditioning(self.embeddings[p.prompt])
            shape = (1, student.in_channels, latent_frames(p.num_frames, self.temporal), p.height // self.spatial,
                     p.width // self.spatial)
            noise = torch.randn(shape, generator=torch.Generator().manual_seed(p.seed), dtype=torch.float32)
            return streams(TrainingBatch(conditioning=cond), noise.to(trainer.accelerator.device))
        return self._sample_latents(trainer, student, few, schedule=self.student_schedule)

    def _sample_latents(self, trainer: Any, student: Any, p: SamplePrompt, schedule: Any = None) -> torch.Tensor:
        from fv_accel.sampling import latent_frames, sample_diffusion_forcing, sample_with_scheduler

        condition = self.condition

        def conditioning(prompt: str) -> Conditioning:
            # The prompt's columns over the image condition's (a training clip's, image-to-video).
            return student.build_conditioning({**(condition or {}), **self.embeddings[prompt]})

        text, negative = conditioning(p.prompt), conditioning(p.negative_prompt)
        # The validation's own generator, on the CPU: never the method's, and device-independent.
        generator = torch.Generator().manual_seed(p.seed)
        chunk_size = chunk_size_of(trainer.method)
        schedule = schedule or self.schedule
        spatial, temporal = self.spatial, self.temporal
        shape = (1, student.in_channels, latent_frames(p.num_frames, temporal), p.height // spatial, p.width // spatial)
        steps = dict(num_inference_steps=p.sampling_steps, guidance_scale=p.guidance_scale)
        if chunk_size is None:
            # The family's own diffusers pipeline, where it has one for this student.
            latents = student.sample_latents(
                self.vae, text, negative, height=p.height, width=p.width, num_frames=p.num_frames,
                scheduler=schedule.build(), generator=generator,
                first_frame=None if condition is None else condition["pil_image"][0].numpy(), **steps,
            )
            if latents is not None:
                return latents
        noise = torch.randn(shape, generator=generator, dtype=torch.float32).to(trainer.accelerator.device)
        clean = text.clean_frames
        first = student.clean_latents(condition)[:, :, :clean] if clean else None
        per_frame = student.capabilities.per_frame_timesteps

        def predict(x: torch.Tensor, t: torch.Tensor, cond: Conditioning) -> torch.Tensor:
            # A student without per-frame timesteps samples whole clips only: one timestep per sample.
            single = t[:, 0]
            if clean:  # the sampled frames follow the condition frames, the clean first frame at t = 0
                x = torch.cat([first.expand(x.shape[0], -1, -1, -1, -1), x], dim=2)
                t = torch.cat([t.new_zeros(t.shape[0], clean), t], dim=1)
            return student.forward(x, t if per_frame else single, cond)[:, :, clean:]

        # The samplers run over the frames after the condition frames: the chunks start there, as in
        # training (DFSFT's noise chunks and a causal student's attention blocks).
        sampled = noise[:, :, clean:]
        if chunk_size is None:
            # No family pipeline for this student: the pipeline's loop, with the same scheduler.
            x = sample_with_scheduler(predict, sampled, text, schedule.build(), negative_text=negative, **steps)
        else:
            x = sample_diffusion_forcing(
                predict, sampled, text, chunk_size=chunk_size, shift=self.schedule.euler_shift(student.tokens(shape)),
                negative_text=negative, ar_step=self.val.ar_step, context_noise=self.val.context_noise,
                generator=generator, causal=getattr(student, "causal_block_size", None) is not None, **steps,
            )
        if clean:
            x = torch.cat([first.to(x.dtype), x], dim=2)
        return x

    def _teacher_statistics(self, trainer: Any, step: int) -> tuple[float, float]:
        """The teacher's samples' mean (temporal variation, colour spread) over the prompts, at its
        own steps, guidance and sampler (the reference a collapsing student falls below)."""
        from fv_accel.sampling import decode_latents

        teacher = trainer.method.teacher
        stats = []
        for p in self.prompts:
            latents = self._sample_latents(trainer, teacher, p)
            frames = decode_latents(self.vae, latents, teacher.latents_mean, teacher.latents_std, decode=type(teacher).decode)[0]
            stats.append(video_statistics(frames))
        temporal, spread = (float(np.mean([s[i] for s in stats])) for i in (0, 1))
        if trainer.accelerator.is_main_process:
            trainer.log_metrics({"teacher/temporal_variation": temporal, "teacher/colour_spread": spread}, step)
            logger.info(
                "teacher's samples (%d steps, guidance %g): temporal variation %.4f, colour spread %.4f",
                self.val.sampling_steps, self.val.guidance_scale, temporal, spread,
            )
        return temporal, spread

    def _check_collapse(self, trainer: Any, step: int, videos: list[np.ndarray]) -> None:
        """The student's samples against the teacher's on both sides (`sample_watch_message`): one
        warning line, and with stop_on_collapse a stop with a checkpoint."""
        stats = [video_statistics(frames) for frames in videos]
        temporal, spread = (float(np.mean([s[i] for s in stats])) for i in (0, 1))
        trainer.log_metrics({"samples/temporal_variation": temporal, "samples/colour_spread": spread}, step)
        t_temporal, t_spread = self.teacher_statistics
        message = sample_watch_message(
            step, "the student's samples", {"temporal_variation": temporal, "colour_spread": spread},
            {"temporal_variation": t_temporal, "colour_spread": t_spread}, "the teacher's", self.val.collapse_ratio,
        )
        if message is None:
            return
        logger.warning("%s", message)
        if self.val.stop_on_collapse:
            trainer.request_stop(f"callbacks.validation.stop_on_collapse ({message})")

    def _reference_clips(self, student: Any) -> list[tuple[torch.Tensor, np.ndarray]]:
        """The first `distance_clips` training clips (rows the training loader sees): (normalised
        latents [C, T, H, W] on the CPU, the clip decoded by the sampling VAE, as float32 pixels in
        [-1, 1] [F, H, W, 3])."""
        from fv_accel.data.loader import LatentDataset
        from fv_accel.sampling import decode_latents

        excluded = set(training_exclusions(self.cfg, self.data_path))
        dataset = LatentDataset(self.data_path)
        rows = [r for r in range(len(dataset)) if r not in excluded][: self.val.distance_clips]
        clips = []
        for row in rows:
            latents = student.clean_latents(collate_one(dataset[(row, 0, 0)]))
            frames = decode_latents(self.vae, latents, student.latents_mean, student.latents_std, decode=type(student).decode)[0]
            clips.append((latents[0].float().cpu(), _pixels(frames)))
        return clips

    def _log_distance(self, trainer: Any, student: Any, step: int, samples: list[tuple[str, torch.Tensor, np.ndarray]]) -> None:
        """samples/distance (pixels) and samples/latent_distance of (name, latents, frames) per prompt."""
        if self.references is None:
            self.references = self._reference_clips(student)
        logs: dict[str, float] = {}
        for name, latents, frames in samples:
            pixel = nearest_mse(_pixels(frames), [f for _, f in self.references])
            if pixel is not None:
                logs[f"samples/distance/{name}"] = pixel
            latent = nearest_mse(latents[0].float().cpu(), [r for r, _ in self.references])
            if latent is not None:
                logs[f"samples/latent_distance/{name}"] = latent
        for key in ("samples/distance", "samples/latent_distance"):
            values = [v for k, v in logs.items() if k.startswith(key + "/")]
            if values:
                logs[key] = float(np.mean(values))
        if logs:
            self.distances.append((step, logs.get("samples/distance", math.nan), logs.get("samples/latent_distance", math.nan)))
            trainer.log_metrics(logs, step)
            logger.info(
                "step %d: samples' distance to the nearest training clip: pixel MSE %.4f, latent MSE %.4f",
                step, logs.get("samples/distance", math.nan), logs.get("samples/latent_distance", math.nan),
            )

    def _write_grid(self, trainer: Any, step: int, videos: list[tuple[str, np.ndarray, Path]]) -> None:
        from PIL import Image

        self.grid_columns.append((step, [grid_cell(frames) for _, frames, _ in videos]))
        grid = grid_of_cells(self.grid_columns)
        path = Path(trainer.output_dir) / "samples" / "grid.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(grid).save(path)
        from fv_accel.plot import log_png_images

        log_png_images(trainer.accelerator, {"validation/grid": path}, step)

    def summary(self) -> dict[str, Any]:
        if not self.distances:
            return {}
        return {
            "first_sample_distance": self.distances[0][1],
            "last_sample_distance": self.distances[-1][1],
            "first_sample_latent_distance": self.distances[0][2],
            "last_sample_latent_distance": self.distances[-1][2],
        }

    def sample(self, trainer: Any, step: int) -> list[Path]:
        """Render every prompt; the main process writes mp4s and logs them. Returns the paths."""
        from fv_accel.data.video import write_video
        from fv_accel.sampling import decode_latents

        acc = trainer.accelerator
        paths: list[Path] = []
        if self._samples_here(acc):
            t0 = time.perf_counter()
            out_dir = Path(trainer.output_dir) / "samples" / f"step-{step}"
            samples = []  # (name, latents, frames, path)
            ema = self.ema.applied() if self.ema is not None else contextlib.nullcontext()
            with evaluation_mode(trainer) as student, ema:
                self.vae.to(acc.device)
                try:
                    if self.student_schedule is not None and self.teacher_statistics is None:
                        self.teacher_statistics = self._teacher_statistics(trainer, step)
                    for p in self.prompts:
                        if self.student_schedule is not None:
                            latents = self._sample_few_step(trainer, student, p)
                        else:
                            latents = self._sample_latents(trainer, student, p)
                        frames = decode_latents(
                            self.vae, latents, student.latents_mean, student.latents_std, decode=type(student).decode
                        )[0]
                        # A family that makes sound (LTX-2): the mp4 carries it, at the frame rate it was made for.
                        sound = student.sample_sound()
                        if acc.is_main_process:
                            fps = self.val.fps if sound is None else student.frame_rate
                            path = write_video(out_dir / f"{p.name}.mp4", frames, fps=fps, audio=sound)
                            samples.append((p.name, latents, frames, path))
                            paths.append(path)
                    if acc.is_main_process and self.val.distance_clips and self.data_path:
                        self._log_distance(trainer, student, step, [(n, z, f) for n, z, f, _ in samples])
                    if acc.is_main_process and self.teacher_statistics is not None:
                        self._check_collapse(trainer, step, [f for _, _, f, _ in samples])
                finally:
                    self.vae.to("cpu")
            if acc.is_main_process:
                videos = [(n, f, path) for n, _, f, path in samples]
                log_videos(acc, videos, step, self.val.fps)
                self._write_grid(trainer, step, videos)
                trainer.log_metrics({"validation/sampling_time_s": time.perf_counter() - t0}, step)
                logger.info("step %d: %d sample video(s) in %s", step, len(paths), out_dir)
        acc.wait_for_everyone()
        self.written += paths
        return paths


def check_validation_data(cfg: Any, data_path: str) -> None:
    """What validation needs of the training data's video latents (the held-out loss noises them;
    samples/distance decodes them): refused in one line on a text-only dataset."""
    from fv_accel.config import ConfigError
    from fv_accel.data.schema import dataset_is_text_only

    val = cfg.callbacks.validation
    if not val.enable:
        return
    if val.heldout_data_path and val.heldout_data_path != "tiny" and dataset_is_text_only(val.heldout_data_path):
        raise ConfigError(
            f"callbacks.validation.heldout_data_path '{val.heldout_data_path}' is a text-only dataset (prompts without "
            "video latents): the held-out loss noises video latents; give a dataset preprocessed from videos"
        )
    split = val.heldout_fraction > 0 and not val.heldout_data_path  # rows held out of the training data
    asks = [key for key, on in (("heldout_fraction", split), ("distance_clips", val.distance_clips > 0)) if on]
    if not asks or not data_path or not dataset_is_text_only(data_path):
        return
    raise ConfigError(
        f"callbacks.validation.{' and '.join(asks)} need the video latents of training.data.data_path, but "
        f"'{cfg.training.data.data_path}' is a text-only dataset (prompts without video latents): set "
        f"{' and '.join(f'callbacks.validation.{key} 0' for key in asks)} (a held-out loss can use heldout_data_path, a dataset preprocessed from videos)"
    )


def sample_watch_message(step: int, subject: str, figures: dict, reference: dict, reference_name: str,
                         ratio: float) -> Optional[str]:
    """One line when the samples' temporal variation or colour spread leaves [ratio, 1 / ratio]
    times the reference's: below, collapse (static, solid); above, divergence (flicker, noise).
    The line names every figure beside the reference's (the one inside the band too), so a run
    whose colour spread diverges also shows where its temporal variation stands. None inside
    (or without a positive reference figure)."""
    parts, sides = [], set()
    for key, name in (("temporal_variation", "temporal variation"), ("colour_spread", "colour spread")):
        ours, ref = figures.get(key, math.nan), reference.get(key, math.nan)
        if not ref > 0 or not math.isfinite(ours):
            continue
        if ours < ratio * ref:
            sides.add("below")
            parts.append(f"{name} {ours:.4f}, below {ratio:g} x {reference_name} {ref:.4f}")
        elif ours > ref / ratio:
            sides.add("above")
            parts.append(f"{name} {ours:.4f}, above {reference_name} {ref:.4f} / {ratio:g}")
        else:
            relation = "above" if ours > ref else "below" if ours < ref else "equal to"
            parts.append(f"{name} {ours:.4f}, {relation} {reference_name} {ref:.4f} ({ours / ref:.2f} x, inside the band)")
    if not sides:
        return None
    verdict = {frozenset({"below"}): "collapsing (static, solid)", frozenset({"above"}): "diverging (flicker, noise)"}
    state = verdict.get(frozenset(sides), "collapsing and diverging (one figure below, one above)")
    return f"step {step}: {subject} are {state}: {'; '.join(parts)} (callbacks.validation.collapse_ratio)"


def video_statistics(frames: np.ndarray) -> tuple[float, float]:
    """(temporal variation, colour spread) of a uint8 video [F, H, W, 3] in [0, 1] units: the mean
    absolute change between consecutive frames (0 for one frame), and the mean over frames of the
    standard deviation of the frame's pixel values. A static or solid-colour video scores ~0."""
    x = np.asarray(frames, dtype=np.float32) / 255.0
    temporal = float(np.abs(np.diff(x, axis=0)).mean()) if x.shape[0] > 1 else 0.0
    spread = float(np.mean([frame.std() for frame in x]))
    return temporal, spread


def build_validation_callbacks(
    cfg: Any, data_path: str, ema: Any = None, accelerator: Any = None
) -> list[TrainerCallback]:
    """The held-out-loss and video callbacks the recipe asks for (none when validation is off)."""
    val = cfg.callbacks.validation
    if not val.enable:
        return []
    check_validation_data(cfg, data_path)
    callbacks: list[TrainerCallback] = []
    if val.heldout_fraction > 0 or val.heldout_data_path:
        callbacks.append(HeldoutLossCallback(cfg, data_path, resolve_heldout_path(cfg, accelerator)))
    video = VideoSamplingCallback(cfg, data_path, ema=ema)
    if video.prompts:
        callbacks.append(video)
    if not callbacks:
        logger.warning(
            "callbacks.validation.enable is true but there is nothing to validate: give prompts / a "
            "prompt_file, or a heldout_fraction / heldout_data_path"
        )
    return callbacks
