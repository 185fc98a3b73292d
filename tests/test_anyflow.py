"""AnyFlow (method.name anyflow_pretrain, then anyflow): recipe refusals in one line naming the key,
the branch ratios taken as configured (0 is 0, where FastVideo reads 0 as its default), the
on-policy rollout schedule and the stock scheduler validation samples the student with, `--dry-run`
of the recipes, and short runs of both stages end to end on the AnyFlow family's tiny students.
Equality with FastVideo 0.2.1's own methods is tests/test_anyflow_parity.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from anyflow_standins import standin_velocity_with_r
from conftest import tiny_overrides
from dmd2_helpers import DMD2_RECIPE, TINY_TEACHER, dmd2_overrides
from dmd2_standins import standin_batch

REPO = Path(__file__).resolve().parents[1]
PRETRAIN_RECIPE = str(REPO / "configs" / "tiny_finetune.yaml")
T_LIST = [1000.0, 900.0, 750.0, 500.0, 0.0]  # FlowMapEulerDiscreteScheduler's 4 steps at shift 3


@pytest.fixture
def flow_map_wan(monkeypatch):
    """The tiny Wan student class given a `predict_velocity_with_r` (the stand-in replaces it per instance)."""
    from fv_accel.models.wan import WanStudent

    monkeypatch.setattr(WanStudent, "predict_velocity_with_r", lambda self, *a, **k: None, raising=False)


def pretrain_overrides(tmp_path, **extra):
    return tiny_overrides(tmp_path, **{"method.name": "anyflow_pretrain", "training.data.text_max_length": 16, **extra})


def onpolicy_overrides(tmp_path, **extra):
    return dmd2_overrides(tmp_path, **{"method.name": "anyflow", "method.dmd_denoising_steps": None,
                                       "method.t_list_override": T_LIST, "models.student.flow_shift": 3.0, **extra})


def build(recipe, overrides):
    from fv_accel import build_from_config

    run = build_from_config(recipe, overrides)
    if run.output_lock is not None:
        run.output_lock.release()
    return run


@pytest.mark.parametrize("extra,words", [
    ({"method.epsilon": 5.5}, ["method.epsilon", "integer"]),
    ({"method.epsilon": 0}, ["method.epsilon", ">= 1"]),
    ({"method.diffusion_ratio": 0.8, "method.consistency_ratio": 0.3}, ["diffusion_ratio", "consistency_ratio", "<= 1"]),
    ({"method.diffusion_ratio": -0.1}, ["method.diffusion_ratio", "[0, 1]"]),
    ({"method.fuse_guidance_scale": 0.0}, ["method.fuse_guidance_scale", "> 0"]),
    ({"method.weight_type": "cosine"}, ["method.weight_type", "beta08"]),
    ({"method.min_timestep_ratio": 0.02}, ["method.min_timestep_ratio", "no effect"]),
])
def test_pretrain_recipe_errors_are_one_line_naming_the_key(tmp_path, flow_map_wan, extra, words):
    with pytest.raises(ValueError) as err:
        build(PRETRAIN_RECIPE, pretrain_overrides(tmp_path, **extra))
    message = str(err.value)
    assert "\n" not in message and all(w in message for w in words), message


@pytest.mark.parametrize("extra,words", [
    ({"method.dmd_score_r_value": 0.5}, ["method.dmd_score_r_value", "0.5", "r = 0"]),
    ({"method.t_list_override": [1000.0, 500.0]}, ["method.t_list_override", "end at 0"]),
    ({"method.t_list_override": [500.0, 1000.0, 0.0]}, ["method.t_list_override", "descending"]),
    ({"method.dmd_denoising_steps": [1000, 500]}, ["method.dmd_denoising_steps", "t_list_override"]),
    ({"method.student_sample_steps": 0}, ["method.student_sample_steps", ">= 1"]),
    ({"method.use_mean_velocity": 2}, ["method.use_mean_velocity"]),
])
def test_onpolicy_recipe_errors_are_one_line_naming_the_key(tmp_path, flow_map_wan, extra, words):
    with pytest.raises(ValueError) as err:
        build(DMD2_RECIPE, onpolicy_overrides(tmp_path, **extra))
    message = str(err.value)
    assert "\n" not in message and all(w in message for w in words), message


@pytest.mark.parametrize("name", ["anyflow_pretrain", "anyflow"])
def test_a_student_without_a_flow_map_is_refused(tmp_path, name):
    overrides = pretrain_overrides(tmp_path) if name == "anyflow_pretrain" else onpolicy_overrides(tmp_path)
    with pytest.raises(ValueError) as err:
        build(PRETRAIN_RECIPE if name == "anyflow_pretrain" else DMD2_RECIPE, overrides)
    assert "models.student" in str(err.value) and "flow map" in str(err.value)


def test_the_fastvideo_recipe_keys_are_accepted(tmp_path, flow_map_wan):
    """FastVideo's on-policy recipe gives dmd_denoising_steps beside t_list_override and dmd_score_r_value 0."""
    run = build(DMD2_RECIPE, onpolicy_overrides(tmp_path, **{
        "method.dmd_denoising_steps": [1000, 900, 750, 500], "method.dmd_score_r_value": 0.0}))
    assert run.method.rollout_timesteps(torch.Size([1, 16, 1, 2, 2])).tolist() == T_LIST


