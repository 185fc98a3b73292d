"""DMD2 (method.name dmd2): roles student, teacher and critic on one run; the method owns its two
optimizers; the teacher is frozen (no gradient, no optimizer state, never wrapped, eval mode);
the student is updated every generator_update_interval steps; resume is bitwise; the critic is saved
beside the student."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from fv_accel import Trainer, build_from_config
from fv_accel.config import ConfigError, load_config
from dmd2_helpers import DMD2_RECIPE, dmd2_overrides


def test_roles_start_from_the_teacher_and_only_the_teacher_is_frozen(tmp_path):
    run = build_from_config(DMD2_RECIPE, dmd2_overrides(tmp_path))
    m = run.method
    acc = run.accelerator
    assert (m.student.role, m.teacher.role, m.critic.role) == ("student", "teacher", "critic")
    teacher = dict(m.teacher.transformer.named_parameters())
    for role in (m.student, m.critic):
        for name, p in role.transformer.named_parameters():
            assert torch.equal(p, teacher[name]), name  # same initial weights
            assert p.requires_grad
    assert not any(p.requires_grad for p in teacher.values())
    assert not m.teacher.transformer.training
    # No optimizer holds a teacher parameter; the engine wrapped student and critic, not the teacher.
    teacher_ids = {id(p) for p in teacher.values()}
    for opt in m.optimizer_dict.values():
        assert not teacher_ids & {id(p) for g in opt.param_groups for p in g["params"]}
    assert set(m.optimizer_dict) == {"student", "critic"}
    assert len(acc._models) == 2 and all(model is not m.teacher.transformer for model in acc._models)
    # The critic's optimizer follows the fake_score_* keys.
    group = m.critic_optimizer.param_groups[0]
    assert group["lr"] == pytest.approx(1e-3) and tuple(group["betas"]) == (0.0, 0.999)


def test_the_student_steps_every_interval_and_the_teacher_never_changes(tmp_path):
    run = build_from_config(DMD2_RECIPE, dmd2_overrides(tmp_path, **{
        "method.generator_update_interval": 2, "training.loop.max_train_steps": 4,
        "training.tracker.log_every": 1,
    }))
    m = run.method
    before = {r: {k: v.detach().clone() for k, v in getattr(m, r).transformer.state_dict().items()} for r in ("student", "teacher", "critic")}
    steps_taken = {"student": [], "critic": []}
    for role, opt in m.optimizer_dict.items():
        original = opt.step

        def step(*a, _role=role, _orig=original, **k):
            steps_taken[_role].append(True)
            return _orig(*a, **k)

        opt.step = step
    summary = Trainer(run).run()
    assert summary["steps"] == 4 and summary["skipped_steps"] == 0
    assert len(steps_taken["critic"]) == 4 and len(steps_taken["student"]) == 2
    rows = [json.loads(line) for line in (tmp_path / "out" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["update_student"] for r in rows] == [0.0, 1.0, 0.0, 1.0]
    assert [r["generator_loss"] == 0.0 for r in rows] == [True, False, True, False]
    assert all(r["fake_score_loss"] > 0 for r in rows)
    assert "grad_norm_student" in rows[1] and "grad_norm_critic" in rows[1] and "lr_critic" in rows[0]
    after = {r: getattr(m, r).transformer.state_dict() for r in ("student", "teacher", "critic")}
    for k, v in before["teacher"].items():
        assert torch.equal(v, after["teacher"][k]), k
    assert any(not torch.equal(v, after["student"][k]) for k, v in before["student"].items())
    assert any(not torch.equal(v, after["critic"][k]) for k, v in before["critic"].items())
    # The student's schedule counted its own updates, the critic's every step.
    assert m.lr_scheduler.scheduler.last_epoch == 2 and m.critic_lr_scheduler.scheduler.last_epoch == 4
    # transformer/ is the student; critic/ beside it.
    out = tmp_path / "out"
    student_saved = load_file(str(next((out / "transformer").glob("*.safetensors"))))
    critic_saved = load_file(str(next((out / "critic" / "transformer").glob("*.safetensors"))))
    for k, v in after["student"].items():
        assert torch.equal(student_saved[k], v), k
    for k, v in after["critic"].items():
        assert torch.equal(critic_saved[k], v), k


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["simulate", "data_latent"])
def test_resume_equals_a_straight_run_bitwise(tmp_path, mode):
    common = {"method.generator_update_interval": 2, "training.checkpoint.training_state_checkpointing_steps": 3,
              "method.rollout_mode": mode}
    straight = build_from_config(DMD2_RECIPE, dmd2_overrides(tmp_path / "a", **common, **{"training.loop.max_train_steps": 6}))
    Trainer(straight).run()
    first = build_from_config(DMD2_RECIPE, dmd2_overrides(tmp_path / "b", **common, **{"training.loop.max_train_steps": 3}))
    Trainer(first).run()
    resumed = build_from_config(DMD2_RECIPE, dmd2_overrides(tmp_path / "b", **common, **{
        "training.loop.max_train_steps": 6, "training.checkpoint.resume_from_checkpoint": "latest"}))
    assert resumed.start_step == 3
    Trainer(resumed).run()
    for role in ("student", "critic"):
        a = getattr(straight.method, role).transformer.state_dict()
        b = getattr(resumed.method, role).transformer.state_dict()
        for k in a:
            assert torch.equal(a[k], b[k]), (role, k)
    for name in ("student", "critic"):
        sa = straight.method.optimizer_dict[name].state_dict()["state"]
        sb = resumed.method.optimizer_dict[name].state_dict()["state"]
        for i in sa:
            for key in sa[i]:
                assert torch.equal(torch.as_tensor(sa[i][key]), torch.as_tensor(sb[i][key])), (name, i, key)
    assert torch.equal(straight.method.cuda_generator.get_state(), resumed.method.cuda_generator.get_state())


def test_recipe_errors_are_one_line_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match="models.teacher"):
        load_config(DMD2_RECIPE, {"models.teacher": None})
    with pytest.raises(ConfigError, match="models.teacher.*method.name 'finetune'"):
        load_config(DMD2_RECIPE, {"method.name": "finetune"})
    for key, value, words in [
        ("method.rollout_mode", None, "method.rollout_mode"),
        ("method.fake_score_lr_scheduler", None, "method.fake_score_lr_scheduler"),
        ("method.fake_score_learning_rate", None, "method.fake_score_learning_rate"),
        ("method.dmd_denoising_steps", [], "method.dmd_denoising_steps"),
        ("method.generator_update_interval", 0, "method.generator_update_interval"),
        ("models.teacher.trainable", True, "teacher to be non-trainable"),
    ]:
        with pytest.raises(ValueError, match=words):
            build_from_config(DMD2_RECIPE, dmd2_overrides(tmp_path / key, **{key: value}))


def test_a_text_only_dataset_trains_with_simulate_and_refuses_data_latent(tmp_path, tiny_model_dir):
    from fv_accel.preprocess import main as preprocess_main

    (tmp_path / "prompts.txt").write_text("a red circle moving left on a dark background\na green triangle bouncing\n")
    data = tmp_path / "prompts_data"
    argv = ["--model", str(tiny_model_dir), "--prompts", str(tmp_path / "prompts.txt"), "--output", str(data), "--dtype", "float32"]
    assert preprocess_main(argv) == 0
    text_only = {
        "models.teacher.init_from": str(tiny_model_dir), "models.teacher.transformer_config": None,
        "training.data.data_path": str(data), "training.data.num_frames": 5,
        "training.data.num_height": 32, "training.data.num_width": 32, "training.loop.max_train_steps": 2,
        "method.generator_update_interval": 1,
    }
    with pytest.raises(ConfigError, match="text-only dataset.*data_latent"):
        build_from_config(DMD2_RECIPE, dmd2_overrides(tmp_path / "refused", **text_only, **{"method.rollout_mode": "data_latent"}))
    run = build_from_config(DMD2_RECIPE, dmd2_overrides(tmp_path / "sim", **text_only))
    seen = []
    original = run.method.critic_loss

    def critic_loss(tb):
        seen.append(tuple(tb.latents.shape))
        return original(tb)

    run.method.critic_loss = critic_loss
    summary = Trainer(run).run()
    assert summary["steps"] == 2 and summary["skipped_steps"] == 0
    # The rollout's shape is the recipe's: 5 frames -> 2 latent frames, 32 px -> 4 latent pixels.
    assert seen == [(2, 16, 2, 4, 4)] * 2
    assert (tmp_path / "sim" / "out" / "transformer").is_dir()


@pytest.mark.slow
def test_every_role_named_on_the_command_line_trains_from_data_latents(tmp_path, tiny_model_dir):
    """The issue's command: every role's init_from overridden, data_latent rollouts on the tiny data."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    m = str(tiny_model_dir)
    cmd = [
        str(Path(sys.executable).parent / "accelerate"), "launch", "--num_processes", "1", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no", "train_dmd2.py", "--config", "configs/tiny_dmd2.yaml",
        "--models.student.init_from", m, "--models.teacher.init_from", m, "--models.critic.init_from", m,
        "--method.rollout_mode", "data_latent", "--training.data.data_path", "tiny",
        "--training.loop.max_train_steps", "2", "--output_dir", str(tmp_path / "out"),
        "--callbacks.validation.enable", "false", "--training.tracker.trackers", "[none]",
    ]
    proc = subprocess.run(cmd, cwd=repo, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "done: 2 steps" in proc.stdout
    assert (tmp_path / "out" / "transformer").is_dir() and (tmp_path / "out" / "critic" / "transformer").is_dir()


def test_the_memory_estimate_counts_three_models_and_two_optimizers(tmp_path):
    from fv_accel.config import role_config
    from fv_accel.memory_estimate import _estimate_role, estimate_memory

    cfg = load_config(DMD2_RECIPE, dmd2_overrides(tmp_path))
    env = {"ACCELERATE_USE_FSDP": "true", "WORLD_SIZE": "2"}
    est = estimate_memory(cfg, env)
    one = _estimate_role(role_config(cfg, "teacher"), env)  # all three roles share the teacher's config here
    assert est.parameters == pytest.approx(3 * one.parameters)
    assert est.gradients == pytest.approx(2 * one.gradients) and est.gradients > 0
    assert est.optimizer == pytest.approx(2 * one.optimizer) and est.optimizer > 0
    assert any("frozen teacher" in note and "critic" in note for note in est.notes)


def test_a_forced_collapse_warns_and_stop_on_collapse_stops_with_a_checkpoint(tmp_path, caplog):
    """A student whose every sample decodes the same still latent (in sampling its velocity is
    x / sigma, so each step predicts x0 = 0) against the teacher's samples on the same prompts and seeds."""
    import logging

    overrides = dmd2_overrides(tmp_path, **{
        "callbacks.validation.enable": True, "callbacks.validation.every_steps": 2,
        "callbacks.validation.prompts": ["a white square moving up on a light background"],
        "callbacks.validation.sampling_steps": 4, "callbacks.validation.guidance_scale": 1.0,
        "callbacks.validation.stop_on_collapse": True,
        "training.checkpoint.training_state_checkpointing_steps": 0,
        "training.loop.max_train_steps": 4,
    })
    run = build_from_config(DMD2_RECIPE, overrides)

    def still(module, args, kwargs, output):
        if torch.is_grad_enabled():  # training steps run as usual; only the samples collapse
            return None
        x = kwargs.get("hidden_states", args[0] if args else None)
        t = kwargs.get("timestep", args[1] if len(args) > 1 else None)
        velocity = x / (t.float() / 1000.0).reshape(-1, *([1] * (x.ndim - 1)))
        return (velocity,) if isinstance(output, tuple) else type(output)(sample=velocity)

    run.method.student.transformer.register_forward_hook(still, with_kwargs=True)
    with caplog.at_level(logging.WARNING, logger="fv_accel.validation"):
        summary = Trainer(run).run()
    warnings = [r.getMessage() for r in caplog.records if "collapsing" in r.getMessage()]
    assert warnings and warnings[0].startswith("step 2: the student's samples are collapsing (static, solid): temporal variation")
    assert summary["stopped_by"].startswith("callbacks.validation.stop_on_collapse")
    assert summary["final_step"] == 2 and (tmp_path / "out" / "checkpoint-2").is_dir()
    rows = [json.loads(line) for line in (tmp_path / "out" / "logs" / "metrics.jsonl").read_text().splitlines()]
    teacher = next(r for r in rows if "teacher/temporal_variation" in r)
    student_row = next(r for r in rows if "samples/temporal_variation" in r)
    assert student_row["samples/temporal_variation"] < 0.5 * teacher["teacher/temporal_variation"]


@pytest.mark.slow
def test_the_stock_pipeline_with_the_saved_scheduler_samples_what_validation_sampled(tmp_path, tiny_model_dir):
    """A finished DMD2 run writes scheduler/ beside transformer/; WanPipeline with them, at the
    student's step count, guidance 1 and the same seeds, gives the latents validation sampled."""
    from diffusers import FlowMatchLCMScheduler, WanPipeline, WanTransformer3DModel

    from fv_accel.validation import VideoSamplingCallback

    prompt = "a white square moving up on a light background"
    run = build_from_config(DMD2_RECIPE, dmd2_overrides(tmp_path, **{
        "models.teacher.init_from": str(tiny_model_dir), "models.teacher.transformer_config": None,
        "method.dmd_denoising_steps": [1000, 750, 500, 250], "method.generator_update_interval": 1,
        "training.loop.max_train_steps": 2,
        "callbacks.validation.enable": True, "callbacks.validation.every_steps": 2,
        "callbacks.validation.prompts": [prompt], "callbacks.validation.sampling_steps": 2,
        "callbacks.validation.guidance_scale": 1.0,
    }))
    video = next(cb for cb in run.callbacks if isinstance(cb, VideoSamplingCallback))
    sampled = []
    original = video._sample_few_step

    def record(trainer, student, p):
        latents = original(trainer, student, p)
        sampled.append((p, latents.detach().cpu().clone()))
        return latents

    video._sample_few_step = record
    Trainer(run).run()
    out = tmp_path / "out"
    assert (out / "scheduler" / "scheduler_config.json").is_file()
    (p, latents), = sampled
    transformer = WanTransformer3DModel.from_pretrained(str(out), subfolder="transformer")
    scheduler = FlowMatchLCMScheduler.from_pretrained(str(out), subfolder="scheduler")
    pipe = WanPipeline.from_pretrained(str(tiny_model_dir), transformer=transformer, scheduler=scheduler)
    torch.manual_seed(p.seed + 1)
    stock = pipe(
        prompt, height=p.height, width=p.width, num_frames=p.num_frames, num_inference_steps=4, guidance_scale=1.0,
        generator=torch.Generator().manual_seed(p.seed), output_type="latent", max_sequence_length=16,
    ).frames
    assert stock.shape == latents.shape
    assert (stock.float() - latents.float()).abs().max().item() < 1e-4
    card = (out / "README.md").read_text()
    assert 'FlowMatchLCMScheduler.from_pretrained(' in card and "num_inference_steps=4, guidance_scale=1.0" in card


@pytest.mark.slow
def test_lora_student_and_critic_resume_bitwise_and_save_their_adapters(tmp_path):
    lora = {"models.student.lora.enable": True, "models.critic.lora.enable": True, "method.generator_update_interval": 1,
            "training.checkpoint.training_state_checkpointing_steps": 1}
    straight = build_from_config(DMD2_RECIPE, dmd2_overrides(tmp_path / "a", **lora, **{"training.loop.max_train_steps": 2}))
    Trainer(straight).run()
    first = build_from_config(DMD2_RECIPE, dmd2_overrides(tmp_path / "b", **lora, **{"training.loop.max_train_steps": 1}))
    Trainer(first).run()
    ckpt = tmp_path / "b" / "out" / "checkpoint-1"
    assert (ckpt / "pytorch_lora_weights.safetensors").is_file() and (ckpt / "critic" / "pytorch_lora_weights.safetensors").is_file()
    resumed = build_from_config(DMD2_RECIPE, dmd2_overrides(tmp_path / "b", **lora, **{
        "training.loop.max_train_steps": 2, "training.checkpoint.resume_from_checkpoint": "latest"}))
    Trainer(resumed).run()
    for sub in ("", "critic/"):
        a = load_file(str(tmp_path / "a" / "out" / f"{sub}pytorch_lora_weights.safetensors"))
        b = load_file(str(tmp_path / "b" / "out" / f"{sub}pytorch_lora_weights.safetensors"))
        assert a.keys() == b.keys() and all("lora" in k for k in a)
        assert all(torch.equal(a[k], b[k]) for k in a), sub
    # Only the adapters train: the frozen bases of student and critic equal the teacher's.
    teacher = straight.method.teacher.transformer.state_dict()
    base = {k.replace("base_layer.", ""): v for k, v in straight.method.student.transformer.state_dict().items() if "lora" not in k}
    assert all(torch.equal(base[k], teacher[k]) for k in teacher)


def test_a_vsa_student_trains_sparse_beside_dense_teacher_and_critic(tmp_path):
    run = build_from_config(DMD2_RECIPE, dmd2_overrides(tmp_path, **{
        "training.vsa.sparsity": 0.5, "training.loop.max_train_steps": 2, "method.generator_update_interval": 1,
        "training.tracker.log_every": 1}))
    m = run.method
    assert m.student.vsa_controllers and not m.teacher.vsa_controllers and not m.critic.vsa_controllers
    summary = Trainer(run).run()
    assert summary["steps"] == 2 and summary["skipped_steps"] == 0
    rows = [json.loads(line) for line in (tmp_path / "out" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["vsa_sparsity"] for r in rows] == [0.5, 0.5]
