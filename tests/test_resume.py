"""Exact resume: a run cut by SIGTERM at step 5 and resumed equals an uninterrupted run, step for
step and bit for bit (CPU), for both methods, full and LoRA, with gradient accumulation 2."""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from fv_accel.checkpoint import CheckpointError, latest_checkpoint, read_metadata
from fv_accel.trainer import Trainer, TrainerCallback
from tests.resume_helpers import build, ema_shadow, reset_accelerate, small_overrides, weights, write_latent_dataset


@pytest.fixture(scope="module")
def latent_data(tmp_path_factory):
    # 6 clips, 2 per optimizer step: 3 steps an epoch, so step 5 is mid-epoch 1.
    return write_latent_dataset(tmp_path_factory.mktemp("latents"), num_clips=6)


class SignalAtStep(TrainerCallback):
    """Sends this process a real SIGTERM after the given step (what a preemption does)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, trainer, step, logs):
        if step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def _losses(trainer):
    return [(h["step"], h["loss"], h["lr"], h["grad_norm"]) for h in trainer.history]


LORA = {"models.student.lora.enable": True, "models.student.lora.rank": 4}


@pytest.mark.slow
@pytest.mark.parametrize(
    "method,extra",
    [("finetune", {}), ("dfsft", {}), ("finetune", LORA), ("dfsft", LORA)],
    ids=["finetune-full", "dfsft-full", "finetune-lora", "dfsft-lora"],
)
def test_resumed_run_equals_uninterrupted_run(tmp_path, latent_data, method, extra, monkeypatch):
    full_run = build(method, small_overrides(tmp_path / "full", latent_data, **extra))
    full = Trainer(full_run)
    full.run()
    full_weights = weights(full_run)
    full_ema = ema_shadow(full_run)
    assert full_ema, "the EMA callback should be on (its state is part of the checkpoint)"

    first_run = build(method, small_overrides(tmp_path / "cut", latent_data, **extra))
    first = Trainer(first_run, callbacks=[*first_run.callbacks, SignalAtStep(5)])
    summary = first.run()
    assert summary["stopped_by"] == "SIGTERM" and summary["final_step"] == 5
    ckpt = tmp_path / "cut" / "checkpoint-5"
    assert latest_checkpoint(tmp_path / "cut") == ckpt
    # Nothing in the checkpoint needs unpickling but the optimizer/scheduler state (weights_only).
    assert not list(ckpt.glob("*.pkl"))
    assert {"metadata.json", "fv_rank_0.safetensors", "optimizer.bin", "scheduler.bin"} <= {p.name for p in ckpt.iterdir()}
    with safe_open(str(ckpt / "fv_rank_0.safetensors"), framework="pt") as fh:
        keys = set(fh.keys())
    assert {"rng/python", "rng/numpy", "rng/torch", "rng/method_generator"} <= keys
    # The EMA shadow: one file of full tensors (not a copy per rank).
    assert not any(k.startswith("extra/") for k in keys)
    with safe_open(str(ckpt / "ema.safetensors"), framework="pt") as fh:
        assert set(fh.keys()) == {f"shadow.{i}" for i in range(len(full_ema))}
        assert fh.metadata()["num_updates"] == "5"
    meta = read_metadata(ckpt)
    assert meta["step"] == 5 and meta["epoch"] == 1 and meta["data"]["step_in_epoch"] == 2
    assert meta["versions"]["torch"] == torch.__version__
    assert meta["config"]["method"]["name"] == method
    assert meta["config"]["models"]["student"]["lora"]["enable"] == bool(extra)

    loads = []
    real_load = torch.load

    def recording_load(*args, **kwargs):
        loads.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", recording_load)
    resumed_run = build(
        method, small_overrides(tmp_path / "cut", latent_data, **extra, **{"training.checkpoint.resume_from_checkpoint": "latest"})
    )
    monkeypatch.setattr(torch, "load", real_load)
    assert resumed_run.start_step == 5
    assert loads and all(w is True for w in loads), loads  # optimizer.bin, scheduler.bin
    resumed = Trainer(resumed_run)
    resumed.run()

    # Per-step loss, LR and gradient norm identical (float equality, not closeness).
    assert _losses(first) + _losses(resumed) == _losses(full)
    assert [h["step"] for h in resumed.history] == [6, 7, 8, 9, 10]
    resumed_weights = weights(resumed_run)
    assert resumed_weights.keys() == full_weights.keys()
    for name, value in full_weights.items():
        assert torch.equal(value, resumed_weights[name]), name
    resumed_ema = ema_shadow(resumed_run)
    assert len(resumed_ema) == len(full_ema)
    assert all(torch.equal(a, b) for a, b in zip(full_ema, resumed_ema))
    # The run trained: the weights moved from the initial ones.
    fresh = weights(build(method, small_overrides(tmp_path / "fresh", latent_data, **extra)))
    assert any(not torch.equal(fresh[n], full_weights[n]) for n in full_weights)


@pytest.fixture(scope="module")
def dfsft_checkpoint(tmp_path_factory, latent_data):
    """A DFSFT run of 2 steps with its checkpoint at step 2, the last (chunk 3, shift 3)."""
    out = tmp_path_factory.mktemp("dfsft_run") / "out"
    over = small_overrides(
        out, latent_data, **{"training.loop.max_train_steps": 2, "training.checkpoint.training_state_checkpointing_steps": 2}
    )
    run = build("dfsft", over)
    Trainer(run).run()
    reset_accelerate()
    assert latest_checkpoint(out) == out / "checkpoint-2"
    return over


def _snapshot(folder):
    return sorted((str(p.relative_to(folder)), p.stat().st_size) for p in folder.rglob("*") if p.is_file())


@pytest.mark.parametrize(
    "method,change,message",
    [
        ("dfsft", {"method.chunk_size": 1}, "method.chunk_size: 3 in the checkpoint, 1 now"),
        ("dfsft", {"models.student.flow_shift": 5.0}, "models.student.flow_shift: 3.0 in the checkpoint, 5.0 now"),
        ("finetune", {}, "method.name: 'dfsft' in the checkpoint, 'finetune' now"),
    ],
    ids=["chunk_size", "shift", "method"],
)
def test_resume_refuses_a_recipe_that_changes_the_math(dfsft_checkpoint, method, change, message):
    out = dfsft_checkpoint["training.checkpoint.output_dir"]
    before = _snapshot(Path(out))
    over = {**dfsft_checkpoint, **change, "training.checkpoint.resume_from_checkpoint": "latest"}
    with pytest.raises(CheckpointError) as err:
        build(method, over)
    text = str(err.value)
    assert message in text
    assert "checkpoint-2" in text and "training.checkpoint.allow_recipe_change" in text
    assert _snapshot(Path(out)) == before  # nothing written


def test_resume_warns_on_a_longer_schedule_and_can_be_forced(dfsft_checkpoint, caplog):
    over = {**dfsft_checkpoint, "training.checkpoint.resume_from_checkpoint": "latest", "training.loop.max_train_steps": 4}
    with caplog.at_level(logging.WARNING, logger="fv_accel.checkpoint"):
        run = build("dfsft", over)
    assert run.start_step == 2
    assert "training.loop.max_train_steps: 2 in the checkpoint, 4 now" in caplog.text
    caplog.clear()
    forced = {**over, "models.student.flow_shift": 5.0, "training.checkpoint.allow_recipe_change": True}
    with caplog.at_level(logging.WARNING, logger="fv_accel.checkpoint"):
        run = build("dfsft", forced)
    assert run.start_step == 2
    assert "models.student.flow_shift: 3.0 in the checkpoint, 5.0 now" in caplog.text


def test_resume_from_a_folder_that_is_not_a_checkpoint(tmp_path, latent_data):
    bogus = tmp_path / "not-a-checkpoint"
    bogus.mkdir()
    over = small_overrides(tmp_path / "out", latent_data, **{"training.checkpoint.resume_from_checkpoint": str(bogus)})
    with pytest.raises(CheckpointError, match=r"has no metadata\.json; it is not a complete fv_accel checkpoint"):
        build("finetune", over)
    (bogus / "metadata.json").write_text(json.dumps({"step": 3}))
    with pytest.raises(CheckpointError, match=r"not an fv_accel checkpoint"):
        build("finetune", over)
    assert not (tmp_path / "out").exists()
