"""Training-state checkpoints: `output_dir/checkpoint-<step>/`, written atomically, verified, resumed exactly.

A checkpoint holds what Accelerate's `save_state` writes (model or adapter as safetensors,
optimizer and LR scheduler), plus, per rank, one `fv_rank_<i>.safetensors` with the Python, NumPy,
torch (and CUDA) RNG states, the method's generator and the callbacks' per-rank tensors, the
callbacks' own files (the EMA: one `ema.safetensors` of full tensors), and a `metadata.json`
(step, epoch, data position, resolved config, the optimizer settings that ran, package versions,
and the size and sha256 of every other file).

Safety: nothing here is unpickled. Accelerate pickles its RNG states (`random_states_<i>.pkl`); we
delete that file after `save_state` and restore the RNG from our safetensors instead. The optimizer
and scheduler `.bin` files are loaded by Accelerate with `torch.load(weights_only=True)`.

Atomicity: everything is written into `.checkpoint-<step>.partial/` and renamed into place once
complete, then the `latest` pointer is replaced. A failed save removes its partial folder and leaves
the previous checkpoint as `latest`; a killed one leaves the folder, removed at the next start.

Integrity: `metadata.json` is written last and records each file's size and sha256 (streamed),
and the sha256 of its own contents (`metadata_sha256`, over the canonical JSON of every other key),
so that an edited data position or recipe is caught too. A resume checks them before anything
else, and any damage is one line naming the file and the newest complete checkpoint before it.

A checkpoint also records the engine that wrote it (its files are laid out per engine) and a
fingerprint of the training data (fv_accel/data/fingerprint.py); a resume under another engine, or
on data that changed, is refused in one line (the data: unless allow_recipe_change).

A frozen role (a distillation teacher) is not in a checkpoint: its source and the sha256 of its
weights are (`frozen_roles`); a resume rebuilds it from the recipe and refuses it in one line when
its weights changed (unless allow_recipe_change).
"""

from __future__ import annotations

import errno
import hashlib
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
# 2: per-file sizes and sha256 ("files"), the optimizer settings that ran, the EMA in one file.
# 3: the sha256 of metadata.json's own contents, the engine, the training data's fingerprint.
FORMAT_VERSION = 3
METADATA_CHECKSUM_KEY = "metadata_sha256"
# Accelerate's pickled RNG file (accelerate.utils.RNG_STATE_NAME).
ACCELERATE_RNG_FILE = "random_states_{rank}.pkl"
PACKAGES = ("fv_accel", "torch", "accelerate", "diffusers", "transformers", "peft", "safetensors", "datasets", "numpy")
# Recipe sections that say where to write, what to keep, what to log and where to upload, not what to train:
# a new value there is no recipe change.
RESUME_BOOKKEEPING = ("training.checkpoint.", "training.tracker.", "training.hub.")
# Recipe keys outside the method's math whose change a resume refuses unless allow_recipe_change,
# with the value a checkpoint that predates the key ran with: an optimizer's state is not another's.
REFUSED_RECIPE_KEYS = {"training.optimizer.name": "adamw"}
# metadata.json keys a resume reads, with their types.
REQUIRED_METADATA = {"step": int, "epoch": int, "data": dict, "accelerator_step": int, "config": dict, "math": dict}
REQUIRED_DATA_POSITION = ("epoch", "step_in_epoch")
HASH_CHUNK = 4 << 20


class CheckpointError(ValueError):
    """A checkpoint or output-folder problem; the message names the folder and the key."""


# --------------------------------------------------------------------------------------------
# Finding checkpoints
# --------------------------------------------------------------------------------------------


def checkpoint_step(path: Path) -> Optional[int]:
    m = CHECKPOINT_RE.match(Path(path).name)
    return int(m.group(1)) if m else None


def checkpoint_folders(output_dir: str | Path) -> list[Path]:
    """Every `checkpoint-<step>` folder, complete or not, oldest step first."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = [(checkpoint_step(p), p) for p in out.iterdir() if p.is_dir() and checkpoint_step(p) is not None]
    return [p for _, p in sorted(found)]


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints (a `checkpoint-<step>` folder with its metadata), oldest step first."""
    return [p for p in checkpoint_folders(output_dir) if (p / METADATA_NAME).is_file()]


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


