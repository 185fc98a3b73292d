"""Self-Forcing (method.name self_forcing): a block-causal student rolled out chunk by chunk over its
KV cache on the DMD2 machinery. Gradient only through each chunk's exit step and from
start_gradient_frame; the streamed sampler is the rollout; resume is bitwise (the rollout
generator included); the refusals are one line each. (FastVideo parity: test_self_forcing_parity.py;
2 processes == 1 and FSDP2: test_distributed.py.)"""

from __future__ import annotations

import json

import pytest
import torch

from fv_accel import Trainer, build_from_config
from fv_accel.config import ConfigError, load_config
from self_forcing_helpers import SF_RECIPE, self_forcing_overrides


def _tb(method, batch):
    method._generator = method.batch_generator(batch)
    return method._prepare_dmd_batch(batch)


def test_the_student_is_causal_and_the_critic_and_teacher_are_not(tmp_path):
    run = build_from_config(SF_RECIPE, self_forcing_overrides(tmp_path))
    m = run.method
    assert m.student.causal_attention is not None and m.block_size == 3
    assert getattr(m.teacher, "causal_attention", None) is None and getattr(m.critic, "causal_attention", None) is None
    teacher = dict(m.teacher.transformer.named_parameters())
    for name, p in m.student.transformer.named_parameters():
        assert torch.equal(p, teacher[name]), name


def test_gradient_flows_only_through_exit_steps_from_start_gradient_frame(tmp_path, tiny_data_path):
    run = build_from_config(SF_RECIPE, self_forcing_overrides(tmp_path, **{"method.start_gradient_frame": 3}))
    m = run.method
    batch = next(iter(run.dataloader))
    tb = _tb(m, batch)
    calls = []
    original = m.chunk_velocity

    def counted(x, t, tb_, cache, start, *, write=False):
        out = original(x, t, tb_, cache, start, write=write)
        calls.append((start, write, out.requires_grad))
        return out

    m.chunk_velocity = counted
    m.cfg.method.last_step_only = True
    m._last_step_only = True
    x0 = m.student_rollout(tb, with_grad=True)
    assert x0.shape[2] == 6
    steps = len(m.denoising_steps(x0.shape))
    # Per chunk: the steps (only the last with gradient, and only from frame 3), then the cache write
    # of every chunk but the last (never with gradient).
    expected = []
    for start in (0, 3):
        expected += [(start, False, start >= 3 and i == steps - 1) for i in range(steps)]
        if start == 0:
            expected.append((start, True, False))
    assert calls == expected
    params = [p for p in m.student.transformer.parameters() if p.requires_grad]
    g0 = torch.autograd.grad(x0[:, :, 0].sum(), params, allow_unused=True, retain_graph=True)
    assert all(g is None or float(g.abs().max()) == 0.0 for g in g0)
    g1 = torch.autograd.grad(x0[:, :, 3].sum(), params, allow_unused=True)
    assert any(g is not None and float(g.abs().max()) > 0.0 for g in g1)


def test_the_streamed_sampler_equals_the_kv_cached_rollout(tmp_path):
    """With ode stepping (no draws) and clean context, the method's sampler (its training rollout at the
    last step of every chunk) equals fv_accel.rollout's KV-cached rollout at the student's steps, which
    `python -m fv_accel.generate` streams."""
    from fv_accel.rollout import kv_cached_rollout

    run = build_from_config(SF_RECIPE, self_forcing_overrides(tmp_path, **{"method.student_sample_type": "ode"}))
    m = run.method
    batch = next(iter(run.dataloader))
    tb = _tb(m, batch)
    noise = torch.randn(tb.latents.shape, generator=torch.Generator().manual_seed(3))
    m.student.transformer.eval()
    ours = m.sample(tb, noise)
    shape = torch.Size([1, 1, 1, 1, 1])
    steps = [float(t) for t in m.denoising_steps(shape)]
    other = kv_cached_rollout(m.student, noise, tb.conditioning.text, sigmas=m.few_step_sigmas(shape) + [0.0],
                              timesteps=steps, renoise=False)
    assert torch.allclose(ours, other.latents, atol=1e-5, rtol=0), float((ours - other.latents).abs().max())


