"""training.optimizer.name: each optimizer that runs on CPU trains the tiny recipe, goes through a
checkpoint and resumes bit for bit (the one-block transformer of the resume tests), and keeps the state `optimizer_state_bytes` says; the recipe
keys of one optimizer are refused with another; a resume with another optimizer is refused unless
allowed, and then starts the new optimizer afresh."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from fv_accel.checkpoint import CheckpointError
from fv_accel.config import ConfigError, default_recipe, load_config
from fv_accel.optim import ADAMW_KERNEL_ARGS, adamw_implementation, check_optimizer_engine, optimizer_state_bytes
from fv_accel.trainer import Trainer, TrainerCallback
from tests.resume_helpers import SMALL_TRANSFORMER, build, small_overrides, weights, write_latent_dataset

# Prodigy adapts its step size; its learning rate multiplies it (usually 1.0).
LEARNING_RATE = {"adamw": 1e-3, "adamw_8bit": 1e-3, "prodigy": 1.0, "adafactor": 1e-3}


class Capture(TrainerCallback):
    """The optimizer's state dict after the given step, and which parameters start all zero."""

    def __init__(self, step: int):
        self.step, self.state, self.all_zero = step, None, None

    def on_train_start(self, trainer):
        self.all_zero = [not p.any() for p in trainer.method.student.trainable_parameters()]

    def on_step_end(self, trainer, step, logs):
        if step == self.step:
            self.state = _clone(trainer.method.optimizer.state_dict())


def _clone(tree):
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_clone(v) for v in tree)
    return tree


def _assert_same(a, b, where="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b or (a != a and b != b), f"{where}: {a!r} != {b!r}"


def _state_bytes(optimizer) -> int:
    """Bytes of every tensor in the optimizer's state, each storage once (bitsandbytes shares its code books)."""
    seen, total = set(), 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() not in seen:
                seen.add(value.untyped_storage().data_ptr())
                total += value.untyped_storage().nbytes()
    return total


# The one-block transformer of the resume tests, with a text width of 256: its text projection
# (256 x 16 = 4096 elements) is large enough for bitsandbytes' 8-bit state, the rest stays fp32.
TEXT_DIM = 256


@pytest.fixture(scope="module")
def latent_data(tmp_path_factory):
    return write_latent_dataset(tmp_path_factory.mktemp("latents"), num_clips=4, text_dim=TEXT_DIM)


def _overrides(tmp_path, data_path, name, folder, **extra):
    return small_overrides(
        tmp_path / folder,
        data_path,
        **{
            "models.student.transformer_config": {**SMALL_TRANSFORMER, "text_dim": TEXT_DIM},
            "training.optimizer.name": name,
            "training.optimizer.learning_rate": LEARNING_RATE[name],
            "training.optimizer.lr_warmup_steps": 1,
            "training.loop.gradient_accumulation_steps": 1,
            "training.loop.max_train_steps": 4,
            "training.checkpoint.training_state_checkpointing_steps": 2,
            "callbacks.ema.enable": False,
            **extra,
        },
    )


@pytest.mark.parametrize("name", ["adamw", "adamw_8bit", "prodigy", "adafactor"])
def test_optimizer_trains_checkpoints_and_resumes_exactly(tmp_path, latent_data, name, caplog):
    over = _overrides(tmp_path, latent_data, name, "run")
    with caplog.at_level(logging.INFO, logger="fv_accel.optim"):
        run = build("finetune", over)
    assert {"adamw": "optimizer AdamW (fused)", "adamw_8bit": "optimizer AdamW8bit (bitsandbytes 0.50.2)",
            "prodigy": "optimizer Prodigy (d_coef 1", "adafactor": "optimizer Adafactor"}[name] in caplog.text
    if name == "adafactor":
        assert "betas [0.9, 0.999] and eps 1e-08 are not used by Adafactor" in caplog.text
    start = weights(run)
    capture = Capture(2)
    full = Trainer(run, callbacks=[*run.callbacks, capture])
    full.run()
    losses = [h["loss"] for h in full.history]
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses)
    end = weights(run)
    assert any(not torch.equal(start[k], end[k]) for k in start), "the optimizer moved no weight"

    # State after one step and more: exactly what optimizer_state_bytes says for these tensors.
    params = run.method.student.trainable_parameters()
    expected = optimizer_state_bytes(
        name, [tuple(p.shape) for p in params], params[0].dtype, all_zero=capture.all_zero
    )
    assert _state_bytes(run.method.optimizer) == expected
    if name == "adamw_8bit":  # the 8-bit path ran (tensors of >= 4096 elements) next to the fp32 one
        dtypes = {s["state1"].dtype for s in run.method.optimizer.state.values()}
        assert dtypes == {torch.uint8, torch.float32}

    # Resume from step 2: the optimizer's state comes back as it was, and so do the last two steps.
    ckpt = tmp_path / "run" / "checkpoint-2"
    resumed_run = build("finetune", {**over, "training.checkpoint.resume_from_checkpoint": str(ckpt)})
    assert resumed_run.start_step == 2
    _assert_same(capture.state, resumed_run.method.optimizer.state_dict())
    resumed = Trainer(resumed_run)
    resumed.run()
    assert [h["loss"] for h in resumed.history] == losses[2:]
    resumed_end = weights(resumed_run)
    for key, value in end.items():
        assert torch.equal(value, resumed_end[key]), key


