"""The output folder belongs to one run at a time, and a finished run's outputs are kept.

- A lock file, `<output_dir>/.fv_accel.lock`, held by the main process of the running run: its
  pid, host name and process start time (and SLURM job id and restart count when set). Created
  with O_EXCL, so of two runs started at once on one folder exactly one gets it. A lock whose
  process is gone (same host: no such pid, or a pid reused by a process started at another time;
  same SLURM job: an earlier incarnation of it) is stale and taken over with a warning. A lock of
  a live process, or of another host that cannot be checked, is refused with its holder named.
- A fresh run (not resuming this folder's own checkpoint) refuses a folder that holds another
  run's outputs (checkpoints, final weights, logs, samples, plots) unless
  `training.checkpoint.overwrite_output_dir: true`, which deletes those outputs first; the logs of
  an attempt that took no step (it logged no metric) are no run's outputs. Other files in the
  folder (and `exports/`) are never touched. `--resume_from_checkpoint latest` also takes
  over the logs of an attempt that stopped before its first checkpoint (and left no final weights).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any, Optional

from fv_accel.checkpoint import (
    LATEST_NAME,
    CheckpointError,
    agree_on_error,
    checkpoint_folders,
    remove_stale_partials,
)

logger = logging.getLogger(__name__)

LOCK_NAME = ".fv_accel.lock"
# What a run writes into its output folder, besides checkpoint-<step>/ folders.
RUN_OUTPUT_DIRS = ("transformer", "ema", "logs", "samples", "plots")


def _final_weight_files() -> tuple[str, ...]:
    """A LoRA run's final files."""
    from fv_accel.models.lora import BASE_MODEL_FILE, COMFYUI_LORA_FILE, DIFFUSERS_LORA_FILE

    return (DIFFUSERS_LORA_FILE, COMFYUI_LORA_FILE, BASE_MODEL_FILE)


def _run_output_files() -> tuple[str, ...]:
    from fv_accel.hub import CARD_NAME

    return (*_final_weight_files(), LATEST_NAME, CARD_NAME)  # CARD_NAME: the model card, README.md