@pytest.mark.slow
def test_resume_equals_a_straight_run_bitwise(tmp_path):
    common = {"method.generator_update_interval": 2, "training.checkpoint.training_state_checkpointing_steps": 3,
              "method.context_noise": 100}
    straight = build_from_config(SF_RECIPE, self_forcing_overrides(tmp_path / "a", **common, **{"training.loop.max_train_steps": 6}))
    Trainer(straight).run()
    first = build_from_config(SF_RECIPE, self_forcing_overrides(tmp_path / "b", **common, **{"training.loop.max_train_steps": 3}))
    Trainer(first).run()
    resumed = build_from_config(SF_RECIPE, self_forcing_overrides(tmp_path / "b", **common, **{
        "training.loop.max_train_steps": 6, "training.checkpoint.resume_from_checkpoint": "latest"}))
    assert resumed.start_step == 3
    Trainer(resumed).run()
    for role in ("student", "critic"):
        a = getattr(straight.method, role).transformer.state_dict()
        b = getattr(resumed.method, role).transformer.state_dict()
        for k in a:
            assert torch.equal(a[k], b[k]), (role, k)
    for name in ("cuda_generator", "rollout_generator"):
        assert torch.equal(getattr(straight.method, name).get_state(), getattr(resumed.method, name).get_state()), name
    out = tmp_path / "b" / "out"
    steps = json.loads((out / "student_steps.json").read_text())
    assert steps["method"] == "self_forcing" and steps["timesteps"] == [1000.0, 750.0, 500.0, 250.0]
    assert json.loads((out / "self_forcing.json").read_text())["chunk_size"] == 3


def test_score_window_is_not_applied_and_streaming_timesteps_are_integers(tmp_path, caplog):
    """As FastVideo 0.2.1's Self-Forcing: a score window in the recipe (FastVideo's 0.02/0.98) is announced once as
    not applied and the score timesteps span [0, 1000]; the student's streaming forwards get integer
    timesteps (`timestep.long()`: warped 937.5 -> 937, context 150.5 -> 150), which student_steps.json
    records for generate. The window's effect on the losses: test_self_forcing_parity.py."""
    import logging

    over = {"method.warp_denoising_step": True, "models.student.flow_shift": 5.0, "method.last_step_only": True,
            "method.context_noise": 150.5, "method.student_sample_type": "ode",
            "method.min_timestep_ratio": 0.02, "method.max_timestep_ratio": 0.98}
    with caplog.at_level(logging.WARNING, logger="fv_accel.methods.distribution_matching.self_forcing"):
        run = build_from_config(SF_RECIPE, self_forcing_overrides(tmp_path / "a", **over))
    m = run.method
    notices = [r.getMessage() for r in caplog.records if "max_timestep_ratio" in r.getMessage()]
    assert notices == [
        "method.min_timestep_ratio/max_timestep_ratio 0.02/0.98 have no effect on self_forcing: FastVideo's "
        "Self-Forcing does not apply them (its score timesteps span [0, 1000]) and neither does fv_accel; "
        "they apply to dmd2"
    ]
    assert m._score_bounds == (0, 1000) and m.math_signature()["method.score_timestep_bounds"] == [0, 1000]
    given = []
    predict_noise = m.student.predict_noise

    def recording(x, t, *args, **kwargs):
        given.append((t.dtype, sorted({int(v) for v in t.flatten()})))
        return predict_noise(x, t, *args, **kwargs)

    m.student.predict_noise = recording
    with torch.no_grad():
        m.student_rollout(_tb(m, next(iter(run.dataloader))), with_grad=False)
    assert {dtype for dtype, _ in given} == {torch.long}
    assert [values for _, values in given] == [[1000], [937], [833], [625], [150], [1000], [937], [833], [625]]
    assert m.student_steps_record()["timesteps"] == [1000.0, 937.0, 833.0, 625.0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fv_accel.methods.distribution_matching.self_forcing"):
        build_from_config(SF_RECIPE, self_forcing_overrides(tmp_path / "b"))  # the recipe sets no window
    assert not [r for r in caplog.records if "max_timestep_ratio" in r.getMessage()]


def test_refusals_are_one_line_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match="train_self_forcing.py runs self_forcing"):
        from fv_accel.config import parse_cli

        parse_cli(["--config", "configs/tiny_dmd2.yaml"], "self_forcing")
    for key, value, words in [
        ("method.rollout_mode", "data_latent", "only simulate"),
        ("models.student.causal", False, "block-causal student.*models.student.causal: true"),
        ("method.student_sample_type", "euler", "method.student_sample_type must be sde or ode"),
        ("method.context_noise", -1, "method.context_noise must be a timestep >= 0"),
        ("method.start_gradient_frame", -2, "method.start_gradient_frame"),
    ]:
        with pytest.raises(ValueError, match=words) as err:
            build_from_config(SF_RECIPE, self_forcing_overrides(tmp_path / key, **{key: value}))
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="models.teacher.causal: false"):
        build_from_config(SF_RECIPE, self_forcing_overrides(tmp_path / "t", **{"models.teacher.causal": True,
                                                                                  "models.critic.causal": False}))
    # A clip whose latent frames do not fill whole chunks: refused at build, naming the keys.
    with pytest.raises(ConfigError, match="6 latent frames is not a multiple of method.chunk_size 4"):
        build_from_config(SF_RECIPE, self_forcing_overrides(tmp_path / "chunks", **{"method.chunk_size": 4}))
    # Sparse attention does not combine with the block-causal student.
    with pytest.raises(ConfigError, match="video sparse attention does not combine with a block-causal student"):
        load_config(SF_RECIPE, self_forcing_overrides(tmp_path / "vsa", **{"training.vsa.sparsity": 0.5}))
    # Resuming a checkpoint without the rollout generator's state.
    with pytest.raises(ValueError, match="no self_forcing rollout generator state"):
        build_from_config(SF_RECIPE, self_forcing_overrides(tmp_path / "r")).method.load_state_tensors({})


