"""Training-state checkpoints: `output_dir/checkpoint-<step>/`, written atomically, resumed exactly.

A checkpoint holds what Accelerate's `save_state` writes (model or adapter as safetensors,
optimizer and LR scheduler), plus, per rank, one `fv_rank_<i>.safetensors` with the Python, NumPy,
torch (and CUDA) RNG states, the method's generator and the callbacks' tensors (EMA), and a
`metadata.json` (step, epoch, data position, resolved config, package versions).

Safety: nothing here is unpickled. Accelerate pickles its RNG states (`random_states_<i>.pkl`); we
delete that file after `save_state` and restore the RNG from our safetensors instead. The optimizer
and scheduler `.bin` files are loaded by Accelerate with `torch.load(weights_only=True)`.

Atomicity: everything is written into `.checkpoint-<step>.partial/` and renamed into place once
complete, then the `latest` pointer is replaced. A crash mid-save leaves the previous checkpoint
intact, and `latest` only ever names a complete one.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

logger = logging.getLogger(__name__)

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
METADATA_NAME = "metadata.json"
LATEST_NAME = "latest"
FORMAT_NAME = "fv_accel-checkpoint"
FORMAT_VERSION = 1
# Accelerate's pickled RNG file (accelerate.utils.RNG_STATE_NAME).
ACCELERATE_RNG_FILE = "random_states_{rank}.pkl"
PACKAGES = ("fv_accel", "torch", "accelerate", "diffusers", "transformers", "peft", "safetensors", "datasets", "numpy")
# Settings that change the run but not the loss formula: resuming with a new value only warns.
WARN_ON_CHANGE = (
    "training.optimizer.learning_rate",
    "training.optimizer.lr_warmup_steps",
    "training.optimizer.lr_num_cycles",
    "training.optimizer.lr_power",
    "training.optimizer.min_lr_ratio",
    "training.loop.gradient_accumulation_steps",
    "training.loop.noise_rng",
    "training.data.train_batch_size",
    "training.data.seed",
)


class CheckpointError(ValueError):
    """A checkpoint or output-folder problem; the message names the folder and the key."""


# --------------------------------------------------------------------------------------------
# Finding checkpoints
# --------------------------------------------------------------------------------------------


def checkpoint_step(path: Path) -> Optional[int]:
    m = CHECKPOINT_RE.match(path.name)
    return int(m.group(1)) if m else None


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints (a `checkpoint-<step>` folder with its metadata), oldest step first."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = []
    for p in out.iterdir():
        step = checkpoint_step(p)
        if step is not None and p.is_dir() and (p / METADATA_NAME).is_file():
            found.append((step, p))
    return [p for _, p in sorted(found)]


def latest_checkpoint(output_dir: str | Path) -> Optional[Path]:
    """The checkpoint the `latest` pointer names, else the highest complete step, else None."""
    out = Path(output_dir)
    pointer = out / LATEST_NAME
    if pointer.is_file():
        named = out / pointer.read_text(encoding="utf-8").strip()
        if checkpoint_step(named) is not None and (named / METADATA_NAME).is_file():
            return named
    found = list_checkpoints(out)
    return found[-1] if found else None


def resolve_resume(output_dir: str | Path, resume: str) -> Optional[Path]:
    """`training.checkpoint.resume_from_checkpoint`: "" (fresh), "latest" (None if there is none
    yet, so a preemptible job can always pass it) or a checkpoint folder."""
    if not resume:
        return None
    if resume == "latest":
        return latest_checkpoint(output_dir)
    path = Path(resume)
    if not path.is_dir():
        raise CheckpointError(
            f"training.checkpoint.resume_from_checkpoint: '{resume}' is not a folder; "
            f"expected 'latest' or a checkpoint-<step> folder"
        )
    if not (path / METADATA_NAME).is_file():
        raise CheckpointError(
            f"training.checkpoint.resume_from_checkpoint: '{resume}' has no {METADATA_NAME}; "
            f"it is not a complete fv_accel checkpoint"
        )
    return path


def check_fresh_output_dir(output_dir: str | Path) -> None:
    """A fresh run must not mix its checkpoints with another run's."""
    found = list_checkpoints(output_dir)
    if found:
        names = ", ".join(p.name for p in found[-3:])
        raise CheckpointError(
            f"training.checkpoint.output_dir: '{output_dir}' already holds checkpoints of another run "
            f"({names}); resume it with --resume_from_checkpoint latest, or choose a new output_dir"
        )