def _latest_target(out: Path) -> Optional[Path]:
    """What `latest` means, skipping nothing: the folder the pointer names, else the newest
    `checkpoint-<step>` folder (complete or not: a damaged one is reported, not passed over)."""
    pointer = out / LATEST_NAME
    folders = checkpoint_folders(out)
    if not pointer.is_file():
        return folders[-1] if folders else None
    name = pointer.read_text(encoding="utf-8").strip()
    named = out / name
    if checkpoint_step(named) is None:
        raise damaged_checkpoint_error(named, f"{pointer} names '{name}', not a checkpoint-<step> folder")
    newer = [p for p in folders if checkpoint_step(p) > checkpoint_step(named) and (p / METADATA_NAME).is_file()]
    if newer:
        # A save published its folder but was stopped before it moved the pointer.
        logger.warning(
            "%s names %s, but %s is newer: its save was interrupted before the pointer moved; "
            "resuming from %s (pass --resume_from_checkpoint %s to take the newer one)",
            pointer, name, newer[-1].name, name, newer[-1],
        )
    return named


def resolve_resume(output_dir: str | Path, resume: str) -> Optional[Path]:
    """`training.checkpoint.resume_from_checkpoint`: "" (fresh), "latest" (None if there is none
    yet, so a preemptible job can always pass it) or a checkpoint folder. The folder's metadata and
    file list are checked here (sizes; the checksums by `verify_resume_checkpoint`)."""
    if not resume:
        return None
    if resume == "latest":
        target = _latest_target(Path(output_dir))
        if target is None:
            return None
        check_checkpoint(target)
        return target
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
    check_checkpoint(path)
    return path


# --------------------------------------------------------------------------------------------
# Integrity: metadata keys, file sizes, sha256
# --------------------------------------------------------------------------------------------


def _metadata_problem(ckpt: Path) -> tuple[Optional[dict], Optional[str]]:
    """(metadata, None) or (None, what is wrong with metadata.json), naming the file."""
    path = ckpt / METADATA_NAME
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None, f"{ckpt}: no {METADATA_NAME}; not a complete fv_accel checkpoint"
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        return None, f"{path}: not valid JSON ({err})"
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME or "step" not in meta:
        return None, f"{path}: not an fv_accel checkpoint (expected format '{FORMAT_NAME}' and a step)"
    for key, kind in REQUIRED_METADATA.items():
        if key not in meta:
            return None, f"{path}: missing key '{key}'"
        if not isinstance(meta[key], kind) or isinstance(meta[key], bool):
            return None, f"{path}: key '{key}' is {meta[key]!r}, expected {'an integer' if kind is int else 'a mapping'}"
    for key in REQUIRED_DATA_POSITION:
        if not isinstance(meta["data"].get(key), int):
            return None, f"{path}: key 'data.{key}' is missing or not an integer"
    named = checkpoint_step(ckpt)
    if named is not None and meta["step"] != named:
        return None, f"{path}: step {meta['step']}, but the folder is {ckpt.name} (step {named})"
    recorded = meta.get(METADATA_CHECKSUM_KEY)
    if recorded is None and int(meta.get("format_version") or 0) >= 3:
        return None, f"{path}: no '{METADATA_CHECKSUM_KEY}' (format {meta['format_version']} records the sha256 of its own contents)"
    if recorded is not None and recorded != metadata_checksum(meta):
        return None, (
            f"{path}: its contents differ from the sha256 recorded in it ('{METADATA_CHECKSUM_KEY}'): the file was "
            "edited after it was saved (its data position, recipe or file list cannot be trusted)"
        )
    return meta, None


def metadata_checksum(meta: dict) -> str:
    """sha256 of the canonical JSON (sorted keys, no spaces) of every key but METADATA_CHECKSUM_KEY,
    as read back from the file (`write_metadata` computes it on that round trip)."""
    body = {k: v for k, v in meta.items() if k != METADATA_CHECKSUM_KEY}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8")).hexdigest()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def file_records(folder: Path) -> dict[str, dict[str, Any]]:
    """Size and sha256 of every file of a checkpoint but its metadata.json, by relative path."""
    records = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if rel != METADATA_NAME:
            records[rel] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    return records


def _files_problem(ckpt: Path, meta: dict, *, hashes: bool) -> Optional[str]:
    """What is wrong with the files metadata.json lists (missing, resized, changed), or None."""
    files = meta.get("files")
    if files is None:
        return None  # saved before checksums were recorded
    for rel, rec in files.items():
        path = ckpt / rel
        if not path.is_file():
            return f"{path}: missing (listed in {METADATA_NAME})"
        size = path.stat().st_size
        if size != rec["bytes"]:
            return f"{path}: {size} bytes, but {METADATA_NAME} records {rec['bytes']} (truncated or overwritten)"
    if hashes:
        for rel, rec in files.items():
            got = sha256_file(ckpt / rel)
            if got != rec["sha256"]:
                return (
                    f"{ckpt / rel}: sha256 {got[:16]}... differs from the {rec['sha256'][:16]}... recorded in "
                    f"{METADATA_NAME} (the file changed after it was saved)"
                )
    return None


