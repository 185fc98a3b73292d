"""Issue 14, outputs and checkpoints: a resume's recipe changes take effect and are recorded; the
output folder is locked and a finished run's outputs are kept; a full disk is named as such;
damaged checkpoints are refused naming the file and the previous good checkpoint; exports land
outside checkpoints; one EMA copy per checkpoint; trackers are finished on every exit path."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import types
from pathlib import Path

import psutil
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from fv_accel.checkpoint import CheckpointError, latest_checkpoint, read_metadata
from fv_accel.cli import main as cli_main
from fv_accel.config import ConfigError, default_recipe, load_config
from fv_accel.output_dir import LOCK_NAME, OutputLock
from fv_accel.trainer import Trainer, TrainerCallback, TrainingStopped
from tests.resume_helpers import build, reset_accelerate, small_overrides, weights, write_latent_dataset

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def latent_data(tmp_path_factory):
    return write_latent_dataset(tmp_path_factory.mktemp("latents"), num_clips=6)


def snapshot(folder: Path) -> list[tuple[str, int, int]]:
    """Every file under `folder` with its size and modification time (what 'nothing written' means)."""
    if not folder.exists():
        return []
    return sorted((str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*") if p.is_file())


class StopAtStep(TrainerCallback):
    """Asks the trainer to stop after `step` as a preemption would (checkpoint, exit 0)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, trainer, step, logs):
        if step == self.step:
            trainer._stop_signal = 15  # SIGTERM, without sending one


def recipe_file(tmp_path: Path, method: str, overrides: dict) -> Path:
    path = tmp_path / f"recipe-{len(list(tmp_path.glob('recipe-*')))}.yaml"
    path.write_text(load_config(default_recipe(method), overrides).to_yaml())
    return path


def metrics_lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]


# ---- 1. resuming with a changed recipe -------------------------------------------------------


class RecordStepLr(TrainerCallback):
    """The learning rate and AdamW settings each optimizer step used (read before the step)."""

    def __init__(self):
        self.used = {}

    def on_train_start(self, trainer):
        optimizer = trainer.method.optimizer
        real = optimizer.step

        def step(*args, **kwargs):
            group = optimizer.param_groups[0]
            self.used[trainer.step + 1] = (group["lr"], group["weight_decay"], tuple(group["betas"]))
            return real(*args, **kwargs)

        optimizer.step = step


def test_resume_with_a_new_learning_rate_trains_at_it_and_records_it(tmp_path, latent_data, caplog):
    out = tmp_path / "out"
    first = small_overrides(out, latent_data, **{"training.loop.max_train_steps": 4, "training.checkpoint.training_state_checkpointing_steps": 2})
    run = build("finetune", first)
    Trainer(run, callbacks=[*run.callbacks, StopAtStep(2)]).run()
    assert read_metadata(out / "checkpoint-2")["optimizer"]["base_lrs"] == [1e-3]
    assert read_metadata(out / "checkpoint-2")["trainer"]["recipe_changes"] == []

    # The command: --resume_from_checkpoint latest --training.optimizer.learning_rate 5e-3.
    resumed = {**first, "training.checkpoint.resume_from_checkpoint": "latest", "training.optimizer.learning_rate": 5e-3,
               "training.checkpoint.training_state_checkpointing_steps": 1}
    with caplog.at_level(logging.WARNING, logger="fv_accel.checkpoint"):
        run = build("finetune", resumed)
    assert (
        f"resuming from {out / 'checkpoint-2'} with a changed recipe: training.optimizer.learning_rate: "
        "0.001 in the checkpoint, 0.005 now; it takes effect from step 3"
    ) in caplog.text
    record = RecordStepLr()
    Trainer(run, callbacks=[*run.callbacks, record]).run()
    # Warm-up over 7 steps: step k uses lr * (k - 1) / 7 and logs lr * k / 7, at the new rate.
    assert {k: v[0] for k, v in record.used.items()} == pytest.approx({3: 5e-3 * 2 / 7, 4: 5e-3 * 3 / 7}, rel=1e-12)
    assert [(m["step"], m["lr"]) for m in metrics_lines(out)] == [
        (1, pytest.approx(1e-3 / 7)), (2, pytest.approx(2e-3 / 7)), (3, pytest.approx(15e-3 / 7)), (4, pytest.approx(20e-3 / 7))
    ]
    # The next checkpoint records what ran: the optimizer's own values and the change.
    meta = read_metadata(out / "checkpoint-3")
    assert meta["optimizer"]["base_lrs"] == [5e-3]
    assert meta["optimizer"]["param_groups"][0]["lr"] == pytest.approx(5e-3 * 3 / 7)
    assert meta["optimizer"]["param_groups"][0]["initial_lr"] == 5e-3
    assert meta["trainer"]["recipe_changes"] == [{"step": 2, "key": "training.optimizer.learning_rate", "old": 0.001, "new": 0.005}]
    optimizer_state = torch.load(out / "checkpoint-3" / "optimizer.bin", weights_only=True)
    assert optimizer_state["param_groups"][0]["lr"] == pytest.approx(5e-3 * 3 / 7)

    # Resuming that checkpoint at 5e-3 is no change; going back to 1e-3 is one, and is applied.
    caplog.clear()
    again = {**resumed, "training.loop.max_train_steps": 5, "training.checkpoint.training_state_checkpointing_steps": 0}
    with caplog.at_level(logging.WARNING, logger="fv_accel.checkpoint"):
        run = build("finetune", {**again, "training.checkpoint.resume_from_checkpoint": str(out / "checkpoint-3")})
    assert "learning_rate" not in caplog.text
    assert run.method.optimizer.param_groups[0]["lr"] == pytest.approx(5e-3 * 3 / 7)
    assert run.trainer_state["recipe_changes"][0]["new"] == 0.005
    run = build("finetune", {**again, "training.checkpoint.resume_from_checkpoint": str(out / "checkpoint-3"),
                             "training.optimizer.learning_rate": 1e-3})
    assert run.method.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * 3 / 7)
    assert [(c["step"], c["key"], c["new"]) for c in run.trainer_state["recipe_changes"]] == [
        (2, "training.optimizer.learning_rate", 0.005), (3, "training.loop.max_train_steps", 5), (3, "training.optimizer.learning_rate", 0.001)
    ]


