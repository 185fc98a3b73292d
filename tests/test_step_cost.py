"""Step-cost fixes found by benchmarks/step_overhead.py, each exact:
- WanStudent embeds per-frame timesteps once per frame (PerFrameTimeEmbedding): the same outputs
  and gradients as diffusers' per-token path, with the time MLP's FLOPs cut by the tokens per frame;
- the Trainer scales gradients only when their norm is over the limit: the same gradients and norm
  as torch's clip_grad_norm_, without its pass over every gradient when nothing changes;
- a step reads the device once (the non-finite check, which carries the gradient norm and the stop
  request) except on the steps that log."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from fv_accel.config import load_config
from fv_accel.models.base import TrainingBatch
from fv_accel.models.wan import WanStudent


def _student():
    torch.manual_seed(0)
    cfg = load_config("configs/tiny_dfsft.yaml")
    student = WanStudent(cfg)
    student.init_preprocessors(cfg.training)
    return student, cfg.models.student.transformer_config


def _step(student, x, t, tb, *, per_frame: bool):
    saved = student.per_frame_time_embeddings
    if not per_frame:
        student.per_frame_time_embeddings = []  # diffusers' own per-token path
    student.transformer.zero_grad(set_to_none=True)
    try:
        with FlopCounterMode(display=False) as counter:
            out = student.predict_noise(x, t, tb)
            out.pow(2).mean().backward()
    finally:
        student.per_frame_time_embeddings = saved
    grads = {n: p.grad.clone() for n, p in student.transformer.named_parameters()}
    return out.detach(), grads, counter.get_total_flops()


def test_per_frame_embedding_matches_per_token_path_with_fewer_flops():
    student, tc = _student()
    B, T, H, W = 2, 6, 6, 8
    x = torch.randn(B, 16, T, H, W)
    t = torch.rand(B, T) * 1000
    tb = TrainingBatch(encoder_hidden_states=torch.randn(B, 12, tc["text_dim"]))

    out_frames, grads_frames, flops_frames = _step(student, x, t, tb, per_frame=True)
    out_tokens, grads_tokens, flops_tokens = _step(student, x, t, tb, per_frame=False)

    assert torch.equal(out_frames, out_tokens)
    for name, g in grads_tokens.items():
        torch.testing.assert_close(grads_frames[name], g, rtol=1e-5, atol=1e-7, msg=name)
    # The time MLP (freq -> D -> D -> 6D) runs on B*T rows instead of B*T*(H/2)*(W/2): forward
    # 2*(f*D + D*D + D*6D) per row; backward the weight gradient of all three and the input
    # gradient of the last two.
    f, D = tc["freq_dim"], tc["num_attention_heads"] * tc["attention_head_dim"]
    rows_saved = B * T * (H // 2) * (W // 2) - B * T
    forward = 2 * (f * D + D * D + D * 6 * D)
    backward = forward + 2 * (D * D + D * 6 * D)
    assert flops_tokens - flops_frames == rows_saved * (forward + backward)
    assert student.per_frame_time_embeddings[0].tokens_per_frame is None  # reset after the call


def test_homogeneous_timesteps_leave_the_embedder_alone():
    student, tc = _student()
    x = torch.randn(2, 16, 3, 4, 4)
    tb = TrainingBatch(encoder_hidden_states=torch.randn(2, 5, tc["text_dim"]))
    calls = []
    handle = student.transformer.condition_embedder.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append((tuple(args[0].shape), kwargs.get("timestep_seq_len"))),
        with_kwargs=True,
    )
    try:
        student.predict_noise(x, torch.tensor([10.0, 900.0]), tb)
        student.predict_noise(x, torch.tensor([[10.0, 500.0, 900.0]] * 2), tb)
    finally:
        handle.remove()
    # [B] stays [B]; per-frame [B, T] reaches the MLP as B*T timesteps with a sequence of T (the
    # hooks run in registration order: ours first, then the probe above).
    assert calls == [((2,), None), ((6,), 3)]


def _grads(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in ((7, 5), (11,), (3, 4, 2))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    return params


@pytest.mark.parametrize("limit_over_norm", [0.5, 2.0, 0.0])
def test_clipping_matches_torch_and_skips_the_pass_under_the_limit(monkeypatch, limit_over_norm):
    from accelerate import Accelerator

    from fv_accel.trainer import Trainer

    ours, reference = _grads(), _grads()
    norm = float(torch.nn.utils.get_total_norm([p.grad for p in reference]))
    max_norm = limit_over_norm * norm  # 0.0: clipping off (the norm is still taken)
    expected_norm = torch.nn.utils.clip_grad_norm_(reference, max_norm if max_norm > 0 else float("inf"))

    passes = []
    original = torch.nn.utils.clip_grads_with_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grads_with_norm_", lambda *a, **k: passes.append(1) or original(*a, **k))
    trainer = Trainer.__new__(Trainer)  # only what clipping reads
    trainer.accelerator, trainer.steps_in_backward = Accelerator(cpu=True), False
    got_norm, clipped = trainer._grad_norm(ours, max_norm)  # the trainer's path without an engine
    assert not clipped
    trainer._clip_to(ours, max_norm, got_norm, float(got_norm))

    assert torch.equal(got_norm, expected_norm)
    for a, b in zip(ours, reference):
        assert torch.equal(a.grad, b.grad)
    assert len(passes) == (1 if limit_over_norm == 0.5 else 0)
    if limit_over_norm == 0.5:
        assert float(torch.nn.utils.get_total_norm([p.grad for p in ours])) == pytest.approx(max_norm, rel=1e-5)


def test_target_norms_come_from_one_fused_reduction_bitwise_as_torch(monkeypatch):
    """`target_grad_norms`: each target's norm bit for bit what torch.nn.utils.get_total_norm gives
    (mixed dtypes, a parameter without a gradient, a target without any), from one _foreach_norm
    per dtype over all targets."""
    from fv_accel.trainer import target_grad_norms

    student, critic = _grads(0), _grads(1)
    half = torch.nn.Parameter(torch.randn(6, 3, dtype=torch.bfloat16))
    half.grad = torch.randn(6, 3, dtype=torch.bfloat16)
    no_grad = torch.nn.Parameter(torch.randn(4))
    critic = [critic[0], half, no_grad, *critic[1:]]
    empty = [torch.nn.Parameter(torch.randn(2))]
    calls = []
    original = torch._foreach_norm
    monkeypatch.setattr(torch, "_foreach_norm", lambda tensors, *a, **k: calls.append(len(tensors)) or original(tensors, *a, **k))
    got = target_grad_norms([student, critic, empty])
    assert calls == [6, 1]  # the fp32 gradients of both targets in one call, the bf16 one in another
    monkeypatch.setattr(torch, "_foreach_norm", original)
    for norm, params in zip(got, (student, critic, empty)):
        expected = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        assert norm.dtype == expected.dtype and torch.equal(norm, expected)
    assert float(got[2]) == 0.0


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "grad-checkpointing"])
def test_blocks_modulate_per_frame_and_match_diffusers_per_token_blocks(checkpointing):
    """The blocks get the [B, T, 6, D] projection (not diffusers' [B, S, 6, D] copy) and give
    diffusers' values: equal outputs, gradients to fp32 summation order."""
    student, tc = _student()
    if checkpointing:
        student.transformer.enable_gradient_checkpointing()
    B, T, H, W = 2, 6, 6, 8
    D = tc["num_attention_heads"] * tc["attention_head_dim"]
    x = torch.randn(B, 16, T, H, W)
    t = torch.rand(B, T) * 1000
    tb = TrainingBatch(encoder_hidden_states=torch.randn(B, 12, tc["text_dim"]))
    seen = []
    handles = [
        block.register_forward_pre_hook(lambda module, args: seen.append(tuple(args[2].shape)))
        for block in student.transformer.blocks
    ]
    try:
        out_frames, grads_frames, _ = _step(student, x, t, tb, per_frame=True)
        frames_seen, seen[:] = list(seen), []
        out_tokens, grads_tokens, _ = _step(student, x, t, tb, per_frame=False)
    finally:
        for handle in handles:
            handle.remove()
    tokens = T * (H // 2) * (W // 2)
    assert set(frames_seen) == {(B, T, 6, D)} and set(seen) == {(B, tokens, 6, D)}
    assert torch.equal(out_frames, out_tokens)
    for name, g in grads_tokens.items():
        torch.testing.assert_close(grads_frames[name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_per_sample_timesteps_run_diffusers_own_block_forward():
    student, tc = _student()
    x = torch.randn(2, 16, 3, 4, 4)
    tb = TrainingBatch(encoder_hidden_states=torch.randn(2, 5, tc["text_dim"]))
    block = student.transformer.blocks[0]
    calls = []
    original = block.forward.original
    block.forward.original = lambda *args: calls.append(tuple(args[2].shape)) or original(*args)
    try:
        student.predict_noise(x, torch.tensor([10.0, 900.0]), tb)
    finally:
        block.forward.original = original
    D = tc["num_attention_heads"] * tc["attention_head_dim"]
    assert calls == [(2, 6, D)]


# Tensor methods and torch functions whose result the host needs before it goes on (a value, a
# data-dependent size or an answer): on an accelerator each waits for the device, a sync.
HOST_READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "cpu", "numpy", "nonzero", "unique",
              "equal", "allclose", "masked_select")
TORCH_SYNCS = ("nonzero", "unique", "equal", "allclose", "masked_select", "isclose")


def _count_step_syncs(monkeypatch, recipe: str, overrides: dict, steps: int) -> dict[int, list[str]]:
    """The host reads (syncs on an accelerator) each step makes, counted on CPU by wrapping the
    tensor methods and torch functions that read a value on the host (and torch.cuda.synchronize),
    for calls made by fv_accel's code on the training thread outside the data loader (whose sample
    indices live on the host)."""
    import sys
    import threading
    from pathlib import Path

    import fv_accel
    from fv_accel.build import build_from_config
    from fv_accel.trainer import Trainer, TrainerCallback

    package = str(Path(fv_accel.__file__).parent)
    loader_dir = str(Path(fv_accel.__file__).parent / "data")
    reads: list[str] = []
    counting = [False]
    training_thread = threading.current_thread()

    def wrap(owner, name):
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            if counting[0] and threading.current_thread() is training_thread:
                frame = sys._getframe(1)
                where = frame.f_code.co_filename
                if where.startswith(package) and not where.startswith(loader_dir):
                    reads.append(f"{name} at {Path(where).name}:{frame.f_lineno}")
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)

    for name in HOST_READS:
        wrap(torch.Tensor, name)
    for name in TORCH_SYNCS:
        wrap(torch, name)
    wrap(torch.cuda, "synchronize")

    per_step: dict[int, list[str]] = {}

    class Count(TrainerCallback):
        def on_train_start(self, trainer):
            counting[0] = True
            reads.clear()

        def on_step_end(self, trainer, step, logs):
            per_step[step] = list(reads)
            reads.clear()

    run = build_from_config(recipe, overrides, callbacks=[Count()])
    try:
        Trainer(run).run()
    finally:
        counting[0] = False
    assert sorted(per_step) == list(range(1, steps + 1))
    return per_step


@pytest.mark.parametrize(
    "recipe, max_norm",
    [("configs/tiny_finetune.yaml", 1.0), ("configs/tiny_finetune.yaml", 1e-4), ("configs/tiny_dfsft.yaml", 1e-4)],
    ids=["finetune", "finetune-clipping", "dfsft-clipping"],
)
def test_a_step_reads_the_device_once_except_on_log_steps(monkeypatch, tmp_path, tiny_data_path, recipe, max_norm):
    """One sync per step (the non-finite check, which carries the gradient norm and the stop request),
    also when the gradients are clipped (a max norm far under the norm: the scaling uses the value that
    check read) and for DFSFT's per-frame timesteps; the logged values add one on the steps that log."""
    from tests.conftest import tiny_overrides

    steps, log_every = 8, 4
    overrides = tiny_overrides(tmp_path, **{
        "training.data.data_path": tiny_data_path, "training.loop.max_train_steps": steps,
        "training.tracker.log_every": log_every, "callbacks.grad_clip.max_grad_norm": max_norm,
    })
    per_step = _count_step_syncs(monkeypatch, recipe, overrides, steps)

    log_steps = {1, log_every, 2 * log_every, steps}
    for step, where in per_step.items():
        if step in log_steps:
            assert len(where) >= 2, (step, where)  # the check, and the logged values
        else:
            assert len(where) == 1 and where[0].startswith("tolist at trainer.py"), (step, where)


@pytest.mark.slow
def test_a_two_target_step_reads_the_device_once(monkeypatch, tmp_path):
    """DMD2's steps clip the critic, and every `generator_update_interval` steps the student too:
    both norms come from one fused reduction and travel in the one check. The method's own draw of
    the rollout's exit step (dmd2.py) is its own read, not the loop's."""
    from tests.dmd2_helpers import DMD2_RECIPE, dmd2_overrides

    steps = 4
    overrides = dmd2_overrides(tmp_path, **{"method.generator_update_interval": 2, "training.tracker.log_every": 100,
                                            "callbacks.grad_clip.max_grad_norm": 1e-4})
    norm_calls = []
    original = torch._foreach_norm
    monkeypatch.setattr(torch, "_foreach_norm", lambda tensors, *a, **k: norm_calls.append(len(tensors)) or original(tensors, *a, **k))
    per_step = _count_step_syncs(monkeypatch, DMD2_RECIPE, overrides, steps)

    for step, where in per_step.items():
        loop = [w for w in where if " at dmd2.py:" not in w]
        if step in (1, steps):
            assert len(loop) >= 2, (step, loop)  # the check, and the logged values
        else:
            assert loop == [w for w in loop if w.startswith("tolist at trainer.py")] and len(loop) == 1, (step, loop)
    # One fused norm per step: over both models' gradients on the student's steps (2 and 4).
    assert len(norm_calls) == steps and norm_calls[1] > norm_calls[0] and norm_calls[3] == norm_calls[1], norm_calls