def read_metadata(ckpt: str | Path) -> dict:
    path = Path(ckpt) / METADATA_NAME
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{ckpt}: no {METADATA_NAME}; not a complete fv_accel checkpoint") from None
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path}: not valid JSON ({err})") from None
    if meta.get("format") != FORMAT_NAME or "step" not in meta:
        raise CheckpointError(f"{path}: not an fv_accel checkpoint (expected format '{FORMAT_NAME}' and a step)")
    return meta


def _dotted(tree: dict, key: str) -> Any:
    node: Any = tree
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def check_resume_compatible(meta: dict, method: Any, cfg: Any, ckpt: str | Path) -> list[str]:
    """Compare the checkpoint's recipe with the current one. A change to the method's math
    (method.*, models.*: method, chunk size, shift, timestep range) is refused unless
    `training.checkpoint.allow_recipe_change`; a change to the schedule or data order warns.
    Returns the differences found ("key: old -> new")."""
    old_math = meta.get("math") or {}
    # Through JSON so tuples/lists and ints/floats compare as they were stored.
    new_math = json.loads(json.dumps(method.math_signature(), default=str))
    refused, warned = [], []
    for key in sorted(set(old_math) | set(new_math)):
        old, new = old_math.get(key), new_math.get(key)
        if old != new:
            line = f"{key}: {old!r} in the checkpoint, {new!r} now"
            (refused if key.startswith(("method.", "models.")) else warned).append(line)
    old_cfg, new_cfg = meta.get("config") or {}, json.loads(json.dumps(cfg.to_dict(), default=str))
    for key in WARN_ON_CHANGE:
        old, new = _dotted(old_cfg, key), _dotted(new_cfg, key)
        if old is not None and old != new:
            warned.append(f"{key}: {old!r} in the checkpoint, {new!r} now")
    if refused and not cfg.training.checkpoint.allow_recipe_change:
        raise CheckpointError(
            f"cannot resume from {ckpt}: the recipe changes the training math ({'; '.join(refused)}); "
            f"resume with the checkpoint's values, or set training.checkpoint.allow_recipe_change: true"
        )
    for line in refused + warned:
        logger.warning("resuming from %s with a changed recipe: %s", ckpt, line)
    return refused + warned


# --------------------------------------------------------------------------------------------
# RNG states as tensors + strings (safetensors), never pickles
# --------------------------------------------------------------------------------------------


def capture_rng_states(method_generator: torch.Generator) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    version, py_words, gauss_next = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_cached = np.random.get_state()
    tensors = {
        "rng/python": torch.tensor(py_words, dtype=torch.int64),
        "rng/numpy": torch.from_numpy(np_keys.astype(np.int64)),
        "rng/torch": torch.get_rng_state(),
        "rng/method_generator": method_generator.get_state().cpu(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng/cuda/{i}"] = state
    strings = {
        "rng/python": json.dumps([version, gauss_next]),
        "rng/numpy": json.dumps([np_kind, int(np_pos), int(np_has_gauss), float(np_cached)]),
    }
    return tensors, strings


def restore_rng_states(
    tensors: dict[str, torch.Tensor], strings: dict[str, str], method_generator: torch.Generator
) -> None:
    version, gauss_next = json.loads(strings["rng/python"])
    random.setstate((version, tuple(int(w) for w in tensors["rng/python"].tolist()), gauss_next))
    np_kind, np_pos, np_has_gauss, np_cached = json.loads(strings["rng/numpy"])
    np.random.set_state((np_kind, tensors["rng/numpy"].numpy().astype(np.uint32), np_pos, np_has_gauss, np_cached))
    torch.set_rng_state(tensors["rng/torch"])
    cuda = sorted((k for k in tensors if k.startswith("rng/cuda/")), key=lambda k: int(k.rsplit("/", 1)[1]))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensors[k] for k in cuda])
    method_generator.set_state(tensors["rng/method_generator"])


def rank_state_file(ckpt: Path, rank: int) -> Path:
    return ckpt / f"fv_rank_{rank}.safetensors"


def write_rank_state(trainer: Any, path: Path) -> None:
    tensors, strings = capture_rng_states(trainer.method.cuda_generator)
    for name, value in trainer.extra_state_tensors().items():
        tensors[f"extra/{name}"] = value.detach().to("cpu").contiguous().clone()
    save_file(tensors, str(path), metadata=strings)


def read_rank_state(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), framework="pt", device="cpu") as fh:
        strings = dict(fh.metadata() or {})
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    return tensors, strings


# --------------------------------------------------------------------------------------------
# Save
# --------------------------------------------------------------------------------------------


