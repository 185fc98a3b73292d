"""The KD teacher-trajectory cache: one safetensors file per training row, holding the teacher's
ODE states (bf16, as FastVideo stores them) and its final x0, each file's sha256 beside it, and the
cache's fingerprint (teacher, guidance, steps, shift, rows, kept steps, dtype) in `kd_cache.json`.

Layout of a cache folder (`method.teacher_path_cache`):

    kd_cache.json                    the fingerprint and the shapes (written first, checked on reuse)
    samples/00000012.safetensors     trajectory_latents [S, C, T, H, W] bf16, trajectory_timesteps [S]
                                     int64 (the teacher timesteps kept), real [C, T, H, W] bf16
    samples/00000012.sha256          the sha256 of that file, written after it

A sample is done when both files are there; each is written to a temporary name, fsynced and
renamed, so a kill at any point leaves either a finished sample or none, and a restart writes the
missing ones only. The teacher's ODE starts from pure noise drawn from a generator seeded per row,
so the bytes do not depend on how many processes wrote them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

logger = logging.getLogger(__name__)

META_FILE = "kd_cache.json"
SAMPLES_DIR = "samples"
CACHE_FORMAT = 1
STORED_DTYPE = torch.bfloat16
KEEP_MODES = ("all", "t_list")
# What one stored sample adds besides its states: the timesteps and the safetensors header.
SAMPLE_OVERHEAD_BYTES = 4096


def teacher_timesteps(steps: int, shift: float, num_train_timesteps: int = 1000) -> list[int]:
    """The teacher's ODE timesteps, as FastVideo's SelfForcingFlowMatchScheduler(num_inference_steps=
    steps, shift, sigma_min=0, extra_one_step=True) gives them: sigma = linspace(1, 0, steps + 1)[:-1],
    shifted, times N, truncated to integers (fp32 arithmetic, as there)."""
    sigma = torch.linspace(1.0, 0.0, steps + 1)[:-1]
    sigma = shift * sigma / (1 + (shift - 1) * sigma)
    return [int(t) for t in (sigma * num_train_timesteps).tolist()]


def check_t_list(t_list: list[int], cached: list[int], where: str) -> dict[int, int]:
    """t -> its index among the `cached` timesteps, for each entry of `t_list` but the last (which
    is never read); an entry that is not cached is refused naming the nearest cached values."""
    index = {t: i for i, t in enumerate(cached)}
    for t in t_list[:-1]:
        if t not in index:
            near = sorted(cached, key=lambda c: (abs(c - t), -c))[:2]
            raise ValueError(
                f"method.t_list entry {t} is not one of the {where} ({len(cached)} steps): the nearest are "
                f"{', '.join(map(str, sorted(near, reverse=True)))}; every entry but the last must be a cached timestep"
            )
    return {t: index[t] for t in t_list[:-1]}


def kept_steps(timesteps: list[int], t_list: list[int], keep: str) -> list[int]:
    """The teacher timesteps a sample file stores: all of them, or only those `t_list` reads."""
    if keep == "all":
        return list(timesteps)
    wanted = set(t_list[:-1])
    return [t for t in timesteps if t in wanted]


@dataclass
class CacheSpec:
    """What a cache holds and where: its folder, rows, shapes and fingerprint."""

    folder: Path
    num_samples: int
    latent_shape: tuple[int, ...]  # [C, T, H, W] of one sample
    timesteps: list[int]  # the teacher's whole ODE
    stored: list[int]  # the timesteps each file keeps
    fingerprint: dict = field(default_factory=dict)

    @property
    def samples_dir(self) -> Path:
        return self.folder / SAMPLES_DIR

    def sample_path(self, index: int) -> Path:
        return self.samples_dir / f"{index:08d}.safetensors"

    def checksum_path(self, index: int) -> Path:
        return self.samples_dir / f"{index:08d}.sha256"

    def bytes_per_sample(self) -> int:
        states = (len(self.stored) + 1) * math.prod(self.latent_shape)  # the kept states and the final x0
        return states * STORED_DTYPE.itemsize + SAMPLE_OVERHEAD_BYTES

    def metadata(self) -> dict:
        return {
            "format": CACHE_FORMAT,
            "num_samples": self.num_samples,
            "latent_shape": list(self.latent_shape),
            "teacher_timesteps": self.timesteps,
            "stored_timesteps": self.stored,
            "fingerprint": self.fingerprint,
        }

    def is_done(self, index: int) -> bool:
        return self.sample_path(index).is_file() and self.checksum_path(index).is_file()


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000.0
    return f"{n:.1f} TB"


def check_metadata(spec: CacheSpec) -> None:
    """Refuse, in one line naming what differs, a cache made by another teacher, guidance, schedule
    or for other rows; a folder without metadata is new."""
    path = spec.folder / META_FILE
    if not path.is_file():
        return
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: not readable KD cache metadata ({err}); delete {spec.folder} to make it again") from None
    mine = spec.metadata()
    differs = [k for k in ("num_samples", "latent_shape", "teacher_timesteps", "stored_timesteps") if stored.get(k) != mine[k]]
    theirs = stored.get("fingerprint") or {}
    differs += [f"fingerprint.{k}" for k in sorted(set(theirs) | set(spec.fingerprint)) if theirs.get(k) != spec.fingerprint.get(k)]
    if differs:
        key = differs[0]
        old = theirs.get(key.split(".", 1)[1]) if key.startswith("fingerprint.") else stored.get(key)
        new = spec.fingerprint.get(key.split(".", 1)[1]) if key.startswith("fingerprint.") else mine[key]
        raise ValueError(
            f"method.teacher_path_cache {spec.folder}: the cache was made with another {', '.join(differs)} "
            f"({key}: cached {_short(old)}, this run {_short(new)}); point teacher_path_cache at a new folder or delete this one"
        )


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def write_metadata(spec: CacheSpec) -> None:
    """kd_cache.json, through a temporary name (main process, before any sample)."""
    spec.samples_dir.mkdir(parents=True, exist_ok=True)
    path = spec.folder / META_FILE
    if not path.is_file():
        _write_atomically(path, (json.dumps(spec.metadata(), indent=1) + "\n").encode())


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def write_sample(spec: CacheSpec, index: int, states: torch.Tensor, real: torch.Tensor) -> str:
    """Sample `index`: its states at the stored timesteps and its final x0 (bf16), then its sha256."""
    from safetensors.torch import save

    keep = [spec.timesteps.index(t) for t in spec.stored]
    tensors = {
        "trajectory_latents": states[keep].to(STORED_DTYPE).contiguous().cpu(),
        "trajectory_timesteps": torch.tensor(spec.stored, dtype=torch.long),
        "real": real.to(STORED_DTYPE).contiguous().cpu(),
    }
    data = save(tensors, metadata={"row": str(index)})
    digest = hashlib.sha256(data).hexdigest()
    _write_atomically(spec.sample_path(index), data)
    _write_atomically(spec.checksum_path(index), (digest + "\n").encode())
    return digest


def read_sample(spec: CacheSpec, index: int) -> dict[str, torch.Tensor]:
    """Sample `index`, its bytes checked against the recorded sha256; a missing, truncated or
    corrupt file is refused naming it."""
    from safetensors.torch import load

    path = spec.sample_path(index)
    fix = f"delete it and rerun `python -m fv_accel.kd_cache RECIPE` (or the training run) to write it again"
    if not spec.is_done(index):
        raise ValueError(f"{path}: the KD cache has no finished sample {index}; rerun `python -m fv_accel.kd_cache RECIPE`")
    data = path.read_bytes()
    recorded = spec.checksum_path(index).read_text().strip()
    if hashlib.sha256(data).hexdigest() != recorded:
        raise ValueError(f"{path}: truncated or corrupt KD cache sample ({len(data)} bytes, sha256 differs from the one recorded); {fix}")
    try:
        return load(data)
    except Exception as err:  # noqa: BLE001 - safetensors raises its own error types
        raise ValueError(f"{path}: unreadable KD cache sample ({str(err).splitlines()[0]}); {fix}") from None


class KDCacheDataset(torch.utils.data.Dataset):
    """The finished cache as a dataset: item i is row i's trajectory (checked against its sha256)."""

    def __init__(self, spec: CacheSpec):
        self.spec = spec

    def __len__(self) -> int:
        return self.spec.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return read_sample(self.spec, int(index))

    def collate(self, indices: list[int]) -> dict[str, torch.Tensor]:
        items = [self[i] for i in indices]
        return {key: torch.stack([it[key] for it in items]) for key in items[0]}