def _previous_complete(ckpt: Path) -> Optional[Path]:
    """The newest checkpoint before `ckpt` in its output folder whose metadata and file sizes are whole."""
    step = checkpoint_step(ckpt)
    if step is None:
        return None
    for older in reversed(checkpoint_folders(ckpt.parent)):
        if checkpoint_step(older) < step:
            meta, problem = _metadata_problem(older)
            if problem is None and _files_problem(older, meta, hashes=False) is None:
                return older
    return None


def damaged_checkpoint_error(ckpt: Path, problem: str) -> CheckpointError:
    """One line: what is wrong, and the newest complete checkpoint before this one."""
    previous = _previous_complete(ckpt)
    if previous is not None:
        hint = f"the newest complete checkpoint before it is {previous}: resume with --resume_from_checkpoint {previous}"
    elif checkpoint_step(ckpt) is not None:
        hint = f"there is no complete checkpoint before it in {ckpt.parent}"
    else:
        hint = "resume from another checkpoint"
    return CheckpointError(f"cannot resume from {ckpt}: {problem}; {hint}")


def check_checkpoint(ckpt: Path) -> dict:
    """metadata.json complete, and every file it lists present at its recorded size; returns the metadata."""
    meta, problem = _metadata_problem(ckpt)
    if problem is None:
        problem = _files_problem(ckpt, meta, hashes=False)
    if problem is not None:
        raise damaged_checkpoint_error(ckpt, problem)
    return meta


def read_metadata(ckpt: str | Path) -> dict:
    meta, problem = _metadata_problem(Path(ckpt))
    if problem is not None:
        raise CheckpointError(problem)
    return meta