def package_versions() -> dict[str, Optional[str]]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib_metadata.version(name)
        except importlib_metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def build_metadata(trainer: Any, step: int) -> dict:
    acc = trainer.accelerator
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "step": step,
        "epoch": trainer.dataloader.epoch,
        "data": trainer.dataloader.state_dict(),
        "accelerator_step": int(acc.step),
        "trainer": trainer.state_dict(),
        "world_size": acc.num_processes,
        "math": trainer.method.math_signature(),
        "config": trainer.config.to_dict(),
        "versions": package_versions(),
    }


def write_metadata(path: Path, meta: dict) -> None:
    path.write_text(json.dumps(meta, indent=2, default=str) + "\n", encoding="utf-8")


def _fsync_tree(folder: Path) -> None:
    # The rename is the commit: make sure the bytes it publishes are on disk first.
    for root, _dirs, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(str(folder), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems do not fsync directories
    finally:
        os.close(fd)


def _publish(tmp: Path, final: Path) -> None:
    """Rename the finished folder into place (replacing an older save of the same step)."""
    old = final.with_name(f".{final.name}.old")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    if old.exists():
        shutil.rmtree(old)
    _fsync_dir(final.parent)


def _point_latest(out: Path, final: Path) -> None:
    tmp = out / f".{LATEST_NAME}.tmp"
    tmp.write_text(final.name + "\n", encoding="utf-8")
    os.replace(tmp, out / LATEST_NAME)


def _prune(out: Path, limit: int, current_step: int) -> None:
    """Keep the newest `limit` checkpoints up to this step. Checkpoints beyond it (left by an earlier
    attempt that this run resumed before) are not counted and not touched."""
    if limit <= 0:
        return
    found = [p for p in list_checkpoints(out) if checkpoint_step(p) <= current_step]
    for old in found[:-limit]:
        shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(trainer: Any, step: int) -> Path:
    acc = trainer.accelerator
    ck = trainer.config.training.checkpoint
    out = Path(ck.output_dir)
    final = out / f"checkpoint-{step}"
    tmp = out / f".checkpoint-{step}.partial"
    if acc.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        for stale in out.glob(".checkpoint-*.partial"):  # left by a save that crashed
            shutil.rmtree(stale, ignore_errors=True)
    acc.wait_for_everyone()
    acc.save_state(str(tmp), safe_serialization=True)
    (tmp / ACCELERATE_RNG_FILE.format(rank=acc.process_index)).unlink(missing_ok=True)
    write_rank_state(trainer, rank_state_file(tmp, acc.process_index))
    acc.wait_for_everyone()
    if acc.is_main_process:
        write_metadata(tmp / METADATA_NAME, build_metadata(trainer, step))
        _fsync_tree(tmp)
        _publish(tmp, final)
        _point_latest(out, final)
        _prune(out, ck.checkpoints_total_limit, step)
        logger.info("saved checkpoint %s", final)
    acc.wait_for_everyone()
    return final


# --------------------------------------------------------------------------------------------
# Load
# --------------------------------------------------------------------------------------------


def load_checkpoint(trainer: Any, ckpt: Path) -> int:
    """Restore model, optimizer, LR schedule, RNG states, callbacks' tensors and data position.
    Returns the step to continue from; the trainer's counters are in `read_metadata(ckpt)["trainer"]`."""
    acc = trainer.accelerator
    ckpt = Path(ckpt)
    meta = read_metadata(ckpt)
    stray = sorted(p.name for p in ckpt.glob("*.pkl"))
    if stray:
        # Not written by us; Accelerate still loads them only with weights_only=True.
        logger.warning("%s holds pickle file(s) %s; they are loaded with weights_only=True only", ckpt, stray)
    acc.load_state(str(ckpt), load_kwargs={"weights_only": True})
    acc.step = int(meta.get("accelerator_step", 0))
    state_file = rank_state_file(ckpt, acc.process_index)
    if state_file.is_file():
        tensors, strings = read_rank_state(state_file)
        restore_rng_states(tensors, strings, trainer.method.cuda_generator)
        trainer.load_extra_state_tensors({k[len("extra/"):]: v for k, v in tensors.items() if k.startswith("extra/")})
    else:
        logger.warning(
            "%s has no state for rank %d (saved with %s processes, now %d): this rank's random "
            "stream starts from its seed, so the resumed run is not identical to an uninterrupted one",
            ckpt,
            acc.process_index,
            meta.get("world_size"),
            acc.num_processes,
        )
    trainer.dataloader.load_state_dict(meta["data"])
    return int(meta["step"])