class TrajectoryBatches:
    """The training loader's batches (its order, position and resume), each with the trajectories
    of its rows from the cache: `trajectory_latents` [B, S, C, T, H, W], `trajectory_timesteps`
    [B, S], `real` [B, C, T, H, W]. Iterated on the prefetch thread."""

    def __init__(self, loader: Any, dataset: KDCacheDataset):
        self.loader = loader
        self.dataset = dataset

    def __iter__(self):
        return self._batches(iter(self.loader))  # the loader notes its start position on the calling thread

    def _batches(self, source: Any):
        for batch in source:
            batch.update(self.dataset.collate([int(i) for i in batch["sample_index"]]))
            yield batch


@dataclass
class TrajectorySettings:
    """How the teacher's ODE runs: its timesteps, guidance and the table its sigmas come from."""

    timesteps: list[int]
    guidance: float
    table: Any  # the student's training table (FlowMatchTable): the dense 1000-entry grid


def teacher_trajectory(teacher: Any, tb: Any, noise: torch.Tensor, settings: TrajectorySettings) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's Euler ODE from pure `noise` [1, C, T, H, W] over `settings.timesteps`, as
    FastVideo's KD rolls it out (the state kept in bf16 between steps; x0 from the velocity at the
    sigma of the dense grid), with classifier-free guidance uncond + s * (cond - uncond) where
    s != 1 (FastVideo parses the scale but never applies it). Returns (states [S, C, T, H, W], the
    state before each step; the final x0 [C, T, H, W])."""
    table, ts = settings.table, settings.timesteps
    x = noise.to(STORED_DTYPE)  # sigma(t_0) is 1: the first state is the noise itself
    states, x0 = [], None
    for k, t_cur in enumerate(ts):
        states.append(x[0].clone())
        t = torch.full((x.shape[0],), float(t_cur), device=x.device)
        velocity = teacher.predict_noise(x.float(), t, tb, conditional=True)
        if settings.guidance != 1.0:
            uncond = teacher.predict_noise(x.float(), t, tb, conditional=False)
            velocity = uncond + settings.guidance * (velocity - uncond)
        x0 = table.x0_from_velocity(x, velocity, t)
        t_next = ts[k + 1] if k + 1 < len(ts) else 0
        if t_next > 0:
            s = table.nearest_sigmas(t, x.shape[0]).to(x.device).view(-1, 1, 1, 1, 1)
            s_next = table.nearest_sigmas(torch.tensor([float(t_next)]), x.shape[0]).to(x.device).view(-1, 1, 1, 1, 1)
            eps = (x.float() - (1.0 - s) * x0.float()) / s.clamp_min(1e-8)
            x = ((1.0 - s_next) * x0.float() + s_next * eps).to(STORED_DTYPE)
    return torch.stack(states), x0[0]


def check_disk_room(spec: CacheSpec, missing: int) -> int:
    """The bytes `missing` samples take; refused in one line when the disk lacks the room."""
    need = missing * spec.bytes_per_sample()
    probe = spec.folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if need > free:
        raise ValueError(
            f"method.teacher_path_cache {spec.folder}: the KD cache needs {human_bytes(need)} more "
            f"({missing} samples x {human_bytes(spec.bytes_per_sample())}) but {probe} has {human_bytes(free)} free; "
            "free space, point teacher_path_cache at a larger disk, or set method.kd_cache_keep: t_list"
        )
    return need


def generate(spec: CacheSpec, rows: list[int], make_sample: Callable[[int], tuple[torch.Tensor, torch.Tensor]], *, log: bool) -> int:
    """Write the samples of `rows` (this process's missing ones), timing the first to say how long
    the rest takes. Returns the count written."""
    start = time.perf_counter()
    for n, index in enumerate(rows):
        states, real = make_sample(index)
        write_sample(spec, index, states, real)
        if n == 0 and log:
            took = time.perf_counter() - start
            logger.info("KD cache: first sample in %.2f s; about %.0f s for this process's %d", took, took * len(rows), len(rows))
    return len(rows)


def _recipe_latent_shape(cfg: Any) -> Any:
    """[C, T, H, W] of the recipe's rows where the data is on this machine (its first row), else None."""
    try:
        from fv_accel.data.loader import LatentDataset

        dataset = LatentDataset(cfg.training.data.data_path)
    except Exception:  # noqa: BLE001 - a dataset not made yet (the tiny one) or of another machine
        return None
    return tuple(dataset.latent_shapes[0]) if dataset.latent_shapes else None


def dry_run_lines(cfg: Any) -> list[str]:
    """What `--dry-run` says of a KD run's cache (YAML comment lines): what is on disk, or what the
    run will write (per sample, from the recipe's rows where the data is here)."""
    mc = cfg.method
    folder = Path(str(mc.teacher_path_cache))
    meta_path = folder / META_FILE
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        spec = CacheSpec(folder, int(meta["num_samples"]), tuple(meta["latent_shape"]), meta["teacher_timesteps"], meta["stored_timesteps"])
        done = sum(spec.is_done(i) for i in range(spec.num_samples))
        return [
            f"# KD cache {folder}: {done} of {spec.num_samples} samples on disk ({human_bytes(done * spec.bytes_per_sample())}), "
            f"{human_bytes(spec.bytes_per_sample())} per sample ({len(spec.stored)} teacher states of {list(spec.latent_shape)} and the "
            f"final x0, bf16); the run writes the {spec.num_samples - done} missing before training"
        ]
    states = mc.teacher_inference_steps if mc.kd_cache_keep == "all" else max(1, len(mc.t_list or []) - 1)
    shape = _recipe_latent_shape(cfg)
    per = f"{human_bytes((states + 1) * math.prod(shape) * STORED_DTYPE.itemsize + SAMPLE_OVERHEAD_BYTES)} per sample " \
          f"({states} teacher states of {list(shape)} and the final x0, bf16)" if shape else \
          f"{states + 1} latents per sample in bf16 (FastVideo's 77-frame 448x832 Wan 2.1 sample of 48 states: ~179 MB)"
    return [f"# KD cache {folder}: not written yet; the run writes one file per training row first: {per}, "
            f"{mc.teacher_inference_steps} teacher steps each (x2 forwards with teacher_guidance_scale != 1)"]