def run_outputs(output_dir: str | Path) -> list[Path]:
    """The outputs of a run found in `output_dir`: checkpoints first, then weights, logs, ..."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = list(checkpoint_folders(out))
    found += [out / name for name in RUN_OUTPUT_DIRS if (out / name).is_dir()]
    found += [out / name for name in _run_output_files() if (out / name).is_file()]
    return found


def _describe(out: Path, paths: list[Path]) -> str:
    names = [p.name + ("/" if p.is_dir() else "") for p in paths]
    if (out / "logs" / "metrics.jsonl").is_file():
        names = [("logs/metrics.jsonl" if n == "logs/" else n) for n in names]
    return ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")


def _finished_outputs(out: Path) -> list[Path]:
    """What only a run that reached its end (or its end-of-run summary) leaves."""
    names = [out / "transformer", out / "ema", out / "logs" / "summary.json", *(out / n for n in _final_weight_files())]
    return [p for p in names if p.exists()]


def never_stepped(out: Path, found: list[Path]) -> bool:
    """Whether the run outputs `found` in `out` are only the tracker logs of an attempt that ended
    before its first step (it logged no metric: a bad input found at the first step), which a
    corrected rerun may write into."""
    metrics = out / "logs" / "metrics.jsonl"
    return found == [out / "logs"] and not (metrics.is_file() and metrics.stat().st_size > 0)


def check_output_dir(
    output_dir: str | Path, resume: Optional[Path], *, overwrite: bool, latest: bool = False, warn: bool = True
) -> None:
    """A run writes into `output_dir` only if it continues that folder's own run (resumes one of
    its checkpoints), the folder holds no run outputs, or `overwrite` is set. `latest` (asked to
    resume the latest checkpoint, and there is none) also continues an attempt that stopped before
    its first checkpoint, as long as it left no final weights or summary: it starts over from step 0."""
    out = Path(output_dir)
    held = lock_holder_problem(out)
    if held is not None:
        raise CheckpointError(held)
    if resume is not None and Path(resume).resolve().parent == out.resolve():
        return
    found = run_outputs(out)
    if not found or overwrite:
        return
    if never_stepped(out, found):
        if warn:
            logger.info("%s holds only the logs of an attempt that took no step: this run writes into it", out)
        return
    if latest and resume is None and not _finished_outputs(out):
        if warn:
            logger.warning(
                "%s holds no checkpoint to resume, only the logs of an attempt that stopped before its first "
                "one (%s): starting over from step 0, its logs are continued", out, _describe(out, found),
            )
        return
    replace = "or set training.checkpoint.overwrite_output_dir: true to replace them"
    checkpoints = [p for p in found if p in checkpoint_folders(out)]
    if checkpoints:
        names = ", ".join(p.name for p in checkpoints[-3:])
        raise CheckpointError(
            f"training.checkpoint.output_dir: '{output_dir}' already holds checkpoints of another run "
            f"({names}); resume it with --resume_from_checkpoint latest, or choose a new output_dir, {replace}"
        )
    raise CheckpointError(
        f"training.checkpoint.output_dir: '{output_dir}' already holds the outputs of another run "
        f"({_describe(out, found)}) and no checkpoint to resume; choose a new output_dir, {replace}"
    )


def clear_run_outputs(output_dir: str | Path) -> list[Path]:
    """Delete the outputs `run_outputs` finds (for `overwrite_output_dir`); returns them."""
    found = run_outputs(output_dir)
    for path in found:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    return found


# --------------------------------------------------------------------------------------------
# The lock
# --------------------------------------------------------------------------------------------


def _process_start_time(pid: int) -> Optional[float]:
    """The start time of a running process; None if there is no such process (or only a zombie).
    A process this user may not inspect raises psutil.AccessDenied: it runs."""
    import psutil

    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc.create_time()
    except psutil.NoSuchProcess:
        return None


def _this_process() -> dict[str, Any]:
    me = {
        "pid": os.getpid(),
        "hostname": socket.gethostname(),
        "start_time": _process_start_time(os.getpid()),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }
    for key in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT"):
        if os.environ.get(key):
            me[key.lower()] = os.environ[key]
    return me


def _same_process(a: dict, b: dict) -> bool:
    return (
        a.get("hostname") == b.get("hostname")
        and a.get("pid") == b.get("pid")
        and a.get("start_time") is not None
        and b.get("start_time") is not None
        and abs(float(a["start_time"]) - float(b["start_time"])) < 0.01
    )


def process_record() -> dict[str, Any]:
    """This process as a lock records it (pid, host, start time; SLURM job and restart count)."""
    return _this_process()


def process_ended(record: dict) -> Optional[str]:
    """Why the process a lock-style record names has certainly ended, or None if it may still run."""
    if not record:
        return "the record is unreadable"
    me = _this_process()
    return None if _same_process(record, me) else _holder_gone(record, me)


def _holder_gone(holder: dict, me: dict) -> Optional[str]:
    """Why the lock's holder has certainly ended, or None if it may still run."""
    if holder.get("hostname") == me["hostname"]:
        pid = holder.get("pid")
        if not isinstance(pid, int):
            return "its pid is unreadable"
        import psutil

        try:
            start = _process_start_time(pid)
        except psutil.AccessDenied:
            return None
        if start is None:
            return f"no process {pid} runs on {me['hostname']}"
        if holder.get("start_time") is None or abs(start - float(holder["start_time"])) >= 0.01:
            return f"pid {pid} now belongs to a process started at another time"
        return None
    job = holder.get("slurm_job_id")
    if job and job == me.get("slurm_job_id") and holder.get("slurm_restart_count") != me.get("slurm_restart_count"):
        return f"it was SLURM job {job}'s earlier run (restart {holder.get('slurm_restart_count') or 0})"
    return None


def _read_holder(path: Path) -> Optional[dict]:
    try:
        holder = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        holder = {}
    return holder if isinstance(holder, dict) else {}