def test_resume_with_a_new_warmup_and_adamw_settings_takes_effect(tmp_path, latent_data, caplog):
    out = tmp_path / "out"
    first = small_overrides(out, latent_data, **{"training.loop.max_train_steps": 4, "training.checkpoint.training_state_checkpointing_steps": 2})
    run = build("finetune", first)
    Trainer(run, callbacks=[*run.callbacks, StopAtStep(2)]).run()
    changed = {**first, "training.checkpoint.resume_from_checkpoint": "latest", "training.optimizer.lr_warmup_steps": 2,
               "training.optimizer.weight_decay": 0.1, "training.optimizer.betas": [0.8, 0.99],
               "callbacks.grad_clip.max_grad_norm": 0.5}
    with caplog.at_level(logging.WARNING, logger="fv_accel.checkpoint"):
        run = build("finetune", changed)
    for key in ("training.optimizer.lr_warmup_steps: 7 in the checkpoint, 2 now", "training.optimizer.weight_decay: 0.01 in the checkpoint, 0.1 now",
                "training.optimizer.betas: [0.9, 0.999] in the checkpoint, [0.8, 0.99] now",
                "callbacks.grad_clip.max_grad_norm: 1.0 in the checkpoint, 0.5 now"):
        assert key in caplog.text
    record = RecordStepLr()
    trainer = Trainer(run, callbacks=[*run.callbacks, record])
    trainer.run()
    # Warm-up of 2 steps is over at step 3: the full 1e-3; the new AdamW settings are in use.
    assert record.used == {3: (pytest.approx(1e-3), 0.1, (0.8, 0.99)), 4: (pytest.approx(1e-3), 0.1, (0.8, 0.99))}
    assert [c["key"] for c in trainer.recipe_changes] == [
        "callbacks.grad_clip.max_grad_norm", "training.optimizer.betas", "training.optimizer.lr_warmup_steps", "training.optimizer.weight_decay"
    ]


# ---- 2. the output folder: finished outputs kept, one run at a time ------------------------------


def test_a_second_run_into_a_finished_runs_folder_is_refused_unless_overwrite(tmp_path, latent_data, capsys):
    out = tmp_path / "out"
    over = small_overrides(out, latent_data, **{"training.loop.max_train_steps": 2, "training.checkpoint.save_final": True})
    Trainer(build("finetune", over)).run()
    (out / "notes.txt").write_text("mine")
    before = snapshot(out)
    expected = (
        f"training.checkpoint.output_dir: '{out}' already holds the outputs of another run (transformer/, ema/, "
        "logs/metrics.jsonl, plots/, README.md) and no checkpoint to resume; choose a new output_dir, or set "
        "training.checkpoint.overwrite_output_dir: true to replace them"
    )
    for extra in ({}, {"training.checkpoint.resume_from_checkpoint": "latest"}):
        with pytest.raises(CheckpointError) as err:
            build("finetune", {**over, **extra})
        assert str(err.value) == expected
    capsys.readouterr()
    assert cli_main("finetune", ["--config", str(recipe_file(tmp_path, "finetune", over))]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"error: {expected}"]
    assert snapshot(out) == before  # transformer/ kept, metrics.jsonl not appended to

    # With the flag the previous run's outputs go first; files that are not run outputs stay.
    recipe = recipe_file(tmp_path, "finetune", {**over, "training.loop.max_train_steps": 3})
    assert cli_main("finetune", ["--config", str(recipe), "--training.checkpoint.overwrite_output_dir", "true"]) == 0
    assert [m["step"] for m in metrics_lines(out)] == [1, 2, 3]
    assert json.loads((out / "logs" / "summary.json").read_text())["final_step"] == 3
    assert (out / "notes.txt").read_text() == "mine" and not (out / LOCK_NAME).exists()