def test_a_resume_with_another_optimizer_is_refused_unless_allowed(tmp_path, latent_data, caplog):
    over = _overrides(tmp_path, latent_data, "adamw", "run", **{"training.loop.max_train_steps": 3})
    Trainer(build("finetune", over)).run()
    prodigy = {**over, "training.optimizer.name": "prodigy", "training.optimizer.learning_rate": 1.0,
               "training.checkpoint.resume_from_checkpoint": str(tmp_path / "run" / "checkpoint-2")}
    with pytest.raises(CheckpointError) as err:
        build("finetune", prodigy)
    assert "training.optimizer.name: 'adamw' in the checkpoint, 'prodigy' now" in str(err.value)
    assert "training.checkpoint.allow_recipe_change" in str(err.value)
    with caplog.at_level(logging.WARNING):
        run = build("finetune", {**prodigy, "training.checkpoint.allow_recipe_change": True})
    assert run.start_step == 2 and type(run.method.optimizer.optimizer).__name__ == "Prodigy"
    assert "the optimizer starts with fresh state" in caplog.text
    assert len(run.method.optimizer.state) == 0  # nothing of AdamW's moments
    Trainer(run).run()
    assert len(run.method.optimizer.state) == len(run.method.student.trainable_parameters())


def test_fused_adamw_on_cpu_matches_the_for_loop_within_1e_6():
    torch.manual_seed(0)
    shapes = [(96, 96), (96,), (192, 96), (16, 4)]
    start = [torch.randn(s) for s in shapes]
    grads = [[torch.randn(s) for s in shapes] for _ in range(5)]
    result = {}
    for impl in ("fused", "for_loop"):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        assert adamw_implementation("auto" if impl == "fused" else impl, params) == impl
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, **ADAMW_KERNEL_ARGS[impl])
        for step in grads:
            for p, g in zip(params, step):
                p.grad = g.clone()
            opt.step()
        result[impl] = params
    moved = max((p - s).abs().max().item() for p, s in zip(result["for_loop"], start))
    diff = max((a - b).abs().max().item() for a, b in zip(result["fused"], result["for_loop"]))
    assert moved > 1e-3 and diff <= 1e-6, (moved, diff)


def test_fused_adamw_refuses_parameters_without_the_kernel():
    with pytest.raises(ConfigError, match="training.optimizer.implementation: fused needs floating-point parameters"):
        adamw_implementation("fused", [torch.zeros(3, dtype=torch.int64)])
    assert adamw_implementation("auto", [torch.zeros(3, dtype=torch.int64)]) == "for_loop"


@pytest.mark.parametrize(
    "change,message",
    [
        ({"training.optimizer.name": "prodigy", "training.optimizer.implementation": "fused"},
         "key 'training.optimizer.implementation': expected auto with name 'prodigy'"),
        ({"training.optimizer.prodigy_d_coef": 2.0},
         "key 'training.optimizer.prodigy_d_coef': expected its default with name 'adamw' (it applies to prodigy only), got 2.0"),
        ({"training.optimizer.name": "prodigy", "training.optimizer.prodigy_d_coef": 0.0},
         "key 'training.optimizer.prodigy_d_coef': expected a number > 0, got 0.0"),
        ({"training.optimizer.name": "sgd"}, "key 'training.optimizer.name': expected one of 'adamw', 'adamw_8bit'"),
    ],
    ids=["implementation", "prodigy-key", "d_coef", "name"],
)
def test_optimizer_keys_are_validated(change, message):
    with pytest.raises(ConfigError) as err:
        load_config(default_recipe("finetune"), change)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_missing_optimizer_library_is_one_line(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(ConfigError) as err:
        load_config(default_recipe("finetune"), {"training.optimizer.name": "adamw_8bit"})
    assert str(err.value).endswith(
        "training.optimizer.name: adamw_8bit needs bitsandbytes (pip install bitsandbytes==0.50.2)"
    )


def test_only_adamw_runs_under_the_sharding_engines():
    cfg = load_config(default_recipe("finetune"), {"training.optimizer.name": "adafactor"})
    for engine, shown in (("fsdp2", "FSDP2"), ("deepspeed", "DeepSpeed")):
        with pytest.raises(ConfigError, match=f"training.optimizer.name: adafactor does not run under {shown}"):
            check_optimizer_engine(cfg, engine)
    check_optimizer_engine(cfg, "ddp")
    check_optimizer_engine(load_config(default_recipe("finetune")), "fsdp2")