class OutputLock:
    """The output folder's lock as the main process holds it (`release` is safe to call twice)."""

    def __init__(self, path: Optional[Path], owner: Optional[dict], created_dir: Optional[Path] = None):
        self.path = path
        self.owner = owner
        self.created_dir = created_dir

    @classmethod
    def none(cls) -> "OutputLock":
        """What the other processes hold: nothing."""
        return cls(None, None)

    @classmethod
    def acquire(cls, output_dir: str | Path) -> "OutputLock":
        out = Path(output_dir)
        created = None
        if not out.exists():
            created = out
            while not created.parent.exists():
                created = created.parent
        out.mkdir(parents=True, exist_ok=True)
        path = out / LOCK_NAME
        me = _this_process()
        for _ in range(5):
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = _read_holder(path)
                if holder is None:
                    continue  # released meanwhile
                if _same_process(holder, me):
                    return cls(path, holder, created)  # this process holds it already (another build)
                if not holder and time.time() - path.stat().st_mtime < 10:
                    time.sleep(0.2)  # being written by the process that just created it
                    continue
                gone = _holder_gone(holder, me) if holder else "the lock file is unreadable"
                if gone is None:
                    raise CheckpointError(_held_message(out, path, holder, me))
                logger.warning(
                    "removing the stale lock %s of pid %s on %s (started %s): %s",
                    path, holder.get("pid"), holder.get("hostname"), holder.get("started"), gone,
                )
                path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(json.dumps(me) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
            return cls(path, me, created)
        raise CheckpointError(f"training.checkpoint.output_dir: could not take the lock {path} (it keeps changing)")

    def release(self, *, remove_created_dir: bool = False) -> None:
        """Delete the lock file if it is still ours; after a failed build, also the folder the lock
        created if nothing else was written into it."""
        if self.path is not None:
            holder = _read_holder(self.path)
            if holder is not None and self.owner is not None and _same_process(holder, self.owner):
                self.path.unlink(missing_ok=True)
            self.path = None
        if remove_created_dir and self.created_dir is not None:
            _remove_empty_tree(self.created_dir)
        self.created_dir = None


def _remove_empty_tree(top: Path) -> None:
    """Remove `top` and the folders under it, if no file was written anywhere in them."""
    for root, _dirs, _files in os.walk(top, topdown=False):
        if not os.listdir(root):
            os.rmdir(root)


def lock_holder_problem(output_dir: str | Path) -> Optional[str]:
    """Read-only: why `output_dir` cannot be had because another run holds its lock, or None."""
    out = Path(output_dir)
    path = out / LOCK_NAME
    holder = _read_holder(path)
    if not holder:
        return None
    me = _this_process()
    if _same_process(holder, me) or _holder_gone(holder, me) is not None:
        return None
    return _held_message(out, path, holder, me)


def _held_message(out: Path, path: Path, holder: dict, me: dict) -> str:
    who = f"pid {holder.get('pid')} on {holder.get('hostname')}, started {holder.get('started')}"
    if holder.get("hostname") == me["hostname"]:
        return (
            f"training.checkpoint.output_dir: '{out}' is in use by another run ({who}; lock {path}); "
            f"wait for it to end, or choose another output_dir"
        )
    return (
        f"training.checkpoint.output_dir: '{out}' is locked by a run on another host ({who}; lock {path}), "
        f"which cannot be checked from {me['hostname']}; if that run has ended, delete {path}"
    )


def claim_output_dir(acc: Any, cfg: Any, resume: Optional[Path]) -> OutputLock:
    """Take the output folder for this run (main process), before anything is written into it: the
    lock, then under it the outputs check again (a run may have finished meanwhile), the deletion
    of another run's outputs if `overwrite_output_dir`, and of what a killed save left. Every rank
    raises the same error if the folder cannot be had."""
    ck = cfg.training.checkpoint
    out = Path(ck.output_dir)
    lock = OutputLock.none()
    problem = None
    if acc.is_main_process:
        try:
            lock = OutputLock.acquire(out)
            try:
                check_output_dir(out, resume, overwrite=ck.overwrite_output_dir, latest=ck.resume_from_checkpoint == "latest")
                if ck.overwrite_output_dir and not (resume is not None and Path(resume).resolve().parent == out.resolve()):
                    removed = clear_run_outputs(out)
                    if removed:
                        logger.warning(
                            "training.checkpoint.overwrite_output_dir: deleted the previous run's outputs in %s (%s)",
                            out, _describe(out, removed),
                        )
                stale = remove_stale_partials(out)
                if stale:
                    logger.warning("removed what an interrupted checkpoint save left in %s: %s", out, ", ".join(p.name for p in stale))
            except BaseException:
                lock.release(remove_created_dir=True)
                raise
        except CheckpointError as err:
            problem = str(err)
    problem = agree_on_error(acc, problem)
    if problem is not None:
        lock.release(remove_created_dir=True)
        raise CheckpointError(problem)
    return lock