def test_latest_continues_an_attempt_that_stopped_before_its_first_checkpoint(tmp_path, latent_data, caplog):
    """A preemptible job passes --resume_from_checkpoint latest every time: an attempt killed before
    its first checkpoint left only logs; its next attempt starts over. A fresh run is still refused."""
    out = tmp_path / "out"
    (out / "logs").mkdir(parents=True)
    (out / "logs" / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    over = small_overrides(out, latent_data, **{"training.loop.max_train_steps": 2})
    with pytest.raises(CheckpointError, match=r"already holds the outputs of another run \(logs/metrics.jsonl\) and no checkpoint"):
        build("finetune", over)
    with caplog.at_level(logging.WARNING, logger="fv_accel.output_dir"):
        run = build("finetune", {**over, "training.checkpoint.resume_from_checkpoint": "latest"})
    assert f"{out} holds no checkpoint to resume, only the logs of an attempt that stopped before its first one" in caplog.text
    assert run.start_step == 0
    Trainer(run).run()
    assert [m["step"] for m in metrics_lines(out)] == [1, 1, 2]


def _lock_payload(pid: int, **extra) -> dict:
    return {"pid": pid, "hostname": socket.gethostname(), "start_time": psutil.Process(pid).create_time(),
            "started": "2025-01-01 10:00:00 +0000", **extra}


def test_a_folder_locked_by_a_live_run_is_refused_and_a_dead_runs_lock_is_taken_over(tmp_path, latent_data, caplog):
    out = tmp_path / "out"
    out.mkdir()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (out / LOCK_NAME).write_text(json.dumps(_lock_payload(other.pid)))
        before = snapshot(out)
        over = small_overrides(out, latent_data, **{"training.loop.max_train_steps": 2})
        with pytest.raises(CheckpointError) as err:
            build("finetune", over)
        assert str(err.value) == (
            f"training.checkpoint.output_dir: '{out}' is in use by another run (pid {other.pid} on {socket.gethostname()}, "
            f"started 2025-01-01 10:00:00 +0000; lock {out / LOCK_NAME}); wait for it to end, or choose another output_dir"
        )
        assert snapshot(out) == before
    finally:
        other.kill()
        other.wait()
    # The same lock once its process has ended: stale, taken over, and released when the run ends.
    with caplog.at_level(logging.WARNING, logger="fv_accel.output_dir"):
        run = build("finetune", over)
    assert f"removing the stale lock {out / LOCK_NAME} of pid {other.pid}" in caplog.text
    assert f"no process {other.pid} runs on {socket.gethostname()}" in caplog.text
    held = json.loads((out / LOCK_NAME).read_text())
    assert (held["pid"], held["hostname"]) == (os.getpid(), socket.gethostname())
    Trainer(run).run()
    assert not (out / LOCK_NAME).exists()


def test_lock_holders_that_cannot_be_checked_or_are_certainly_gone(tmp_path, monkeypatch, caplog):
    lock = tmp_path / LOCK_NAME
    # A pid reused by a process started at another time (here: this one) is a stale lock.
    lock.write_text(json.dumps({**_lock_payload(os.getpid()), "start_time": 1000.0}))
    with caplog.at_level(logging.WARNING, logger="fv_accel.output_dir"):
        OutputLock.acquire(tmp_path).release()
    assert f"pid {os.getpid()} now belongs to a process started at another time" in caplog.text
    assert not lock.exists()
    # Another host: refused, with what to do.
    lock.write_text(json.dumps({**_lock_payload(os.getpid()), "hostname": "node-7", "slurm_job_id": "77", "slurm_restart_count": "0"}))
    with pytest.raises(CheckpointError) as err:
        OutputLock.acquire(tmp_path)
    assert str(err.value) == (
        f"training.checkpoint.output_dir: '{tmp_path}' is locked by a run on another host (pid {os.getpid()} on node-7, "
        f"started 2025-01-01 10:00:00 +0000; lock {lock}), which cannot be checked from {socket.gethostname()}; "
        f"if that run has ended, delete {lock}"
    )
    # A requeued SLURM job (same job id, next restart) takes over its earlier incarnation's lock.
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fv_accel.output_dir"):
        taken = OutputLock.acquire(tmp_path)
    assert "it was SLURM job 77's earlier run (restart 0)" in caplog.text
    assert json.loads(lock.read_text())["slurm_restart_count"] == "1"
    taken.release()
    assert not lock.exists()


# ---- 4. a full disk ----------------------------------------------------------------------------


def _enospc_on_call(monkeypatch, n: int):
    import fv_accel.checkpoint as checkpoint

    real, calls = checkpoint.write_rank_state, {"n": 0}

    def writer(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == n:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "write_rank_state", writer)


def test_a_full_disk_while_saving_names_the_folder_and_the_space_needed(tmp_path, latent_data, monkeypatch):
    out = tmp_path / "out"
    over = small_overrides(out, latent_data, **{"training.loop.max_train_steps": 5, "training.checkpoint.training_state_checkpointing_steps": 2})
    run = build("finetune", over)
    _enospc_on_call(monkeypatch, 2)  # checkpoint-2 is written, checkpoint-4 hits a full disk
    with pytest.raises(CheckpointError) as err:
        Trainer(run).run()
    size = sum(p.stat().st_size for p in (out / "checkpoint-2").rglob("*") if p.is_file())
    text = str(err.value)
    assert text.startswith(f"not enough disk space to write checkpoint-4 in {out}: ")
    # The disk here has room again once the partial folder is gone: the estimate fitted, the disk did not.
    assert f" free, more than that needed (estimated at {size / 1024:.1f} KiB: the size of checkpoint-2); free some space or move training.checkpoint.output_dir" in text
    assert text.endswith("(OSError: [Errno 28] No space left on device); checkpoint-2 stays the latest checkpoint")
    assert not list(out.glob(".checkpoint-*")) and (out / "latest").read_text().strip() == "checkpoint-2"
    assert latest_checkpoint(out) == out / "checkpoint-2" and not (out / LOCK_NAME).exists()


def test_torchs_unexpected_pos_error_on_a_full_disk_is_named_as_such(tmp_path, latent_data, monkeypatch, capsys):
    """The original report: torch's writer fails with `unexpected pos` and no word about space."""
    import accelerate.checkpointing

    out = tmp_path / "out"
    over = small_overrides(out, latent_data, **{"training.loop.max_train_steps": 5, "training.checkpoint.training_state_checkpointing_steps": 2})
    real_save, real_usage = accelerate.checkpointing.save, shutil.disk_usage
    state = {"saves": 0, "full": False}

    def save(obj, path, *args, **kwargs):
        if str(path).endswith("optimizer.bin"):
            state["saves"] += 1
            if state["saves"] == 2:
                state["full"] = True
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 3008 vs 2896")
        return real_save(obj, path, *args, **kwargs)

    def disk_usage(path):
        usage = real_usage(path)
        return usage._replace(free=64 * 1024) if state["full"] else usage

    monkeypatch.setattr(accelerate.checkpointing, "save", save)
    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    capsys.readouterr()
    assert cli_main("finetune", ["--config", str(recipe_file(tmp_path, "finetune", over))]) == 1
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.startswith("error")]
    assert len(lines) == 1, captured.err[-3000:]
    assert lines[0].startswith(f"error: not enough disk space to write checkpoint-4 in {out}: 64.0 KiB free, about ")
    assert lines[0].endswith(
        "(RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 3008 vs 2896); checkpoint-2 stays the latest checkpoint"
    )
    assert sorted(p.name for p in out.iterdir() if "checkpoint" in p.name) == ["checkpoint-2"]