def first_line(err: BaseException, prefix: str = "") -> str:
    """The first non-empty line of an exception's message after `prefix`, or "" for an empty message
    (an AssertionError without one)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{prefix}{lines[0]}" if lines else ""


def agree_on_error(acc: Any, message: Optional[str]) -> Optional[str]:
    """Every rank gets the first rank's error message (None when all succeeded), so that all of them
    stop together instead of some waiting at the next collective."""
    if acc.num_processes == 1:
        return message
    from accelerate.utils import gather_object

    return next((m for m in gather_object([message]) if m), None)


def verify_resume_checkpoint(acc: Any, ckpt: Path, meta: dict) -> None:
    """The main process hashes every file the checkpoint lists (streamed); all ranks get the verdict."""
    problem = None
    if acc.is_main_process:
        if METADATA_CHECKSUM_KEY not in meta and "files" in meta:
            logger.warning("%s/%s records no checksum of itself (saved by fv_accel before format 3): its data position "
                           "and recipe are not verified", ckpt, METADATA_NAME)
        if "files" not in meta:
            logger.warning("%s records no checksums (saved by fv_accel before format 2): its files are not verified", ckpt)
        else:
            problem = _files_problem(ckpt, meta, hashes=True)
    problem = agree_on_error(acc, problem)
    if problem is not None:
        raise damaged_checkpoint_error(ckpt, problem)


# --------------------------------------------------------------------------------------------
# Resuming under another engine, or from another kind of run (LoRA / full)
# --------------------------------------------------------------------------------------------

# How each engine's checkpoint is laid out by Accelerate's save_state: DDP and one process write the
# same files (model.safetensors, optimizer.bin), FSDP2 torch.distributed.checkpoint shards
# (pytorch_model_fsdp_0/, optimizer_0/), DeepSpeed its own (pytorch_model/).
ENGINE_LAYOUTS = {"one process": "unsharded", "DDP": "unsharded", "FSDP2": "fsdp", "DeepSpeed": "deepspeed"}


def engine_name(acc: Any) -> str:
    """The engine an Accelerator runs, as checkpoints record it: one process, DDP, FSDP2 or
    DeepSpeed (with its ZeRO stage)."""
    kind = getattr(getattr(acc, "distributed_type", None), "value", "NO")
    if kind == "DEEPSPEED":
        plugin = getattr(getattr(acc, "state", None), "deepspeed_plugin", None)
        stage = (getattr(plugin, "deepspeed_config", None) or {}).get("zero_optimization", {}).get("stage")
        return "DeepSpeed" if stage is None else f"DeepSpeed ZeRO-{stage}"
    if kind == "FSDP":
        return "FSDP2"
    return "DDP" if getattr(acc, "num_processes", 1) > 1 else "one process"


def _layout(engine: str) -> str:
    return ENGINE_LAYOUTS.get(engine.split(" ZeRO-")[0], engine)


def saved_engine(meta: dict) -> Optional[str]:
    """The engine that wrote a checkpoint: recorded (format 3), else read from its file list."""
    if meta.get("engine"):
        return str(meta["engine"])
    files = meta.get("files") or {}
    if any(name.startswith("pytorch_model_fsdp_0/") for name in files):
        return "FSDP2"
    if any(name.startswith("pytorch_model/") for name in files):
        return "DeepSpeed"
    return "DDP" if int(meta.get("world_size") or 1) > 1 else "one process"


def _weights_of(engine: str, ckpt: Path) -> str:
    """How to get full weights out of a checkpoint written by `engine`."""
    layout = _layout(engine)
    if layout == "fsdp":
        return f"`accelerate merge-weights {ckpt / 'pytorch_model_fsdp_0'} <folder>` gathers them into one safetensors file"
    if layout == "deepspeed":
        return (
            f"`python -m deepspeed.utils.zero_to_fp32 {ckpt} <folder> --tag pytorch_model --safe_serialization` "
            "gathers them into safetensors files"
        )
    return f"`python -m fv_accel.export {ckpt} --to diffusers` writes them as a transformer folder for models.student.init_from"


def check_resume_engine(acc: Any, cfg: Any, ckpt: Path, meta: dict) -> None:
    """A checkpoint resumes only under an engine that stores it the same way (one process and DDP
    share a layout) and in the same kind of run (LoRA or full): anything else is one line naming
    both and whether the state can be converted (it cannot; the weights can be taken to a new run)."""
    saved, now = saved_engine(meta), engine_name(acc)
    if _layout(saved) != _layout(now):
        raise CheckpointError(
            f"{ckpt}: checkpoint written by {saved}, this launch is {now}: it cannot be converted (each engine stores the "
            f"model and optimizer state in its own layout); resume it under {saved} (the launch configuration that wrote "
            f"it), or start a new run from its weights with a fresh optimizer: {_weights_of(saved, ckpt)}"
        )
    lora_then = bool(saved_recipe(meta).get("models.student.lora.enable", False))
    lora_now = bool(cfg.models.student.lora.enable)
    if lora_then and not lora_now:
        raise CheckpointError(
            f"{ckpt}: checkpoint written by a LoRA run (models.student.lora.enable: true), this launch trains the full "
            "model: the checkpoint holds the adapter and its optimizer state only, which a full fine-tune cannot resume; "
            f"resume it with models.student.lora.enable: true, or start a full fine-tune from the merged weights: "
            f"`python -m fv_accel.export {ckpt} --to merged`, then models.student.init_from that folder"
        )
    if lora_now and not lora_then:
        raise CheckpointError(
            f"{ckpt}: checkpoint written by a full fine-tune, this launch trains a LoRA adapter "
            "(models.student.lora.enable: true): there is no adapter in it to resume; resume it with "
            f"models.student.lora.enable: false, or start a LoRA run on its weights: {_weights_of(saved, ckpt)}"
        )


# --------------------------------------------------------------------------------------------
# Resuming on changed data
# --------------------------------------------------------------------------------------------


def check_resume_data(meta: dict, dataset: Any, cfg: Any, ckpt: str | Path) -> list[dict]:
    """Compare the training data with the fingerprint the checkpoint holds (rows, shard sizes and
    footers, the hash of fv_dataset.json; fv_accel/data/fingerprint.py). Changed data is refused
    unless `training.checkpoint.allow_recipe_change`, then warned; returns the change to record."""
    from fv_accel.data.fingerprint import dataset_fingerprint, describe_fingerprint_change, summarize_fingerprint

    saved = meta.get("data_fingerprint")
    if saved is None:
        return []  # saved before checkpoints recorded one
    now = dataset_fingerprint(dataset)
    what = describe_fingerprint_change(saved, now)
    if what is None:
        return []
    if not cfg.training.checkpoint.allow_recipe_change:
        raise CheckpointError(
            f"cannot resume from {ckpt}: the training data changed since it was saved ({what}); resume on the data it "
            "was trained on, or set training.checkpoint.allow_recipe_change: true to train on with this data"
        )
    logger.warning(
        "resuming from %s on changed training data (%s): it is used from step %d; the data position (epoch %s, step %s "
        "in it) is kept and may point at other samples", ckpt, what, int(meta["step"]) + 1,
        meta["data"].get("epoch"), meta["data"].get("step_in_epoch"),
    )
    return [{"key": "training.data (fingerprint)", "old": summarize_fingerprint(saved), "new": summarize_fingerprint(now)}]


# --------------------------------------------------------------------------------------------
# Resuming with a changed recipe
# --------------------------------------------------------------------------------------------


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict) and tree:
        flat: dict[str, Any] = {}
        for key, value in tree.items():
            flat.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    return {prefix: tree}


def saved_recipe(meta: dict) -> dict:
    """The recipe a checkpoint's metadata holds, flattened to dotted keys."""
    return _flatten(meta.get("config") or {})


