"""EMA of the trainable weights: the formula, skipped steps, exact resume and the exported copy."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import tiny_overrides

DECAY = 0.7  # far from 1, so that a few steps move the average visibly


def test_ema_update_and_swap_are_exact():
    from fv_accel.ema import EmaWeights

    p = torch.nn.Parameter(torch.tensor([1.0, 2.0], dtype=torch.bfloat16))
    ema = EmaWeights([p], decay=0.5, device=torch.device("cpu"))
    assert ema.shadow[0].dtype == torch.float32  # fp32 shadow of bf16 weights
    with torch.no_grad():
        p.copy_(torch.tensor([3.0, 4.0]))
    ema.update()
    assert ema.shadow[0].tolist() == [2.0, 3.0]  # 0.5 * [1, 2] + 0.5 * [3, 4]
    with torch.no_grad():
        p.copy_(torch.tensor([5.0, 8.0]))
    ema.update()
    assert ema.shadow[0].tolist() == [3.5, 5.5]
    assert ema.num_updates == 2
    with ema.applied():
        assert p.tolist() == [3.5, 5.5]
    assert p.tolist() == [5.0, 8.0]  # restored bit for bit
    with pytest.raises(ValueError, match="callbacks.ema.decay"):
        EmaWeights([p], decay=1.0)


@pytest.mark.parametrize("group_numel", [None, 16])
def test_ema_update_over_all_tensors_equals_lerp_per_tensor(group_numel, monkeypatch):
    from fv_accel import ema as ema_module
    from fv_accel.ema import EmaWeights

    if group_numel is not None:  # groups of at most 16 elements: [15], [7], [24]
        monkeypatch.setattr(ema_module, "UPDATE_GROUP_NUMEL", group_numel)
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in ((5, 3), (7,), (2, 3, 4))]
    ema = EmaWeights(params, decay=0.9, device=torch.device("cpu"))
    assert ema.groups == ([[0], [1], [2]] if group_numel else [[0, 1, 2]])
    reference = [p.detach().clone() for p in params]
    for _ in range(3):
        with torch.no_grad():
            for p in params:
                p.add_(torch.randn(p.shape, generator=g))
        ema.update()
        for r, p in zip(reference, params):
            r.lerp_(p.detach(), 1.0 - 0.9)
    for s, r in zip(ema.shadow, reference):
        assert torch.equal(s, r)
    # A sharded run's local shard can be empty (FSDP2 on a rank that holds none of a small tensor).
    empty_first = EmaWeights([torch.nn.Parameter(torch.zeros(0)), *params], decay=0.9, device=torch.device("cpu"))
    assert empty_first.groups == ([[0, 1], [2], [3]] if group_numel else [[0, 1, 2, 3]])
    empty_first.update()


def test_ema_callback_skips_steps_the_trainer_skipped():
    from fv_accel.ema import EmaCallback

    p = torch.nn.Parameter(torch.zeros(1))
    trainer = SimpleNamespace(
        method=SimpleNamespace(student=SimpleNamespace(trainable_parameters=lambda: [p])),
        accelerator=SimpleNamespace(is_main_process=False),
        skipped_steps=0,
    )
    cb = EmaCallback(decay=0.5)
    cb.on_train_start(trainer)
    with torch.no_grad():
        p.fill_(4.0)
    cb.on_step_end(trainer, 1, {})
    assert cb.ema.shadow[0].item() == 2.0
    trainer.skipped_steps = 1  # step 2 was skipped (non-finite loss): no optimizer update
    cb.on_step_end(trainer, 2, {})
    assert cb.ema.shadow[0].item() == 2.0 and cb.ema.num_updates == 1
    cb.on_step_end(trainer, 3, {})
    assert cb.ema.shadow[0].item() == 3.0


class RecordWeights:
    """Records the trainable weights at the start and after every step (runs after the EMA)."""

    def __init__(self):
        self.weights: list[list[torch.Tensor]] = []

    def _record(self, trainer):
        self.weights.append([p.detach().double().clone() for p in trainer.method.student.trainable_parameters()])

    def on_train_start(self, trainer):
        self._record(trainer)

    def on_step_end(self, trainer, step, logs):
        self._record(trainer)

    def on_train_end(self, trainer): ...

    def state_tensors(self):
        return {}

    def load_state_tensors(self, tensors): ...

    def summary(self):
        return {}


def ema_overrides(tmp_path, **extra):
    return tiny_overrides(
        tmp_path,
        **{
            "callbacks.ema.enable": True,
            "callbacks.ema.decay": DECAY,
            "training.loop.max_train_steps": 4,
            "training.optimizer.lr_warmup_steps": 0,
            **extra,
        },
    )


def build(overrides, callbacks=None):
    from fv_accel.build import build_from_config
    from fv_accel.config import default_recipe

    return build_from_config(default_recipe("finetune"), overrides, callbacks=callbacks)


def reset_accelerate():
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def test_ema_of_a_run_equals_the_closed_form_and_is_exported(tmp_path):
    from safetensors.torch import load_file

    from fv_accel.ema import EmaCallback
    from fv_accel.trainer import Trainer

    recorder = RecordWeights()
    run = build(ema_overrides(tmp_path), callbacks=[recorder])
    ema_cb = run.callbacks[0]
    assert isinstance(ema_cb, EmaCallback)
    Trainer(run).run()

    w = recorder.weights
    k = len(w) - 1
    assert k == 4
    moved = 0.0
    for i, shadow in enumerate(ema_cb.ema.shadow):
        # ema_k = d^k w_0 + sum_{j=1..k} (1 - d) d^(k-j) w_j, in float64
        expected = DECAY**k * w[0][i] + sum((1 - DECAY) * DECAY ** (k - j) * w[j][i] for j in range(1, k + 1))
        torch.testing.assert_close(shadow.double(), expected, atol=2e-6, rtol=1e-5)
        moved = max(moved, float((shadow.double() - w[-1][i]).abs().max()))
    assert moved > 1e-4  # the average lags the weights: the comparison above is not trivial

    # Exported beside the raw weights, with the same names.
    model = run.accelerator.unwrap_model(run.method.student.transformer)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    exported = load_file(str(tmp_path / "out" / "ema" / "transformer" / "diffusion_pytorch_model.safetensors"))
    raw = load_file(str(tmp_path / "out" / "transformer" / "diffusion_pytorch_model.safetensors"))
    for name, shadow in zip(names, ema_cb.ema.shadow):
        assert torch.equal(exported[name], shadow), name
        assert torch.equal(raw[name], dict(model.named_parameters())[name].detach()), name


def test_resumed_ema_continues_exactly(tmp_path):
    from fv_accel.trainer import Trainer

    straight = build(ema_overrides(tmp_path / "a", **{"training.checkpoint.training_state_checkpointing_steps": 2}))
    Trainer(straight).run()
    straight_ema = [s.clone() for s in straight.callbacks[0].ema.shadow]
    straight_updates = straight.callbacks[0].ema.num_updates
    checkpoint = tmp_path / "a" / "out" / "checkpoint-2"
    assert checkpoint.is_dir()
    reset_accelerate()

    resumed = build(ema_overrides(tmp_path / "b", **{"training.checkpoint.resume_from_checkpoint": str(checkpoint)}))
    assert resumed.start_step == 2
    Trainer(resumed).run()
    ema = resumed.callbacks[0].ema
    assert ema.num_updates == straight_updates == 4
    for a, b in zip(straight_ema, ema.shadow):
        assert torch.equal(a, b)