def test_too_little_space_for_the_first_checkpoint_is_refused_before_writing(tmp_path, latent_data, monkeypatch):
    out = tmp_path / "out"
    over = small_overrides(out, latent_data, **{"training.loop.max_train_steps": 3, "training.checkpoint.training_state_checkpointing_steps": 2})
    run = build("finetune", over)
    real_usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real_usage(path)._replace(free=1000))
    params = run.method.student.trainable_parameters()
    # fp32 weights, AdamW's two moments and its step count per tensor, the EMA
    expected = sum(p.numel() for p in params) * (4 + 8 + 4) + 4 * len(params)
    with pytest.raises(CheckpointError) as err:
        Trainer(run).run()
    assert str(err.value) == (
        f"not enough disk space to write checkpoint-2 in {out}: 1000 B free, about {expected / 1024:.1f} KiB needed "
        "(the trainable weights, the optimizer's state and the EMA); free some space or move training.checkpoint.output_dir; "
        "no checkpoint was written"
    )
    assert not list(out.glob("*checkpoint*"))


def test_a_full_disk_while_writing_the_final_weights_is_named_as_such(tmp_path, latent_data, monkeypatch):
    out = tmp_path / "out"
    run = build("finetune", small_overrides(out, latent_data, **{"training.loop.max_train_steps": 2, "training.checkpoint.save_final": True}))
    student = run.method.student

    def save_final(accelerator, output_dir):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(student, "save_final", save_final)
    real_usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real_usage(path)._replace(free=4096))
    with pytest.raises(CheckpointError) as err:
        Trainer(run).run()
    needed = sum(p.numel() * 4 for p in student.trainable_parameters())
    assert str(err.value) == (
        f"not enough disk space to write the final weights in {out}: 4.0 KiB free, about {needed / 1024:.1f} KiB "
        "needed (the trainable weights, per copy); free some space or move training.checkpoint.output_dir "
        "(OSError: [Errno 28] No space left on device)"
    )
    assert not (out / LOCK_NAME).exists()


def test_what_a_killed_save_left_is_removed_at_the_next_start(tmp_path, latent_data, caplog):
    out = tmp_path / "out"
    over = small_overrides(out, latent_data, **{"training.loop.max_train_steps": 4, "training.checkpoint.training_state_checkpointing_steps": 2})
    run = build("finetune", over)
    Trainer(run, callbacks=[*run.callbacks, StopAtStep(2)]).run()
    partial = out / ".checkpoint-4.partial"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"\0" * 4096)
    (out / ".latest.tmp").write_text("checkpoint-4\n")
    with caplog.at_level(logging.WARNING, logger="fv_accel.output_dir"):
        resumed = build("finetune", {**over, "training.checkpoint.resume_from_checkpoint": "latest"})
    assert f"removed what an interrupted checkpoint save left in {out}: .checkpoint-4.partial, .latest.tmp" in caplog.text
    assert resumed.start_step == 2 and not partial.exists() and not (out / ".latest.tmp").exists()


# ---- 6. checkpoint integrity ------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory, latent_data):
    """A run with checkpoints at steps 2 and 4, its last (EMA on); tests damage copies of it."""
    out = tmp_path_factory.mktemp("integrity") / "out"
    over = small_overrides(out, latent_data, **{"training.loop.max_train_steps": 4, "training.checkpoint.training_state_checkpointing_steps": 2})
    Trainer(build("finetune", over)).run()
    reset_accelerate()
    meta = read_metadata(out / "checkpoint-4")
    assert meta["format_version"] == 3
    assert {"model.safetensors", "optimizer.bin", "scheduler.bin", "fv_rank_0.safetensors", "ema.safetensors"} <= set(meta["files"])
    return out, over


def _damaged_copy(two_checkpoints, tmp_path, damage):
    src, over = two_checkpoints
    out = tmp_path / "out"
    shutil.copytree(src, out)
    damage(out)
    return out, {**over, "training.checkpoint.output_dir": str(out), "training.checkpoint.resume_from_checkpoint": "latest"}


def _flip_a_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x10  # a weight's byte (the header comes first)
    path.write_bytes(bytes(data))


def _edit_metadata(path: Path, *, reseal: bool = False, **changes) -> None:
    """Change metadata.json's keys (None deletes one); `reseal` records the new contents' sha256 in it,
    as a save that wrote wrong values would have."""
    meta = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            del meta[key]
        else:
            meta[key] = value
    if reseal:
        from fv_accel.checkpoint import METADATA_CHECKSUM_KEY, metadata_checksum

        meta[METADATA_CHECKSUM_KEY] = metadata_checksum(meta)
    path.write_text(json.dumps(meta))


def _edit_data_epoch(path: Path) -> None:
    meta = json.loads(path.read_text())
    _edit_metadata(path, data={**meta["data"], "epoch": meta["data"]["epoch"] + 1})