def test_the_memory_estimate_adds_the_kv_cache_of_the_finished_chunks(tmp_path):
    from fv_accel.memory_estimate import estimate_memory

    sf = estimate_memory(load_config(SF_RECIPE, self_forcing_overrides(tmp_path)), {})
    kv = sf.activation_parts["kv_cache"]
    b = sf.bucket
    # The tests' teacher: 1 layer of width 32; 6 latent frames in chunks of 3: one chunk (3 frames) cached.
    tokens_per_frame = b.tokens // b.latent[1]
    act_bytes = 2 if sf.launch.mixed_precision in ("bf16", "fp16") else 4
    assert kv == 2 * 1 * 3 * tokens_per_frame * 32 * act_bytes
    windowed = estimate_memory(load_config(SF_RECIPE, self_forcing_overrides(tmp_path, **{"models.student.local_attn_size": 3})), {})
    assert windowed.activation_parts["kv_cache"] == 0  # a window of one chunk: the chunk sees only itself
    assert any("KV cache of 3 latent frames" in note for note in sf.notes)


def test_a_lora_student_with_ema_trains_and_saves_its_adapter_and_average(tmp_path):
    extra = {"models.student.lora.enable": True, "method.generator_update_interval": 1, "training.loop.max_train_steps": 2,
             "callbacks.ema.enable": True}
    run = build_from_config(SF_RECIPE, self_forcing_overrides(tmp_path, **extra))
    teacher = {k: v.clone() for k, v in run.method.teacher.transformer.state_dict().items()}
    summary = Trainer(run).run()
    assert summary["steps"] == 2 and summary["skipped_steps"] == 0
    out = tmp_path / "out"
    from safetensors.torch import load_file

    adapter = load_file(str(out / "pytorch_lora_weights.safetensors"))
    assert adapter and all("lora" in k for k in adapter)
    assert any(float(v.abs().max()) > 0 for k, v in adapter.items() if "lora_B" in k)  # the student's updates
    state = run.method.student.transformer.state_dict()
    base = {k.replace("base_layer.", ""): v for k, v in state.items() if "lora" not in k}
    assert all(torch.equal(base[k], teacher[k]) for k in teacher)  # only the adapter trained
    assert any(p.name.startswith("ema") for p in out.iterdir()), sorted(p.name for p in out.iterdir())


def test_activation_checkpointing_recomputes_each_chunk_over_the_cache_it_saw(tmp_path):
    """With checkpointed blocks the backward recomputes every chunk's exit step after later chunks
    were written into the cache: it must attend to what the first pass attended to. The student's
    update equals the one without checkpointing."""
    extra = {"method.generator_update_interval": 1, "training.loop.max_train_steps": 1}
    weights = []
    for kind in (None, "full"):
        run = build_from_config(SF_RECIPE, self_forcing_overrides(
            tmp_path / str(kind), **extra, **{"training.model.enable_gradient_checkpointing_type": kind}))
        Trainer(run).run()
        weights.append({k: v.clone() for k, v in run.method.student.transformer.state_dict().items()})
    assert max(float((weights[0][k] - weights[1][k]).abs().max()) for k in weights[0]) < 1e-6
