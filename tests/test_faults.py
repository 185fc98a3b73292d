"""Faults: preemption signals, a checkpoint save that crashes half-way, non-finite losses and gradients."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import fv_accel.trainer as trainer_module
from fv_accel.checkpoint import latest_checkpoint, read_metadata
from fv_accel.config import default_recipe, load_config
from fv_accel.trainer import Trainer, TrainerCallback, TrainingStopped
from tests.launch_helpers import ANY_FREE_PORT, kill_tree, thread_signal_masks, wait_or_diagnose
from tests.resume_helpers import build, small_overrides, weights, write_latent_dataset

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def latent_data(tmp_path_factory):
    return write_latent_dataset(tmp_path_factory.mktemp("latents"), num_clips=6)


class WeightsPerStep(TrainerCallback):
    def __init__(self, run):
        self.run = run
        self.after = {0: weights(run)}

    def on_step_end(self, trainer, step, logs):
        self.after[step] = weights(self.run)


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def inject_nan_loss(run, steps: set[int]) -> list:
    """Make the loss of the given (1-based) steps NaN; returns the timesteps each one used."""
    real = run.method.single_train_step
    seen = []

    def step(batch, iteration):
        loss_map, outputs, metrics = real(batch, iteration)
        if iteration in steps:
            loss_map = dict(loss_map, total_loss=loss_map["total_loss"] * float("nan"))
            seen.append((iteration, outputs["training_batch"].timesteps.detach().clone()))
        return loss_map, outputs, metrics

    run.method.single_train_step = step
    return seen


def _timesteps_text(seen, step):
    return str([[round(v, 2) for v in t.float().flatten().tolist()] for s, t in seen if s == step])


# ---- numerical faults ----------------------------------------------------------------------


def test_nan_loss_is_skipped_and_counted(tmp_path, latent_data, caplog):
    run = build("finetune", small_overrides(tmp_path / "out", latent_data, **{"training.loop.max_train_steps": 5}))
    seen = inject_nan_loss(run, {3})
    record = WeightsPerStep(run)
    trainer = Trainer(run, callbacks=[*run.callbacks, record])
    summary = trainer.run()
    assert summary["skipped_steps"] == 1 and summary["final_step"] == 5
    assert [h["skipped_steps"] for h in trainer.history] == [0, 0, 1, 1, 1]
    assert math.isnan(trainer.history[2]["loss"]) and all(math.isfinite(h["loss"]) for h in trainer.history[3:])
    # The skipped step changed nothing; the steps around it trained.
    assert _same(record.after[3], record.after[2])
    assert not _same(record.after[2], record.after[1]) and not _same(record.after[4], record.after[3])
    # The LR schedule still advanced with the step count (warm-up over 7 steps).
    assert [round(h["lr"] / 1e-3 * 7) for h in trainer.history] == [1, 2, 3, 4, 5]
    assert "skipped step 3 (1 skipped in all): non-finite loss at step 3: loss=nan" in caplog.text
    assert f"timesteps={_timesteps_text(seen, 3)}" in caplog.text


def test_nan_loss_under_stop_saves_a_checkpoint_and_names_step_loss_timesteps(tmp_path, latent_data):
    out = tmp_path / "out"
    over = small_overrides(out, latent_data, **{"training.loop.max_train_steps": 5, "training.loop.nan_policy": "stop"})
    run = build("dfsft", over)
    seen = inject_nan_loss(run, {3})
    record = WeightsPerStep(run)
    with pytest.raises(TrainingStopped) as err:
        Trainer(run, callbacks=[*run.callbacks, record]).run()
    text = str(err.value)
    assert text.startswith("stopped (training.loop.nan_policy: stop): non-finite loss at step 3: loss=nan")
    timesteps = _timesteps_text(seen, 3)
    assert timesteps.count(",") >= 5  # DFSFT: one timestep per latent frame, per micro-batch
    assert f"timesteps={timesteps}" in text
    assert f"checkpoint saved in {out / 'checkpoint-3'}" in text
    assert err.value.checkpoint == out / "checkpoint-3" == latest_checkpoint(out)
    assert read_metadata(out / "checkpoint-3")["trainer"] == {"skipped_steps": 1, "consecutive_skips": 1, "recipe_changes": []}
    # The checkpoint holds the weights from before the bad step, and it resumes.
    saved = load_file(str(out / "checkpoint-3" / "model.safetensors"))
    assert _same(saved, record.after[2])
    resumed = build("dfsft", {**over, "training.checkpoint.resume_from_checkpoint": "latest"})
    trainer = Trainer(resumed)
    summary = trainer.run()
    assert resumed.start_step == 3 and summary["final_step"] == 5 and summary["skipped_steps"] == 1
    assert all(math.isfinite(h["loss"]) for h in trainer.history)


def test_too_many_skips_in_a_row_stop_the_run(tmp_path, latent_data):
    out = tmp_path / "out"
    over = small_overrides(
        out, latent_data, **{"training.loop.max_train_steps": 8, "training.loop.max_consecutive_skips": 2}
    )
    run = build("finetune", over)
    inject_nan_loss(run, {2, 3, 4, 5, 6})
    with pytest.raises(TrainingStopped) as err:
        Trainer(run).run()
    text = str(err.value)
    assert "stopped: 3 non-finite steps in a row, more than training.loop.max_consecutive_skips (2)" in text
    assert "last: non-finite loss at step 4: loss=nan" in text
    assert latest_checkpoint(out) == out / "checkpoint-4"


def test_non_finite_gradient_norm_is_caught_without_clipping(tmp_path, latent_data, caplog):
    over = small_overrides(
        tmp_path / "out", latent_data, **{"training.loop.max_train_steps": 3, "callbacks.grad_clip.max_grad_norm": 0.0}
    )
    run = build("finetune", over)
    real = run.method.single_train_step
    current = {"step": 0}

    def step(batch, iteration):
        current["step"] = iteration
        return real(batch, iteration)

    run.method.single_train_step = step
    param = run.method.student.trainable_parameters()[0]
    # An overflowing gradient at step 2 with a finite loss.
    param.register_hook(lambda g: g * float("inf") if current["step"] == 2 else g)
    record = WeightsPerStep(run)
    trainer = Trainer(run, callbacks=[*run.callbacks, record])
    summary = trainer.run()
    assert summary["skipped_steps"] == 1
    assert _same(record.after[2], record.after[1]) and not _same(record.after[3], record.after[2])
    assert math.isfinite(trainer.history[1]["loss"])
    assert re.search(r"non-finite gradient norm at step 2: loss=[0-9.]+ .*grad_norm=(inf|nan)", caplog.text)


# ---- a checkpoint save that crashes half-way -------------------------------------------------


def _crash_on_second_call(monkeypatch, target, name, partial_write=False):
    import importlib

    module = importlib.import_module(target)
    real = getattr(module, name)
    calls = {"n": 0}

    def crashing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            if partial_write:  # half of the file reaches the disk, then the process "dies"
                path, meta = args
                path.write_text(json.dumps(meta)[:100])
            raise OSError("injected crash while writing the checkpoint")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, crashing)


@pytest.mark.parametrize(
    "target,name,partial_write",
    [
        ("fv_accel.checkpoint", "write_rank_state", False),  # after Accelerate wrote model/optimizer
        ("fv_accel.checkpoint", "write_metadata", True),  # metadata.json half written
    ],
    ids=["rank_state", "metadata"],
)
def test_a_crash_mid_save_leaves_the_previous_checkpoint_as_latest(
    tmp_path, latent_data, monkeypatch, target, name, partial_write
):
    out = tmp_path / "out"
    over = small_overrides(
        out,
        latent_data,
        **{"training.loop.max_train_steps": 5, "training.checkpoint.training_state_checkpointing_steps": 2},
    )
    run = build("finetune", over)
    _crash_on_second_call(monkeypatch, target, name, partial_write)
    with pytest.raises(OSError, match="injected crash"):
        Trainer(run).run()
    monkeypatch.undo()
    # The failed save removed its half-written folder (a killed one leaves it to the next start).
    partial = out / ".checkpoint-4.partial"
    assert not partial.exists()
    assert not (out / "checkpoint-4").exists()
    assert (out / "latest").read_text().strip() == "checkpoint-2"
    assert latest_checkpoint(out) == out / "checkpoint-2"
    assert read_metadata(out / "checkpoint-2")["step"] == 2

    resumed = build("finetune", {**over, "training.checkpoint.resume_from_checkpoint": "latest"})
    assert resumed.start_step == 2
    summary = Trainer(resumed).run()
    assert summary["final_step"] == 5
    # Checkpoints at the interval and at the last step.
    assert (out / "checkpoint-4").is_dir() and latest_checkpoint(out) == out / "checkpoint-5" and not partial.exists()


def test_checkpoints_total_limit_keeps_the_newest(tmp_path, latent_data):
    out = tmp_path / "out"
    over = small_overrides(
        out,
        latent_data,
        **{
            "training.loop.max_train_steps": 6,
            "training.loop.gradient_accumulation_steps": 1,
            "training.checkpoint.training_state_checkpointing_steps": 1,
            "training.checkpoint.checkpoints_total_limit": 2,
        },
    )
    Trainer(build("finetune", over)).run()
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(("checkpoint", ".checkpoint"))) == [
        "checkpoint-5",
        "checkpoint-6",
    ]
    assert (out / "latest").read_text().strip() == "checkpoint-6"


# ---- signals ---------------------------------------------------------------------------------


def _launch(script: str, recipe: Path, log_path: Path, nproc: int) -> subprocess.Popen:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1")
    accelerate = Path(sys.executable).with_name("accelerate")
    multi = ["--multi_gpu"] if nproc > 1 else []
    cmd = [str(accelerate), "launch", *multi, "--num_processes", str(nproc), "--num_machines", "1",
           *ANY_FREE_PORT, "--mixed_precision", "no", "--dynamo_backend", "no",
           script, "--config", str(recipe)]
    with open(log_path, "w") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def _wait_for_steps(launcher: subprocess.Popen, out: Path, steps: int, log_path: Path) -> None:
    metrics = out / "logs" / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and launcher.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= steps:
            return
        time.sleep(0.2)
    kill_tree(launcher)
    raise AssertionError(f"the run did not reach step {steps}:\n{log_path.read_text()[-3000:]}")


def _logged_losses(out: Path) -> dict[int, float]:
    return {rec["step"]: rec["loss"] for rec in map(json.loads, (out / "logs" / "metrics.jsonl").read_text().splitlines())}


def test_second_signal_exits_at_once_but_a_relayed_copy_does_not(monkeypatch, capfd, tmp_path):
    cfg = load_config(default_recipe("finetune"), {"training.checkpoint.output_dir": str(tmp_path)})
    fake_run = types.SimpleNamespace(accelerator=None, config=cfg, method=None, dataloader=None, start_step=0, callbacks=[])
    trainer = Trainer(fake_run)
    clock = {"now": 100.0}
    exits = []
    monkeypatch.setattr(trainer_module, "time", types.SimpleNamespace(monotonic=lambda: clock["now"]))
    monkeypatch.setattr(trainer_module.os, "_exit", exits.append)

    trainer._on_signal(signal.SIGTERM, None)
    assert trainer._stop_signal == signal.SIGTERM and exits == []
    clock["now"] += 0.5  # accelerate launch relaying the same request to its child
    trainer._on_signal(signal.SIGTERM, None)
    assert exits == []
    clock["now"] += 5.0  # the user insists
    trainer._on_signal(signal.SIGINT, None)
    assert exits == [128 + signal.SIGINT]
    err = capfd.readouterr().err
    assert "received SIGTERM: saving a checkpoint after the current step" in err
    assert "received SIGINT again: exiting now without a checkpoint" in err


def test_threads_started_while_building_block_stop_signals_and_the_main_thread_does_not(tmp_path, latent_data):
    import threading

    from fv_accel.trainer import stop_signals_blocked_in_new_threads

    seen = []
    with stop_signals_blocked_in_new_threads():
        thread = threading.Thread(target=lambda: seen.append(signal.pthread_sigmask(signal.SIG_BLOCK, [])))
        thread.start()
        thread.join()
    assert {signal.SIGTERM, signal.SIGINT} <= seen[0]
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    assert signal.SIGTERM not in before
    build("finetune", small_overrides(tmp_path / "out", latent_data))
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before


def test_sigusr1_dumps_every_threads_stack_while_training_and_is_restored_after(capfd, tmp_path):
    cfg = load_config(default_recipe("finetune"), {"training.checkpoint.output_dir": str(tmp_path)})
    fake_run = types.SimpleNamespace(accelerator=None, config=cfg, method=None, dataloader=None, start_step=0, callbacks=[])
    trainer = Trainer(fake_run)
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    previous = trainer._install_signal_handlers()
    try:
        assert signal.getsignal(signal.SIGTERM) == trainer._on_signal
        os.kill(os.getpid(), signal.SIGUSR1)  # the default action would end this process
        time.sleep(0.2)
    finally:
        trainer._restore_signal_handlers(previous)
    err = capfd.readouterr().err
    assert "most recent call first" in err and "test_sigusr1_dumps_every_threads_stack" in err
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    assert signal.getsignal(signal.SIGTERM) == previous[signal.SIGTERM]


@pytest.mark.slow
def test_sigterm_to_a_launched_run_saves_exits_0_and_resumes(tmp_path, latent_data):
    import psutil

    out = tmp_path / "out"
    over = small_overrides(out, latent_data, **{"training.loop.max_train_steps": 1000, "training.tracker.log_every": 1})
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(load_config(default_recipe("finetune"), over).to_yaml())
    log_path = tmp_path / "launch.log"
    launcher = _launch("train_finetune.py", recipe, log_path, nproc=1)
    _wait_for_steps(launcher, out, 3, log_path)
    trainers = [p for p in psutil.Process(launcher.pid).children(recursive=True) if "train_finetune.py" in " ".join(p.cmdline())]
    assert len(trainers) == 1
    trainers[0].send_signal(signal.SIGTERM)  # what a preemption notice does to the training process
    rc = wait_or_diagnose(launcher, 240, log_path)
    text = log_path.read_text()
    assert rc == 0, text[-3000:]
    m = re.search(r"stopped by SIGTERM after step (\d+): checkpoint saved in (\S+); continue with --resume_from_checkpoint latest", text)
    assert m, text[-3000:]
    step = int(m.group(1))
    assert 3 <= step < 1000 and Path(m.group(2)) == out / "checkpoint-{}".format(step) == latest_checkpoint(out)
    assert not list(out.glob(".checkpoint-*"))
    # Every finished step was logged and is in the checkpoint: nothing lost.
    assert len((out / "logs" / "metrics.jsonl").read_text().splitlines()) == step
    assert read_metadata(out / f"checkpoint-{step}")["step"] == step

    resumed = build("finetune", {**over, "training.checkpoint.resume_from_checkpoint": "latest",
                                 "training.loop.max_train_steps": step + 2})
    assert resumed.start_step == step
    trainer = Trainer(resumed)
    summary = trainer.run()
    assert summary["final_step"] == step + 2 and [h["step"] for h in trainer.history] == [step + 1, step + 2]


@pytest.mark.multiproc
def test_sigterm_to_one_rank_stops_both_and_their_checkpoints_replay_exactly(tmp_path, latent_data):
    """Two processes: SIGTERM reaches rank 1 only; both stop at the same step with a checkpoint and
    exit 0. A second two-process run resumed from an earlier checkpoint of the first replays its
    last steps exactly (every rank's RNG and data position restored): same logged losses, same weights."""
    import psutil

    out_a, out_b = tmp_path / "a", tmp_path / "b"
    common = {"training.loop.gradient_accumulation_steps": 1, "training.tracker.log_every": 1}
    recipe_a = tmp_path / "a.yaml"
    over_a = small_overrides(
        out_a, latent_data, **common,
        **{"training.loop.max_train_steps": 1000, "training.checkpoint.training_state_checkpointing_steps": 1},
    )
    recipe_a.write_text(load_config(default_recipe("dfsft"), over_a).to_yaml())
    log_a = tmp_path / "a.log"
    launcher = _launch("train_dfsft.py", recipe_a, log_a, nproc=2)
    _wait_for_steps(launcher, out_a, 4, log_a)
    workers = [p for p in psutil.Process(launcher.pid).children(recursive=True) if "train_dfsft.py" in " ".join(p.cmdline())]
    by_rank = {int(p.environ()["RANK"]): p for p in workers}
    assert sorted(by_rank) == [0, 1]
    # gloo's socket and worker threads block SIGTERM (started under the mask the build sets), so
    # the signal goes to a thread whose handler only sets the stop flag.
    masks = thread_signal_masks(by_rank[1].pid)
    term = 1 << (signal.SIGTERM - 1)
    gloo = [mask for _, name, mask in masks if "gloo" in name]
    assert gloo and all(mask & term for mask in gloo), masks
    main_thread = [mask for tid, _, mask in masks if tid == by_rank[1].pid]
    assert main_thread == [main_thread[0]] and not main_thread[0] & term, masks
    by_rank[1].send_signal(signal.SIGTERM)
    assert wait_or_diagnose(launcher, 240, log_a) == 0, log_a.read_text()[-3000:]
    text = log_a.read_text()
    m = re.search(r"stopped by (?:SIGTERM|another rank's signal) after step (\d+): checkpoint saved in (\S+);", text)
    assert m, text[-3000:]
    step = int(m.group(1))
    ckpt = out_a / f"checkpoint-{step}"
    assert Path(m.group(2)) == ckpt == latest_checkpoint(out_a)
    assert read_metadata(ckpt)["world_size"] == 2
    gens = [load_file(str(ckpt / f"fv_rank_{r}.safetensors"))["rng/method_generator"] for r in (0, 1)]
    assert not torch.equal(gens[0], gens[1])  # each rank's own stream (seed + rank)
    logged_a = _logged_losses(out_a)
    assert sorted(logged_a) == list(range(1, step + 1))

    # Replay steps step-1 and step from checkpoint step-2, in a fresh output folder.
    recipe_b = tmp_path / "b.yaml"
    over_b = small_overrides(
        out_b, latent_data, **common,
        **{
            "training.loop.max_train_steps": step,
            "training.checkpoint.resume_from_checkpoint": str(out_a / f"checkpoint-{step - 2}"),
            "training.checkpoint.save_final": True,
        },
    )
    recipe_b.write_text(load_config(default_recipe("dfsft"), over_b).to_yaml())
    log_b = tmp_path / "b.log"
    assert wait_or_diagnose(_launch("train_dfsft.py", recipe_b, log_b, nproc=2), 300, log_b) == 0, log_b.read_text()[-3000:]
    logged_b = _logged_losses(out_b)
    assert logged_b == {step - 1: logged_a[step - 1], step: logged_a[step]}
    final = load_file(str(out_b / "transformer" / "diffusion_pytorch_model.safetensors"))
    saved = {k.removeprefix("module."): v for k, v in load_file(str(ckpt / "model.safetensors")).items()}
    assert final.keys() == saved.keys()
    assert all(torch.equal(final[k], saved[k]) for k in final)


@pytest.mark.parametrize("outcome,code", [("ok", 0), ("stopped", 1), ("crash", 1)])
def test_multi_process_entry_ends_without_interpreter_teardown(monkeypatch, capfd, outcome, code):
    """A gloo run of several processes ends with os._exit after flushing (its teardown can deadlock;
    see fv_accel.process.exit_without_teardown); a single-process run, or several processes on
    another backend (NCCL), return normally and raise as usual."""
    import fv_accel.build
    import fv_accel.cli as cli

    class FakeTrainer:
        def __init__(self, run):
            pass

        def run(self):
            if outcome == "stopped":
                raise TrainingStopped("nan at step 3", None)
            if outcome == "crash":
                raise RuntimeError("boom in step 7")

    def fake_run(processes, backend):
        accelerator = types.SimpleNamespace(num_processes=processes, state=types.SimpleNamespace(backend=backend))
        return lambda cfg: types.SimpleNamespace(accelerator=accelerator)

    exits = []
    monkeypatch.setattr(fv_accel.build, "build_from_config", fake_run(2, "gloo"))
    monkeypatch.setattr(trainer_module, "Trainer", FakeTrainer)
    monkeypatch.setattr(os, "_exit", exits.append)
    monkeypatch.setattr(logging, "shutdown", lambda: None)  # keep pytest's own log handlers open
    cli.main("finetune", [])
    assert exits == [code]
    if outcome == "crash":
        assert "RuntimeError: boom in step 7" in capfd.readouterr().err

    for processes, backend in ((1, None), (2, "nccl")):
        exits.clear()
        monkeypatch.setattr(fv_accel.build, "build_from_config", fake_run(processes, backend))
        if outcome == "crash":
            with pytest.raises(RuntimeError, match="boom in step 7"):
                cli.main("finetune", [])
        else:
            assert cli.main("finetune", []) == code
        assert exits == []