@pytest.mark.parametrize(
    "damage,problem",
    [
        (lambda out: _flip_a_bit(out / "checkpoint-4" / "model.safetensors"),
         "{c4}/model.safetensors: sha256 {{hex}}... differs from the {{hex}}... recorded in metadata.json (the file changed after it was saved)"),
        (lambda out: os.truncate(out / "checkpoint-4" / "model.safetensors", 1000),
         "{c4}/model.safetensors: 1000 bytes, but metadata.json records {{size}} (truncated or overwritten)"),
        (lambda out: (out / "checkpoint-4" / "fv_rank_0.safetensors").unlink(),
         "{c4}/fv_rank_0.safetensors: missing (listed in metadata.json)"),
        (lambda out: (out / "checkpoint-4" / "ema.safetensors").unlink(),
         "{c4}/ema.safetensors: missing (listed in metadata.json)"),
        (lambda out: _edit_metadata(out / "checkpoint-4" / "metadata.json", data=None),
         "{c4}/metadata.json: missing key 'data'"),
        (lambda out: _edit_metadata(out / "checkpoint-4" / "metadata.json", step=2),
         "{c4}/metadata.json: step 2, but the folder is checkpoint-4 (step 4)"),
        (lambda out: (out / "checkpoint-4" / "metadata.json").unlink(),
         "{c4}: no metadata.json; not a complete fv_accel checkpoint"),
        # Issue 31: the data position is in metadata.json, which records the sha256 of its own contents.
        (lambda out: _edit_data_epoch(out / "checkpoint-4" / "metadata.json"),
         "{c4}/metadata.json: its contents differ from the sha256 recorded in it ('metadata_sha256'): the file was "
         "edited after it was saved (its data position, recipe or file list cannot be trusted)"),
    ],
    ids=["bit_flip", "truncated", "rank_state_deleted", "ema_deleted", "no_data_key", "step_edited", "no_metadata", "data_epoch_edited"],
)
def test_a_damaged_latest_checkpoint_is_refused_naming_the_file_and_the_previous_good_one(
    two_checkpoints, tmp_path, damage, problem, capsys
):
    import re

    out, over = _damaged_copy(two_checkpoints, tmp_path, damage)
    c4 = out / "checkpoint-4"
    size = read_metadata(two_checkpoints[0] / "checkpoint-4")["files"]["model.safetensors"]["bytes"]
    expected = (
        f"cannot resume from {c4}: " + problem.format(c4=c4).replace("{size}", str(size))
        + f"; the newest complete checkpoint before it is {out / 'checkpoint-2'}: "
        f"resume with --resume_from_checkpoint {out / 'checkpoint-2'}"
    )
    pattern = "^" + re.escape(expected).replace(re.escape("{hex}"), "[0-9a-f]{16}") + "$"
    before = snapshot(out)
    with pytest.raises(CheckpointError) as err:
        build("finetune", over)
    assert re.match(pattern, str(err.value)), str(err.value)
    assert snapshot(out) == before
    capsys.readouterr()
    assert cli_main("finetune", ["--config", str(recipe_file(tmp_path, "finetune", over))]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and re.match(pattern.replace("^", "^error: ", 1), lines[0]), lines
    # The previous checkpoint it names resumes.
    assert build("finetune", {**over, "training.checkpoint.resume_from_checkpoint": str(out / "checkpoint-2")}).start_step == 2


def test_a_damaged_first_checkpoint_and_an_edited_step_in_a_renamed_copy(two_checkpoints, tmp_path):
    out, over = _damaged_copy(two_checkpoints, tmp_path, lambda out: _flip_a_bit(out / "checkpoint-2" / "optimizer.bin"))
    with pytest.raises(CheckpointError, match=rf"optimizer\.bin: sha256 .*; there is no complete checkpoint before it in {out}$"):
        build("finetune", {**over, "training.checkpoint.resume_from_checkpoint": str(out / "checkpoint-2")})
    # A copy under another name can only be checked against its own state: the LR schedule's step count.
    renamed = tmp_path / "kept"
    shutil.copytree(out / "checkpoint-4", renamed)
    _edit_metadata(renamed / "metadata.json", step=5, reseal=True)  # unsealed, the checksum refuses it first
    with pytest.raises(CheckpointError) as err:
        build("finetune", {**over, "training.checkpoint.resume_from_checkpoint": str(renamed),
                           "training.checkpoint.output_dir": str(tmp_path / "new")})
    assert str(err.value) == (
        f"cannot resume from {renamed}: {renamed / 'metadata.json'} says step 5, but its LR scheduler state has "
        "taken 4 steps; resume from another checkpoint"
    )


def test_a_latest_pointer_to_a_missing_checkpoint_skips_nothing(two_checkpoints, tmp_path):
    out, over = _damaged_copy(two_checkpoints, tmp_path, lambda out: shutil.rmtree(out / "checkpoint-4"))
    (out / "latest").write_text("checkpoint-4\n")
    with pytest.raises(CheckpointError) as err:
        build("finetune", over)
    assert str(err.value) == (
        f"cannot resume from {out / 'checkpoint-4'}: {out / 'checkpoint-4'}: no metadata.json; not a complete fv_accel "
        f"checkpoint; the newest complete checkpoint before it is {out / 'checkpoint-2'}: resume with "
        f"--resume_from_checkpoint {out / 'checkpoint-2'}"
    )


def test_a_checkpoint_of_the_previous_format_resumes_unverified_with_its_per_rank_ema(two_checkpoints, tmp_path, caplog):
    """Format 1 (before checksums): no `files`, and the EMA in the rank file (`extra/cb0/shadow.<i>`)."""
    from safetensors.torch import load_file, save_file

    def downgrade(out):
        ckpt = out / "checkpoint-4"
        rank = load_file(str(ckpt / "fv_rank_0.safetensors"))
        with safe_open(str(ckpt / "fv_rank_0.safetensors"), framework="pt") as fh:
            strings = fh.metadata()
        with safe_open(str(ckpt / "ema.safetensors"), framework="pt") as fh:
            rank.update({f"extra/cb0/{k}": fh.get_tensor(k) for k in fh.keys()})
            rank["extra/cb0/num_updates"] = torch.tensor([int(fh.metadata()["num_updates"])])
        save_file(rank, str(ckpt / "fv_rank_0.safetensors"), metadata=strings)
        (ckpt / "ema.safetensors").unlink()
        meta = json.loads((ckpt / "metadata.json").read_text())
        del meta["files"], meta["optimizer"], meta["metadata_sha256"], meta["engine"], meta["data_fingerprint"]
        meta["format_version"] = 1
        (ckpt / "metadata.json").write_text(json.dumps(meta))

    out, over = _damaged_copy(two_checkpoints, tmp_path, downgrade)
    with safe_open(str(two_checkpoints[0] / "checkpoint-4" / "ema.safetensors"), framework="pt") as fh:
        saved = [fh.get_tensor(f"shadow.{i}") for i in range(len(list(fh.keys())))]
    with caplog.at_level(logging.WARNING):
        run = build("finetune", over)
    assert f"{out / 'checkpoint-4'} records no checksums (saved by fv_accel before format 2): its files are not verified" in caplog.text
    ema = next(cb.ema for cb in run.callbacks if getattr(cb, "ema", None) is not None)
    assert ema.num_updates == 4 and all(torch.equal(a, b) for a, b in zip(ema.shadow, saved))


# ---- 7. exports outside the checkpoints ----------------------------------------------------------


def test_export_defaults_to_the_runs_exports_folder_which_pruning_keeps(tmp_path, latent_data, capsys):
    from fv_accel.export import main as export_main

    out = tmp_path / "out"
    over = small_overrides(out, latent_data, **{"training.loop.max_train_steps": 4, "training.checkpoint.training_state_checkpointing_steps": 2,
                                                "training.checkpoint.checkpoints_total_limit": 1, "training.checkpoint.save_final": True})
    run = build("finetune", over)
    Trainer(run, callbacks=[*run.callbacks, StopAtStep(2)]).run()
    capsys.readouterr()
    export_main([str(out / "checkpoint-2"), "--to", "diffusers"])
    target = out / "exports" / "checkpoint-2_diffusers" / "transformer"
    assert capsys.readouterr().out.strip() == f"wrote {target}"
    with pytest.raises(SystemExit, match=rf"--out {out / 'checkpoint-2' / 'mine'} is inside the checkpoint {out / 'checkpoint-2'}"):
        export_main([str(out / "checkpoint-2"), "--to", "diffusers", "--out", str(out / "checkpoint-2" / "mine")])
    # Training on with a limit of 1 checkpoint deletes checkpoint-2, not the export.
    Trainer(build("finetune", {**over, "training.loop.max_train_steps": 5, "training.checkpoint.resume_from_checkpoint": "latest"})).run()
    assert not (out / "checkpoint-2").exists() and (out / "checkpoint-5").is_dir()
    assert (target / "diffusion_pytorch_model.safetensors").is_file()
    capsys.readouterr()
    export_main([str(out), "--to", "diffusers"])
    assert capsys.readouterr().out.strip() == f"wrote {out / 'exports' / 'final_diffusers' / 'transformer'}"


# ---- 13. the EMA in checkpoints ----------------------------------------------------------------


def test_a_checkpoint_holds_one_full_copy_of_the_ema(two_checkpoints):
    out, _ = two_checkpoints
    ckpt = out / "checkpoint-4"
    with safe_open(str(ckpt / "fv_rank_0.safetensors"), framework="pt") as fh:
        assert not [k for k in fh.keys() if not k.startswith("rng/")]  # RNG states only
    with safe_open(str(ckpt / "ema.safetensors"), framework="pt") as fh:
        shapes = {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}
        assert fh.metadata()["num_updates"] == "4"
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as fh:
        weights = [tuple(fh.get_slice(k).get_shape()) for k in fh.keys()]
    assert len(shapes) == len(weights) and sorted(shapes.values()) == sorted(weights)


def test_ema_under_zero3_is_refused_when_the_recipe_is_checked(monkeypatch, tmp_path, latent_data):
    from accelerate.utils import DeepSpeedPlugin, DistributedType

    from fv_accel.ema import check_ema_supported
    from tests.test_distributed import launch_env

    def accelerator(config: str):
        for key, value in launch_env(REPO / "accelerate_configs" / config).items():
            if key.startswith("ACCELERATE_"):
                monkeypatch.setenv(key, value)
        plugin = DeepSpeedPlugin()
        return types.SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, state=types.SimpleNamespace(deepspeed_plugin=plugin))

    cfg = load_config(default_recipe("finetune"), {"callbacks.ema.enable": True})
    with pytest.raises(ConfigError) as err:
        check_ema_supported(cfg, accelerator("deepspeed_zero3.yaml"))
    assert str(err.value).startswith("callbacks.ema.enable: the EMA is not supported under DeepSpeed ZeRO-3 (zero_optimization.stage 3")
    check_ema_supported(cfg, accelerator("deepspeed_zero2.yaml"))
    check_ema_supported(load_config(default_recipe("finetune"), {"callbacks.ema.enable": False}), accelerator("deepspeed_zero3.yaml"))

    # build_from_config asks before the student (and so the engine) is built.
    import fv_accel.ema
    import fv_accel.models

    def refuse(cfg, acc):
        raise ConfigError("refused: zero3")

    built = []
    monkeypatch.setattr(fv_accel.ema, "check_ema_supported", refuse)
    monkeypatch.setattr(fv_accel.models, "build_student", lambda cfg: built.append(cfg))
    for key in [k for k in os.environ if k.startswith("ACCELERATE_")]:
        monkeypatch.delenv(key)
    with pytest.raises(ConfigError, match="refused: zero3"):
        build("finetune", small_overrides(tmp_path / "out", latent_data))
    assert built == [] and not (tmp_path / "out").exists()