def recipe_changes(meta: dict, method: Any, cfg: Any) -> tuple[list[str], list[dict]]:
    """(changes to the method's math, every change) between the checkpoint's recipe and this one.
    Each change is `{"key", "old", "new"}`; values go through JSON so tuples and lists, ints and
    floats compare as they were stored."""
    old_math = meta.get("math") or {}
    new_math = json.loads(json.dumps(method.math_signature(), default=str))
    old_cfg = saved_recipe(meta)
    new_cfg = _flatten(json.loads(json.dumps(cfg.to_dict(), default=str)))
    math_lines, changes = [], []
    for key, before in REFUSED_RECIPE_KEYS.items():
        old, new = old_cfg.get(key, before), new_cfg.get(key)
        if old != new:
            math_lines.append(f"{key}: {old!r} in the checkpoint, {new!r} now")
    for key in sorted(set(old_math) | set(new_math)):
        old, new = old_math.get(key), new_math.get(key)
        if old != new:
            changes.append({"key": key, "old": old, "new": new})
            if key.startswith(("method.", "models.")):
                math_lines.append(f"{key}: {old!r} in the checkpoint, {new!r} now")
    for key in sorted(set(old_cfg) | set(new_cfg)):
        if key in new_math or key in old_math or key.startswith(RESUME_BOOKKEEPING):
            continue
        old, new = old_cfg.get(key), new_cfg.get(key)
        if old != new:
            changes.append({"key": key, "old": old, "new": new})
    return math_lines, changes


def check_resume_compatible(meta: dict, method: Any, cfg: Any, ckpt: str | Path) -> list[dict]:
    """Compare the checkpoint's recipe with the current one. A change to the method's math
    (method name, chunk size, shift, timestep range) or to the optimizer (`training.optimizer.name`)
    is refused unless `training.checkpoint.allow_recipe_change`; a new optimizer then starts with
    fresh state. Every other change takes effect from the next step: the loop, loader and callbacks
    are built from this recipe, and `apply_optimizer_recipe` puts its learning rate, schedule and
    optimizer settings into the restored optimizer and LR scheduler. A new `max_train_steps` (a finished
    run extended) is logged with what it does to the LR schedule (`fv_accel.optim.schedule_length_change`).
    Returns the changes (`{"key", "old", "new"}`), which the next checkpoints record."""
    math_lines, changes = recipe_changes(meta, method, cfg)
    if math_lines and not cfg.training.checkpoint.allow_recipe_change:
        raise CheckpointError(
            f"cannot resume from {ckpt}: the recipe changes the training math ({'; '.join(math_lines)}); "
            f"resume with the checkpoint's values, or set training.checkpoint.allow_recipe_change: true"
        )
    for change in changes:
        logger.warning(
            "resuming from %s with a changed recipe: %s: %r in the checkpoint, %r now; it takes effect from step %d",
            ckpt, change["key"], change["old"], change["new"], int(meta["step"]) + 1,
        )
        if change["key"] == "training.loop.max_train_steps" and isinstance(change["old"], int):
            from fv_accel.optim import schedule_length_change

            logger.warning("training.loop.max_train_steps %s -> %s: %s", change["old"], change["new"],
                           schedule_length_change(cfg, change["old"], int(meta["step"])))
    return changes


def resumed_trainer_state(meta: dict, changes: list[dict]) -> dict:
    """The trainer's counters from the checkpoint, with this resume's recipe changes appended to
    the run's record of them (`recipe_changes`: step, key, old and new value)."""
    state = dict(meta.get("trainer") or {})
    step = int(meta["step"])
    state["recipe_changes"] = list(state.get("recipe_changes") or []) + [{"step": step, **c} for c in changes]
    return state


def _inner_scheduler(lr_scheduler: Any) -> Any:
    # Accelerate's AcceleratedScheduler (and its DeepSpeed wrapper) keep the torch scheduler here.
    return getattr(lr_scheduler, "scheduler", lr_scheduler)