def pretrain_step_metrics(tmp_path, **extra):
    run = build(PRETRAIN_RECIPE, pretrain_overrides(tmp_path, **{"training.data.train_batch_size": 4,
                                                                  "models.student.latents_mean": [0.0] * 16,
                                                                  "models.student.latents_std": [1.0] * 16, **extra}))
    calls = []

    def velocity(x, t, r, tb, *, conditional=True, cfg_uncond=None, attn_kind="dense"):
        calls.append((t.detach().clone(), r.detach().clone()))
        return standin_velocity_with_r(x, t, r, conditional)

    run.method.student.predict_velocity_with_r = velocity
    _, _, metrics = run.method.single_train_step(standin_batch(4, 16, 5, 4, 6, 16, 32, seed=7), 1)
    return metrics, calls[0]


def test_a_configured_ratio_of_0_is_honoured(tmp_path, flow_map_wan):
    """FastVideo's `or` reads diffusion_ratio 0 as 0.5 and consistency_ratio 0 as 0.25; here 0 is 0."""
    metrics, (t, r) = pretrain_step_metrics(tmp_path / "a", **{"method.diffusion_ratio": 0.0})
    assert float(metrics["diffusion_fraction"]) == 0.0 and float(metrics["consistency_fraction"]) == 0.25
    assert bool((r < t).all()) and float(r[0]) == 0.0 and float(r[1]) > 0.0  # sample 0: r = 0; no r = t
    metrics, (t, r) = pretrain_step_metrics(tmp_path / "b", **{"method.consistency_ratio": 0.0})
    assert float(metrics["diffusion_fraction"]) == 0.5 and float(metrics["consistency_fraction"]) == 0.0
    assert torch.equal(r[:2], t[:2]) and bool((r[2:] > 0).all()) and bool((r[2:] < t[2:]).all())
    metrics, _ = pretrain_step_metrics(tmp_path / "c")
    assert float(metrics["diffusion_fraction"]) == 0.5 and float(metrics["consistency_fraction"]) == 0.25


def test_the_rollout_schedule_and_the_scheduler_that_samples_the_student(tmp_path, flow_map_wan):
    shape = torch.Size([1, 16, 1, 2, 2])
    m = build(DMD2_RECIPE, onpolicy_overrides(tmp_path / "a", **{"method.student_sample_steps": 2})).method
    assert m.rollout_timesteps(shape).tolist() == [1000.0, 900.0, 0.0]  # capped: the first 2 and the last
    m = build(DMD2_RECIPE, onpolicy_overrides(tmp_path / "b", **{
        "method.t_list_override": None, "method.dmd_denoising_steps": [1000, 500]})).method
    assert m.rollout_timesteps(shape).tolist() == [1000.0, 500.0, 0.0]  # the DMD2 steps and a final 0
    with pytest.raises(ValueError, match="FlowMapEulerDiscreteScheduler"):
        m.sampling_schedule()  # [1000, 500, 0] is not the stock scheduler's 2 steps at shift 3
    m = build(DMD2_RECIPE, onpolicy_overrides(tmp_path / "c")).method
    schedule = m.sampling_schedule()
    assert schedule.class_name == "FlowMapEulerDiscreteScheduler" and schedule.config["shift"] == 3.0
    assert m.few_step_sigmas(shape) == [1.0, 0.9, 0.75, 0.5]
    scheduler = schedule.build()
    scheduler.set_timesteps(4)
    assert torch.allclose(scheduler.timesteps.float(), torch.tensor(T_LIST[:-1]), atol=1e-3)
    # Sample videos of a schedule no stock scheduler steps are refused before the run.
    with pytest.raises(ValueError, match="callbacks.validation.prompts"):
        build(DMD2_RECIPE, onpolicy_overrides(tmp_path / "d", **{
            "method.t_list_override": [1000.0, 600.0, 0.0], "callbacks.validation.enable": True,
            "callbacks.validation.prompts": ["a red circle"]}))