# ---- 14. trackers finished and the folder released on every exit path ----------------------------


class FakeTracker:
    def __init__(self, name: str):
        self.name, self.calls = name, []
        self.run = types.SimpleNamespace(finish=lambda **kw: self.calls.append(("run.finish", kw)))

    def finish(self):
        self.calls.append(("finish", {}))

    def log(self, values, step=None, **kwargs):
        pass


@pytest.mark.parametrize("outcome", ["done", "crash"])
def test_trackers_are_finished_and_the_lock_released_however_the_run_ends(tmp_path, latent_data, outcome):
    out = tmp_path / "out"
    run = build("finetune", small_overrides(out, latent_data, **{"training.loop.max_train_steps": 3}))
    trackers = [FakeTracker("wandb"), FakeTracker("tensorboard")]
    run.accelerator.trackers = trackers
    assert json.loads((out / LOCK_NAME).read_text())["pid"] == os.getpid()
    ended = []
    real_end = run.accelerator.end_training
    run.accelerator.end_training = lambda: (ended.append(True), real_end())

    class Crash(TrainerCallback):
        def on_step_end(self, trainer, step, logs):
            if outcome == "crash" and step == 2:
                raise RuntimeError("boom at step 2")

    trainer = Trainer(run, callbacks=[*run.callbacks, Crash()])
    if outcome == "crash":
        with pytest.raises(RuntimeError, match="boom at step 2"):
            trainer.run()
        # A crash: W&B's run is marked failed, the others finished; the process group is left alone.
        assert trackers[0].calls == [("run.finish", {"exit_code": 1})] and trackers[1].calls == [("finish", {})]
        assert ended == []
    else:
        trainer.run()
        assert ended == [True]
        assert trackers[0].calls == [("finish", {})] and trackers[1].calls == [("finish", {})]
    assert not (out / LOCK_NAME).exists()