def recipe_optimizers(method: Any) -> dict[str, tuple[list[dict], list[float]]]:
    """Each trained role's optimizer as this recipe built it, read before a checkpoint's state
    replaces it: its param groups' settings (`fv_accel.optim.settings_of`) and its LR schedule's
    base learning rates (the student's `training.optimizer`; a DMD2 critic's `method.fake_score_*`)."""
    from fv_accel.optim import settings_of

    schedulers = method.lr_scheduler_dict
    return {
        role: (settings_of(optimizer), list(_inner_scheduler(schedulers[role]).base_lrs))
        for role, optimizer in method.optimizer_dict.items()
    }


def apply_optimizer_recipe(optimizer: Any, lr_scheduler: Any, settings: list[dict], base_lrs: list[float]) -> None:
    """Make a restored optimizer and LR schedule follow this recipe: the saved state brings back
    the moments and the step count, and with them the old learning rate (the scheduler's
    `base_lrs`, the param groups' `initial_lr` and `lr`) and optimizer settings. `settings` and
    `base_lrs` are those of the optimizer this recipe built (`recipe_optimizers`): they go back in,
    while running state kept in the groups (Prodigy's step-size estimate) stays as restored. The
    schedule's shape (warm-up, length, cycles) already comes from this recipe: diffusers builds it
    as a function, which no state dict holds. With an unchanged recipe this rewrites the same values."""
    groups = optimizer.param_groups
    for group, own, base in zip(groups, settings, base_lrs):
        group.update(own)
        group["initial_lr"] = base
    sched = _inner_scheduler(lr_scheduler)
    lambdas = getattr(sched, "lr_lambdas", None)
    if lambdas is None:
        raise CheckpointError(
            f"cannot apply training.optimizer to the resumed LR scheduler {type(sched).__name__} "
            "(expected diffusers' LambdaLR)"
        )
    sched.base_lrs = list(base_lrs)
    lrs = [base * fn(sched.last_epoch) for base, fn in zip(sched.base_lrs, lambdas)]
    for group, lr in zip(groups, lrs):
        group["lr"] = lr
    sched._last_lr = list(lrs)