@pytest.mark.parametrize("name,method", [
    ("wan2_1_t2v_1_3b_anyflow_pretrain", "anyflow_pretrain"), ("wan2_1_t2v_1_3b_anyflow_onpolicy", "anyflow"),
    ("tiny_anyflow_pretrain", "anyflow_pretrain"), ("tiny_anyflow", "anyflow"),
])
def test_dry_run_prints_the_resolved_recipe(name, method, capsys, monkeypatch):
    import yaml

    from fv_accel.cli import main

    monkeypatch.chdir(REPO)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(method, ["--config", f"configs/{name}.yaml", "--dry-run"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["method"]["name"] == method
    assert printed["training"]["checkpoint"]["output_dir"] == f"outputs/{name}"


def test_the_wan_recipes_have_fastvideos_values():
    from fv_accel.config import load_config

    pre = load_config(REPO / "configs" / "wan2_1_t2v_1_3b_anyflow_pretrain.yaml")
    m = pre.method
    assert (m.diffusion_ratio, m.consistency_ratio, m.epsilon, m.weight_type, m.fuse_guidance_scale) == (0.5, 0.25, 5, "beta08", 3.0)
    assert pre.training.optimizer.learning_rate == 5e-5 and pre.models.student.flow_shift == 5.0
    assert pre.models.student.anyflow_from_wan and pre.models.student.init_from == "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
    on = load_config(REPO / "configs" / "wan2_1_t2v_1_3b_anyflow_onpolicy.yaml")
    m = on.method
    assert m.t_list_override == [999.0, 937.0, 833.0, 624.0, 0.0] and m.real_score_guidance_scale == 3.0
    assert m.generator_update_interval == 5 and m.fake_score_learning_rate == 8e-6
    assert on.training.optimizer.learning_rate == 2e-6
    assert on.models.teacher.init_from == "Wan-AI/Wan2.1-T2V-14B-Diffusers"
    assert on.models.critic.init_from == "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"


# ---- end to end on the AnyFlow family's tiny students ----
def anyflow_family():
    return pytest.importorskip("fv_accel.models.anyflow")


def test_both_stages_train_end_to_end(tmp_path):
    """Pretraining of a flow map made from a tiny Wan, then on-policy distillation of it from a tiny
    Wan teacher: losses finite, the students' weights move, the teacher's do not; the outputs hold
    the student, the stock flow-map scheduler, student_steps.json and the critic."""
    anyflow_family()
    from fv_accel import Trainer

    from fv_accel.models.anyflow import AnyFlowStudent

    pre_dir = tmp_path / "pre"
    run = build(PRETRAIN_RECIPE, pretrain_overrides(pre_dir, **{
        "models.student.init_from": None, "models.student.transformer_config": dict(TINY_TEACHER),
        "models.student.anyflow_from_wan": True, "training.loop.max_train_steps": 2, "training.tracker.log_every": 1}))
    assert isinstance(run.method.student, AnyFlowStudent)
    before = {k: v.detach().clone() for k, v in run.method.student.transformer.state_dict().items()}
    summary = Trainer(run).run()
    assert summary["steps"] == 2 and torch.isfinite(torch.tensor(summary["last_loss"]))
    after = run.method.student.transformer.state_dict()
    assert any(not torch.equal(v, after[k]) for k, v in before.items())
    rows = [json.loads(x) for x in (pre_dir / "out" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["diffusion_fraction"] for r in rows] == [0.5, 0.5] and rows[0]["consistency_fraction"] == 0.0  # batch 2
    assert (pre_dir / "out" / "transformer" / "config.json").is_file()

    on_dir = tmp_path / "on"
    run = build(DMD2_RECIPE, onpolicy_overrides(on_dir, **{
        "models.student.init_from": None, "models.student.transformer_config": dict(TINY_TEACHER),
        "models.student.anyflow_from_wan": True, "method.generator_update_interval": 2,
        "training.loop.max_train_steps": 2, "training.tracker.log_every": 1}))
    m = run.method
    assert isinstance(m.student, AnyFlowStudent) and m.teacher.family == "wan"
    teacher = {k: v.detach().clone() for k, v in m.teacher.transformer.state_dict().items()}
    student = {k: v.detach().clone() for k, v in m.student.transformer.state_dict().items()}
    summary = Trainer(run).run()
    assert summary["steps"] == 2
    rows = [json.loads(x) for x in (on_dir / "out" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["update_student"] for r in rows] == [0.0, 1.0] and rows[1]["generator_loss"] > 0
    assert all(torch.equal(v, m.teacher.transformer.state_dict()[k]) for k, v in teacher.items())
    assert any(not torch.equal(v, m.student.transformer.state_dict()[k]) for k, v in student.items())
    out = on_dir / "out"
    steps = json.loads((out / "student_steps.json").read_text())
    assert steps["timesteps"] == T_LIST and steps["student_sample_type"] == "flow_map"
    assert (out / "critic" / "transformer").is_dir()


def test_a_forced_collapse_warns_as_for_dmd2(tmp_path, caplog):
    """Sample videos step the student with the stock flow-map scheduler at its rollout's 4 steps
    against the teacher's: a student whose every sample is the same still latent (its flow map
    u = x / sigma lands every step on x0 = 0) is reported collapsing and stops the run."""
    import logging

    anyflow_family()
    from fv_accel import Trainer

    run = build(DMD2_RECIPE, onpolicy_overrides(tmp_path, **{
        "models.student.init_from": None, "models.student.transformer_config": dict(TINY_TEACHER),
        "models.student.anyflow_from_wan": True,
        "callbacks.validation.enable": True, "callbacks.validation.every_steps": 2,
        "callbacks.validation.prompts": ["a white square moving up on a light background"],
        "callbacks.validation.sampling_steps": 4, "callbacks.validation.guidance_scale": 1.0,
        "callbacks.validation.stop_on_collapse": True, "training.loop.max_train_steps": 4}))

    def still(module, args, kwargs, output):
        if torch.is_grad_enabled():  # training steps run as usual; only the samples collapse
            return None
        x = kwargs.get("hidden_states", args[0] if args else None)
        t = kwargs.get("timestep", args[1] if len(args) > 1 else None).float() / 1000.0
        if t.ndim == 2:  # per latent frame, [B, T], the frames on x's axis 1 or 2
            t = t.reshape(t.shape[0], t.shape[1], 1, 1, 1) if x.shape[1] == t.shape[1] else t.reshape(t.shape[0], 1, t.shape[1], 1, 1)
        else:
            t = t.reshape(-1, *([1] * (x.ndim - 1)))
        velocity = x / t
        return (velocity,) if isinstance(output, tuple) else type(output)(sample=velocity)

    run.method.student.transformer.register_forward_hook(still, with_kwargs=True)
    with caplog.at_level(logging.WARNING, logger="fv_accel.validation"):
        summary = Trainer(run).run()
    warnings = [r.getMessage() for r in caplog.records if "collapsing" in r.getMessage()]
    assert warnings and warnings[0].startswith("step 2: the student's samples are collapsing")
    assert summary["stopped_by"].startswith("callbacks.validation.stop_on_collapse") and summary["final_step"] == 2


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_pretraining_resumes_bitwise(tmp_path, lora):
    """A pretraining run stopped at step 2 and resumed equals a straight 4-step run bit for bit
    (weights and the method's generator, whose draws pick t, r and the noise); with a LoRA student
    only the adapter trains."""
    anyflow_family()
    from fv_accel import Trainer

    def overrides(folder, steps, **extra):
        return pretrain_overrides(folder, **{
            "models.student.init_from": None, "models.student.transformer_config": dict(TINY_TEACHER),
            "models.student.anyflow_from_wan": True, **({"models.student.lora.enable": True, "models.student.lora.rank": 4} if lora else {}),
            "training.checkpoint.training_state_checkpointing_steps": 2, "training.loop.max_train_steps": steps,
            "training.data.train_batch_size": 4, **extra})

    straight = build(PRETRAIN_RECIPE, overrides(tmp_path / "a", 4))
    start = {k: v.detach().clone() for k, v in straight.method.student.transformer.named_parameters()}
    Trainer(straight).run()
    Trainer(build(PRETRAIN_RECIPE, overrides(tmp_path / "b", 2))).run()
    resumed = build(PRETRAIN_RECIPE, overrides(tmp_path / "b", 4, **{"training.checkpoint.resume_from_checkpoint": "latest"}))
    assert resumed.start_step == 2
    Trainer(resumed).run()
    a = dict(straight.method.student.transformer.named_parameters())
    b = dict(resumed.method.student.transformer.named_parameters())
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(straight.method.cuda_generator.get_state(), resumed.method.cuda_generator.get_state())
    moved = {k for k, v in a.items() if not torch.equal(v, start[k])}
    assert moved and (all("lora" in k for k in moved) if lora else any("delta_embedder" in k for k in moved))