# ---- 11. numerical faults under DeepSpeed -------------------------------------------------------


class _NoStep:
    """Accelerate's DeepSpeed optimizer / scheduler wrapper: `step` and `zero_grad` do nothing."""

    def __init__(self, inner):
        self.__dict__["inner"] = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def step(self):
        pass

    def zero_grad(self, set_to_none=None):
        pass


def fake_deepspeed(run, trainer, monkeypatch) -> types.SimpleNamespace:
    """What Accelerate does under DeepSpeed, on a one-process run: `accelerator.backward` runs the
    engine's step (clip, optimizer step, LR schedule step, zero grad) on the last micro-batch; the
    optimizer's and scheduler's own `step` do nothing; `clip_grad_norm_` returns the engine's norm."""
    acc, method = run.accelerator, run.method
    optimizer, scheduler = method.optimizer.optimizer, method.lr_scheduler.scheduler
    params = method.student.trainable_parameters()
    max_norm = run.config.callbacks.grad_clip.max_grad_norm
    engine = types.SimpleNamespace(steps=0, norm=None, overflow_at=set(), calls=0)

    def backward(loss, **kwargs):
        (loss / acc.gradient_accumulation_steps).backward()
        if acc.sync_gradients:
            engine.calls += 1
            engine.norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
            # An overflow of DeepSpeed's fp16 loss scaler: neither the update nor the schedule step.
            method.optimizer.step_was_skipped = engine.calls in engine.overflow_at
            if not method.optimizer.step_was_skipped:
                optimizer.step()
                scheduler.step()
                engine.steps += 1
            optimizer.zero_grad(set_to_none=True)

    monkeypatch.setattr(acc, "backward", backward)
    monkeypatch.setattr(acc, "clip_grad_norm_", lambda *a, **k: engine.norm)
    method.optimizer, method.lr_scheduler = _NoStep(method.optimizer), _NoStep(method.lr_scheduler)
    method.optimizer.step_was_skipped = False
    trainer.steps_in_backward = True
    return engine


def _ema(run):
    return next(cb for cb in run.callbacks if getattr(cb, "ema", None) is not None).ema


def test_nan_policy_resolves_per_engine_and_skip_is_refused_under_deepspeed(tmp_path, caplog):
    from accelerate.utils import DistributedType

    from fv_accel.build import build_from_config
    from fv_accel.trainer import engine_steps_in_backward, resolve_nan_policy

    ds = types.SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, is_main_process=True,
                               state=types.SimpleNamespace(deepspeed_plugin=None))
    ddp = types.SimpleNamespace(distributed_type=DistributedType.MULTI_CPU)
    assert engine_steps_in_backward(ds) and not engine_steps_in_backward(ddp) and not engine_steps_in_backward(None)
    fake_run = types.SimpleNamespace(accelerator=ds, config=load_config(default_recipe("finetune")), method=None,
                                     dataloader=None, start_step=0, callbacks=[])
    assert Trainer(fake_run).steps_in_backward

    def cfg(policy):
        return load_config(default_recipe("finetune"), {"training.loop.nan_policy": policy})

    assert load_config(default_recipe("finetune")).training.loop.nan_policy == "auto"
    assert [resolve_nan_policy(cfg(p), False) for p in ("auto", "skip", "stop")] == ["skip", "skip", "stop"]
    with caplog.at_level(logging.INFO, logger="fv_accel.trainer"):
        assert resolve_nan_policy(cfg("auto"), True, log=True) == "stop"
        assert resolve_nan_policy(cfg("stop"), True, log=True) == "stop"
    assert caplog.text.count("training.loop.nan_policy auto: stop under DeepSpeed") == 1
    with pytest.raises(ConfigError) as err:
        resolve_nan_policy(cfg("skip"), True)
    assert str(err.value).startswith("training.loop.nan_policy: skip is not possible under DeepSpeed")

    # The build refuses it before anything is built or written.
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match="training.loop.nan_policy: skip is not possible under DeepSpeed"):
        build_from_config(default_recipe("finetune"), {"training.loop.nan_policy": "skip",
                                                       "training.checkpoint.output_dir": str(out)}, accelerator=ds)
    assert not out.exists()