def optimizer_record(optimizer: Any, lr_scheduler: Any) -> dict:
    """The learning rate and the optimizer's settings and group state in effect, read from the
    optimizer and scheduler."""

    def num(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return float(v)
        if isinstance(v, (tuple, list)):
            return [num(x) for x in v]
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v

    sched = _inner_scheduler(lr_scheduler)
    return {
        "optimizer": type(getattr(optimizer, "optimizer", optimizer)).__name__,
        "base_lrs": [num(v) for v in getattr(sched, "base_lrs", [])],
        "scheduler_steps": getattr(sched, "last_epoch", None),
        "param_groups": [{k: num(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
    }


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
        "engine": engine_name(acc),
        "data_fingerprint": _data_fingerprint(trainer),
        "math": trainer.method.math_signature(),
        "config": trainer.config.to_dict(),
        "optimizer": optimizer_record(trainer.method.optimizer, trainer.method.lr_scheduler),
        "frozen_roles": frozen_records(trainer.method),
        "versions": package_versions(),
    }


def frozen_records(method: Any) -> dict[str, dict]:
    """Role name -> {"source", "sha256"} of each frozen role (the teacher): what a checkpoint keeps
    of it instead of its weights (recorded at build by fv_accel.build.shard_frozen_roles)."""
    return {name: dict(role.frozen_record) for name, role in method.role_models.items() if getattr(role, "frozen_record", None)}


def _data_fingerprint(trainer: Any) -> Optional[list]:
    from fv_accel.data.fingerprint import dataset_fingerprint

    dataset = getattr(trainer.dataloader, "dataset", None)
    return dataset_fingerprint(dataset) if dataset is not None else None


def write_metadata(path: Path, meta: dict) -> None:
    stored = json.loads(json.dumps(meta, default=str))  # what a reader gets back (tuples as lists, paths as text)
    stored[METADATA_CHECKSUM_KEY] = metadata_checksum(stored)
    path.write_text(json.dumps(stored, indent=2) + "\n", encoding="utf-8")


def fsync_tree(folder: Path) -> None:
    # The rename is the commit: make sure the bytes it publishes are on disk first.
    for root, _dirs, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fsync_dir(folder)


def fsync_dir(folder: Path) -> None:
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
    fsync_dir(final.parent)


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


def remove_stale_partials(out: Path) -> list[Path]:
    """Remove what a killed save left (`.checkpoint-<step>.partial/`, `.checkpoint-<step>.old/`,
    `.latest.tmp`). Only the holder of the output folder's lock may call this: another run's save
    in progress looks the same."""
    stale = sorted([*out.glob(".checkpoint-*.partial"), *out.glob(".checkpoint-*.old"), *out.glob(f".{LATEST_NAME}.tmp")])
    for path in stale:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return stale


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def estimate_checkpoint_bytes(trainer: Any, out: Path) -> tuple[int, str]:
    """(bytes, what the estimate is based on) of the next checkpoint: the size of the latest one,
    else the trainable weights, the optimizer's state and the callbacks' state (EMA)."""
    from fv_accel.optim import optimizer_state_bytes

    previous = latest_checkpoint(out)
    if previous is not None:
        return folder_bytes(previous), f"the size of {previous.name}"
    params = trainer.method.student.trainable_parameters()
    weights = sum(p.numel() * p.element_size() for p in params)
    opt = trainer.config.training.optimizer
    state = optimizer_state_bytes(opt.name, [tuple(p.shape) for p in params], params[0].dtype, beta1=opt.betas[0])
    return weights + state + trainer.callback_checkpoint_bytes(), "the trainable weights, the optimizer's state and the EMA"


def _names_full_disk(err: BaseException) -> bool:
    seen = set()
    current: Optional[BaseException] = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(current) or "Disk quota exceeded" in str(current):
            return True
        current = current.__cause__ or current.__context__
    return False


def out_of_space_error(err: BaseException, folder: Path, needed: int, basis: str, what: str) -> Optional[CheckpointError]:
    """A one-line error naming the folder and the space needed when `err` (a failed write of `what`)
    was the disk filling up: the error says so (ENOSPC, a quota), or less than `needed` is free.
    torch's own writer reports a full disk only as `[enforce fail at inline_container.cc] unexpected pos`."""
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return None
    if not _names_full_disk(err) and free >= needed:
        return None
    if free < needed:
        space = f"{format_bytes(free)} free, about {format_bytes(needed)} needed ({basis})"
    else:  # the disk filled up although the estimate fitted
        space = f"{format_bytes(free)} free, more than that needed (estimated at {format_bytes(needed)}: {basis})"
    return CheckpointError(
        f"not enough disk space to write {what} in {folder}: {space}; free some space or move "
        f"training.checkpoint.output_dir ({type(err).__name__}{first_line(err, ': ')})"
    )


def save_checkpoint(trainer: Any, step: int) -> Path:
    """Write `checkpoint-<step>` (every rank takes part). A failure on any rank removes the partial
    folder and raises on every rank; the previous checkpoint stays `latest`."""
    acc = trainer.accelerator
    ck = trainer.config.training.checkpoint
    out = Path(ck.output_dir)
    final = out / f"checkpoint-{step}"
    tmp = out / f".checkpoint-{step}.partial"
    needed, basis = estimate_checkpoint_bytes(trainer, out)
    previous = latest_checkpoint(out)
    kept = f"{previous.name} stays the latest checkpoint" if previous is not None else "no checkpoint was written"
    problem = None
    if acc.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        remove_stale_partials(out)
        free = shutil.disk_usage(out).free
        if free < needed:
            problem = (
                f"not enough disk space to write {final.name} in {out}: {format_bytes(free)} free, about "
                f"{format_bytes(needed)} needed ({basis}); free some space or move training.checkpoint.output_dir; {kept}"
            )
    problem = agree_on_error(acc, problem)
    if problem is not None:
        raise CheckpointError(problem)

    failure: Optional[BaseException] = None
    problem = None
    try:
        acc.save_state(str(tmp), safe_serialization=True)
        (tmp / ACCELERATE_RNG_FILE.format(rank=acc.process_index)).unlink(missing_ok=True)
        write_rank_state(trainer, rank_state_file(tmp, acc.process_index))
        trainer.write_checkpoint_files(tmp)
    except Exception as err:  # noqa: BLE001 - reported below, on every rank
        failure, problem = err, f"rank {acc.process_index} could not write {tmp}: {type(err).__name__}: {err}"
    problem = agree_on_error(acc, problem)
    if problem is None and acc.is_main_process:
        try:
            meta = build_metadata(trainer, step)
            meta["files"] = file_records(tmp)  # after every other file, before the rename
            write_metadata(tmp / METADATA_NAME, meta)
            fsync_tree(tmp)
            _publish(tmp, final)
            _point_latest(out, final)
        except Exception as err:  # noqa: BLE001
            failure, problem = err, f"could not finish {tmp}: {type(err).__name__}: {err}"
    problem = agree_on_error(acc, problem)
    if problem is not None:
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        if failure is None:
            raise CheckpointError(f"{final.name} was not written: {problem}; {kept}")
        space = out_of_space_error(failure, out, needed, basis, final.name)
        if space is not None:
            raise CheckpointError(f"{space}; {kept}") from failure
        raise failure
    if acc.is_main_process:
        _prune(out, ck.checkpoints_total_limit, step)
        logger.info("saved checkpoint %s", final)
    acc.wait_for_everyone()
    return final


# --------------------------------------------------------------------------------------------
# Load
# --------------------------------------------------------------------------------------------


def frozen_roles_problem(meta: dict, method: Any, cfg: Any, ckpt: Path) -> Optional[str]:
    """A checkpoint holds no frozen role's weights: the resume rebuilt each from its source, and
    its weights must be the ones the run trained against (the sha256 the checkpoint records).
    A changed one is the problem returned (None with allow_recipe_change: then a warning); a
    checkpoint saved before the record resumes with a warning that the roles are not verified."""
    now = frozen_records(method)
    saved = meta.get("frozen_roles")
    if saved is None:
        if now:
            logger.warning(
                "%s records no checksum of %s (saved by an older fv_accel): rebuilt from the recipe's source, not "
                "verified; any copy of its weights in the checkpoint is not read", ckpt, ", ".join(f"models.{n}" for n in now)
            )
        return None
    for name, record in now.items():
        then = saved.get(name)
        if then is None or then.get("sha256") == record["sha256"]:
            continue
        change = (
            f"models.{name} changed since it was saved: {record['source']} has sha256 {record['sha256'][:16]}... now, "
            f"the run trained against {then.get('source')} with sha256 {str(then.get('sha256'))[:16]}..."
        )
        if not cfg.training.checkpoint.allow_recipe_change:
            return (
                f"cannot resume from {ckpt}: {change}; give models.{name} those weights again, or set "
                "training.checkpoint.allow_recipe_change: true to train on against these"
            )
        logger.warning("resuming from %s: %s; training goes on against the new weights", ckpt, change)
    return None


def load_checkpoint(trainer: Any, ckpt: Path) -> int:
    """Restore model, optimizer, LR schedule, RNG states, callbacks' state and data position, and
    put this recipe's optimizer settings into effect. Returns the step to continue from; the
    trainer's counters are in `read_metadata(ckpt)["trainer"]`."""
    acc = trainer.accelerator
    ckpt = Path(ckpt)
    meta = read_metadata(ckpt)
    problem = frozen_roles_problem(meta, trainer.method, trainer.config, ckpt) if acc.is_main_process else None
    problem = agree_on_error(acc, problem)
    if problem is not None:
        raise CheckpointError(problem)
    stray = sorted(p.name for p in ckpt.glob("*.pkl"))
    if stray:
        # Not written by us; Accelerate still loads them only with weights_only=True.
        logger.warning("%s holds pickle file(s) %s; they are loaded with weights_only=True only", ckpt, stray)
    recipe = recipe_optimizers(trainer.method)
    saved_name = saved_recipe(meta).get("training.optimizer.name", REFUSED_RECIPE_KEYS["training.optimizer.name"])
    new_optimizer = saved_name != trainer.config.training.optimizer.name
    optimizers = acc._optimizers
    if new_optimizer:
        # Allowed by training.checkpoint.allow_recipe_change: the saved state belongs to another optimizer.
        logger.warning(
            "resuming from %s with training.optimizer.name %s (the checkpoint ran %s): the optimizer starts with fresh state",
            ckpt, trainer.config.training.optimizer.name, saved_name,
        )
        acc._optimizers = []
    try:
        acc.load_state(str(ckpt), load_kwargs={"weights_only": True})
    except Exception as err:  # noqa: BLE001 - one line naming the checkpoint
        raise damaged_checkpoint_error(ckpt, f"{type(err).__name__} while loading{first_line(err, ': ')}") from err
    finally:
        acc._optimizers = optimizers
    step = int(meta["step"])
    schedulers = trainer.method.lr_scheduler_dict
    for role, expected in trainer.method.lr_scheduler_steps(step).items():
        taken = getattr(_inner_scheduler(schedulers[role]), "last_epoch", expected)
        if taken != expected:
            which = "its LR scheduler" if len(schedulers) == 1 else f"the {role}'s LR scheduler"
            expecting = "" if len(schedulers) == 1 else f" (expected {expected})"
            raise damaged_checkpoint_error(
                ckpt, f"{ckpt / METADATA_NAME} says step {step}, but {which} state has taken {taken} steps{expecting}"
            )
    for role, (settings, base_lrs) in recipe.items():
        apply_optimizer_recipe(trainer.method.optimizer_dict[role], schedulers[role], settings, base_lrs)
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
    trainer.read_checkpoint_files(ckpt)
    trainer.dataloader.load_state_dict(meta["data"])
    return step