def test_a_nan_loss_under_deepspeed_stops_before_the_engine_steps(tmp_path, latent_data, monkeypatch, caplog):
    """Default policy under DeepSpeed: a NaN loss on the 2nd micro-batch of step 3 (the 1st one
    already went through backward) keeps the engine from stepping; the checkpoint holds the step-2
    weights, an EMA of 2 updates and the schedule at 3, and the run resumes from it."""
    out = tmp_path / "out"
    over = small_overrides(out, latent_data, **{"training.loop.max_train_steps": 5})
    run = build("finetune", over)
    real = run.method.single_train_step
    calls = {"n": 0}

    def step(batch, iteration):
        loss_map, outputs, metrics = real(batch, iteration)
        calls["n"] += 1
        if calls["n"] == 6:  # step 3, micro-batch 2
            loss_map = dict(loss_map, total_loss=loss_map["total_loss"] * float("nan"))
        return loss_map, outputs, metrics

    run.method.single_train_step = step
    trainer = Trainer(run)
    engine = fake_deepspeed(run, trainer, monkeypatch)
    after = {}

    class Record(TrainerCallback):
        def on_step_end(self, trainer, step, logs):
            after[step] = (weights(run), engine.steps, _ema(run).num_updates)

    trainer.callbacks.append(Record())
    with caplog.at_level(logging.WARNING), pytest.raises(TrainingStopped) as err:
        trainer.run()
    text = str(err.value)
    assert text.startswith("stopped (training.loop.nan_policy: stop): non-finite loss at step 3: loss=nan"), text
    assert text.endswith(f"checkpoint saved in {out / 'checkpoint-3'}")
    assert "skipped step 3 (1 skipped in all)" in caplog.text
    assert calls["n"] == 6 and engine.steps == 2 and after[3][1] == 2
    ckpt = out / "checkpoint-3"
    saved = {k.removeprefix("module."): v for k, v in load_file(str(ckpt / "model.safetensors")).items()}
    assert all(torch.equal(saved[k], v) for k, v in after[2][0].items())
    assert all(torch.equal(saved[k], v) for k, v in after[3][0].items())
    meta = read_metadata(ckpt)
    assert meta["trainer"]["skipped_steps"] == 1 and meta["optimizer"]["scheduler_steps"] == 3
    with safe_open(str(ckpt / "ema.safetensors"), framework="pt") as fh:
        assert fh.metadata()["num_updates"] == "2" == str(after[3][2])

    resumed = build("finetune", {**over, "training.checkpoint.resume_from_checkpoint": "latest"})
    summary = Trainer(resumed).run()
    assert resumed.start_step == 3 and summary["final_step"] == 5 and _ema(resumed).num_updates == 4


def test_a_gradient_deepspeed_applied_is_not_called_skipped_and_is_never_saved(tmp_path, latent_data, monkeypatch, caplog):
    """A finite loss with an infinite gradient: the engine has applied the step inside backward, so
    the run stops without calling the step skipped, without updating the EMA, and without saving."""
    out = tmp_path / "out"
    over = small_overrides(out, latent_data, **{"training.loop.max_train_steps": 4,
                                                "training.checkpoint.training_state_checkpointing_steps": 1})
    run = build("finetune", over)
    real = run.method.single_train_step
    current = {"step": 0}

    def step(batch, iteration):
        current["step"] = iteration
        return real(batch, iteration)

    run.method.single_train_step = step
    param = run.method.student.trainable_parameters()[0]
    param.register_hook(lambda g: g * float("inf") if current["step"] == 2 else g)
    trainer = Trainer(run)
    engine = fake_deepspeed(run, trainer, monkeypatch)
    with caplog.at_level(logging.WARNING), pytest.raises(TrainingStopped) as err:
        trainer.run()
    text = str(err.value)
    assert text.startswith("stopped (training.loop.nan_policy: stop): non-finite gradient norm at step 2"), text
    assert text.endswith(f"DeepSpeed applied step 2 inside backward, so its weights may hold NaN/inf and no "
                         f"checkpoint was saved; the last one is {out / 'checkpoint-1'}")
    assert err.value.checkpoint == out / "checkpoint-1" == latest_checkpoint(out)
    assert engine.steps == 2 and not (out / "checkpoint-2").exists()
    assert "skipped step" not in caplog.text and trainer.skipped_steps == 0
    assert _ema(run).num_updates == 1


def test_a_step_deepspeeds_loss_scaler_dropped_is_counted_for_the_ema_and_the_run_goes_on(tmp_path, latent_data, monkeypatch, caplog):
    run = build("finetune", small_overrides(tmp_path / "out", latent_data, **{"training.loop.max_train_steps": 4}))
    trainer = Trainer(run)
    engine = fake_deepspeed(run, trainer, monkeypatch)
    engine.overflow_at = {2}
    with caplog.at_level(logging.INFO, logger="fv_accel.trainer"):
        summary = trainer.run()
    assert summary["final_step"] == 4 and summary["skipped_steps"] == 1 and engine.steps == 3
    assert [h["skipped_steps"] for h in trainer.history] == [0, 1, 1, 1]
    assert _ema(run).num_updates == 3
    assert "step 2: DeepSpeed's loss scaler skipped the update (gradient overflow; 1 skipped in all)" in caplog.text
