"""Causal consistency distillation (fv_accel/methods/consistency_model/causal_cd.py) on tiny models:
the EMA target travels in checkpoints (a resumed run equals a straight one bit for bit, EMA included,
full and LoRA, whose EMA is a second adapter), roles that cannot run the teacher-forcing forward, bad
keys and text-only data are refused in one line, a short run's output loads back and
`python -m fv_accel.generate` streams it, `--dry-run` counts the three roles, 2 processes equal 1 and
FSDP2 resumes the sharded EMA (multiproc). Its losses against FastVideo 0.2.1's:
tests/test_causal_cd_parity.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from causal_cd_helpers import CD_RECIPE, causal_cd_overrides
from fv_accel.build import build_from_config
from fv_accel.trainer import Trainer
from resume_helpers import reset_accelerate


def _run(tmp: Path, data_path: str, **extra):
    reset_accelerate()
    run = build_from_config(CD_RECIPE, causal_cd_overrides(tmp, data_path, **extra))
    Trainer(run).run()
    return run


def _state(role) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in role.transformer.state_dict().items()}


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_resume_equals_a_straight_run_bitwise_ema_included(tmp_path, tiny_data_path, lora):
    """With a LoRA student the EMA is a second adapter over the student's base (compared with the rest)."""
    common = {"models.student.lora.enable": lora, "method.ema_start_step": 2, "method.ema_decay": 0.5, "method.guidance_scale": 3.0,
              "training.checkpoint.training_state_checkpointing_steps": 3, "training.checkpoint.save_final": False}
    straight = _run(tmp_path / "a", tiny_data_path, **common, **{"training.loop.max_train_steps": 6})
    _run(tmp_path / "b", tiny_data_path, **common, **{"training.loop.max_train_steps": 3})
    reset_accelerate()
    resumed = build_from_config(CD_RECIPE, causal_cd_overrides(tmp_path / "b", tiny_data_path, **common, **{
        "training.loop.max_train_steps": 6, "training.checkpoint.resume_from_checkpoint": "latest"}))
    assert resumed.start_step == 3
    # Before the first resumed step the EMA is the checkpoint's (it moved at steps 2 and 3), not the start's.
    start = [ema.detach().clone() for _, ema in resumed.method.ema_pairs()]
    reset_accelerate()
    fresh = build_from_config(CD_RECIPE, causal_cd_overrides(tmp_path / "c", tiny_data_path, **common))
    assert any(not torch.equal(a, b) for a, (_, b) in zip(start, fresh.method.ema_pairs()))
    Trainer(resumed).run()
    a, b = _state(straight.method.student), _state(resumed.method.student)  # with LoRA both adapters
    assert a.keys() == b.keys() and (not lora or any(".ema." in k for k in a))
    for k in a:
        assert torch.equal(a[k], b[k]), k
    pairs = list(zip(straight.method.ema_pairs(), resumed.method.ema_pairs()))
    assert pairs and all(torch.equal(x[1], y[1]) for x, y in pairs)
    # The EMA followed the student (decay 0.5 from step 2): it differs from its start and from the student.
    assert any(not torch.equal(ema, s) for s, ema in straight.method.ema_pairs())
    assert any(not torch.equal(x, y) for (_, x), (_, y) in zip(straight.method.ema_pairs(), fresh.method.ema_pairs()))
    assert torch.equal(straight.method.cuda_generator.get_state(), resumed.method.cuda_generator.get_state())


@pytest.mark.parametrize("extra,message", [
    ({"models.teacher.causal": False, "models.student.causal": False, "models.ema.causal": False},
     "models.student: method.name causal_cd needs a block-causal model: set models.student.causal: true"),
    ({"models.ema.causal": False}, "models.ema: method.name causal_cd needs a block-causal model"),
    ({"method.discrete_cd_N": 1}, "method.discrete_cd_N must be an integer >= 2, got 1"),
    ({"method.ema_decay": 1.5}, "method.ema_decay must be in [0, 1], got 1.5"),
])
def test_refused_in_one_line_at_build(tmp_path, tiny_data_path, extra, message):
    reset_accelerate()
    with pytest.raises(ValueError) as err:
        build_from_config(CD_RECIPE, causal_cd_overrides(tmp_path, tiny_data_path, **extra))
    text = str(err.value)
    assert message in text and "\n" not in text, text


def test_a_family_without_teacher_forcing_is_refused_in_one_line():
    from types import SimpleNamespace

    from fv_accel.methods.consistency_model.causal_cd import check_teacher_forcing_role

    with pytest.raises(ValueError) as err:
        check_teacher_forcing_role("teacher", SimpleNamespace(family="ltx_video", causal_block_size=3))
    text = str(err.value)
    assert text.startswith("models.teacher: ") and "ltx_video family has no teacher-forcing forward" in text
    assert "\n" not in text


def test_output_loads_back_and_generate_streams_it(tmp_path, tiny_data_path):
    from fv_accel.generate import build_parser, generate

    # A checkpoint holds the recipe generate builds the student from.
    run = _run(tmp_path, tiny_data_path, **{"training.loop.max_train_steps": 2, "training.checkpoint.save_final": True,
                                            "training.checkpoint.training_state_checkpointing_steps": 2})
    out = tmp_path / "out"
    saved = json.loads((out / "transformer" / "config.json").read_text())
    assert saved["num_layers"] == 1  # the student's own (TINY_TEACHER), as trained
    from safetensors.torch import load_file

    weights = {}
    for f in sorted((out / "transformer").glob("*.safetensors")):
        weights.update(load_file(str(f)))
    student = run.accelerator.unwrap_model(run.method.student.transformer).state_dict()
    assert weights.keys() == student.keys()
    assert all(torch.equal(weights[k], student[k].detach().to(weights[k].dtype)) for k in weights)
    video = tmp_path / "cd.mp4"
    args = build_parser().parse_args([str(out), "--prompt", "a red circle", "--output", str(video), "--steps", "2",
                                      "--num_frames", "21"])
    report = generate(args)
    assert report.streamed and report.chunks == 2 and report.frames == 21  # 6 latent frames, blocks of 3
    assert video.is_file() and video.stat().st_size > 0


def test_dry_run_counts_the_three_roles(tmp_path, tiny_data_path):
    from fv_accel.config import load_config
    from fv_accel.memory_estimate import estimate_memory

    cfg = load_config(CD_RECIPE, causal_cd_overrides(tmp_path, tiny_data_path))
    est = estimate_memory(cfg, {})
    plain = load_config(CD_RECIPE, causal_cd_overrides(tmp_path, tiny_data_path))
    plain.method.name = "tfsft"  # the same student trained alone
    alone = estimate_memory(plain, {})
    n = est.census.total
    assert est.parameters == pytest.approx(3 * alone.parameters)
    assert any(f"frozen teacher {n:,} parameters and the frozen ema {n:,} parameters" in note for note in est.notes), est.notes


@pytest.mark.multiproc
def test_two_processes_equal_one_process(tmp_path, tiny_data_path):
    """2 processes x batch 1 (DDP) == 1 process x batch 2, the EMA moving from step 1: with
    `noise_rng: sample` the schedule index comes from a generator of (seed, step), the same on both ranks."""
    from safetensors.torch import load_file

    from test_distributed import WEIGHT_TOL, _driver, launch, max_diff

    def run(name: str, batch: int) -> dict:
        return {"name": name, "recipe": CD_RECIPE, "engine": "launch", "overrides": causal_cd_overrides(
            tmp_path / name, tiny_data_path, **{
                "training.checkpoint.output_dir": str(tmp_path / name / "out"), "training.loop.noise_rng": "sample",
                "training.data.train_batch_size": batch, "training.loop.max_train_steps": 3,
                "training.optimizer.eps": 1e-5, "method.ema_start_step": 1, "method.guidance_scale": 3.0})}

    records = launch("accelerate_configs/cpu_2proc.yaml", [run("cd_2proc", 1)], tmp_path)["cd_2proc"]
    folder = tmp_path / "records" / "cd_2proc"
    w0, w1, init = (load_file(str(folder / f"{n}.safetensors")) for n in ("rank0", "rank1", "init"))
    assert max_diff(w0, w1) == 0.0 and max_diff(w0, init) > 1e-4
    driver = _driver()
    driver.reset_accelerate()
    single = driver.run_one(run("cd_batch2", 2), tmp_path / "records")
    w_single = load_file(str(tmp_path / "records" / "cd_batch2" / "rank0.safetensors"))
    assert max_diff(w0, w_single) < WEIGHT_TOL
    for step in range(3):
        mean_of_ranks = (records[0]["steps"][step]["local_loss"] + records[1]["steps"][step]["local_loss"]) / 2
        assert single["logged"][step]["loss"] == pytest.approx(mean_of_ranks, abs=1e-5)


def test_a_text_only_dataset_is_refused_in_one_line():
    from types import SimpleNamespace

    from fv_accel.config import ConfigError
    from fv_accel.methods.consistency_model.causal_cd import CausalConsistencyDistillationMethod

    loader = SimpleNamespace(dataset=SimpleNamespace(text_only=True, data_path="data/prompts"))
    with pytest.raises(ConfigError) as err:
        CausalConsistencyDistillationMethod.check_data(None, loader)
    text = str(err.value)
    assert text.startswith("training.data.data_path data/prompts: a text-only dataset") and "\n" not in text
    CausalConsistencyDistillationMethod.check_data(None, SimpleNamespace(dataset=SimpleNamespace(text_only=False)))


@pytest.mark.multiproc
def test_fsdp2_shards_the_ema_and_resumes_it(tmp_path, tiny_data_path):
    """2 processes under FSDP2 (every role sharded, the EMA updated on its shards): a run resumed from
    its step-2 checkpoint computes step 3's losses bit for bit as the straight run did on each rank."""
    from test_distributed import launch

    def run(name: str, **extra) -> dict:
        return {"name": name, "recipe": CD_RECIPE, "engine": "fsdp2", "overrides": causal_cd_overrides(
            tmp_path / name, tiny_data_path, **{
                "training.checkpoint.output_dir": str(tmp_path / name / "out"), "training.loop.noise_rng": "sample",
                "training.data.train_batch_size": 1, "training.loop.max_train_steps": 3, "method.ema_start_step": 1,
                "method.ema_decay": 0.5, "training.checkpoint.training_state_checkpointing_steps": 2,
                "training.checkpoint.checkpoints_total_limit": 0, **extra})}

    ckpt = str(tmp_path / "cd_fsdp2" / "out" / "checkpoint-2")
    records = launch("accelerate_configs/fsdp2.yaml", [
        run("cd_fsdp2"), run("cd_fsdp2_resumed", **{"training.checkpoint.resume_from_checkpoint": ckpt}),
    ], tmp_path, "--mixed_precision", "no")
    straight, resumed = records["cd_fsdp2"], records["cd_fsdp2_resumed"]
    for rank in (0, 1):
        assert [s["local_loss"] for s in resumed[rank]["steps"]] == [straight[rank]["steps"][2]["local_loss"]]
    assert straight[0]["steps"][2]["local_loss"] != straight[1]["steps"][2]["local_loss"]  # the ranks' own samples


def test_a_lora_run_writes_the_trained_adapter_only_and_streams(tmp_path, tiny_data_path):
    """With LoRA the EMA is a second adapter over the base: the output holds the trained adapter alone."""
    from safetensors.torch import load_file

    from fv_accel.generate import build_parser, generate

    _run(tmp_path, tiny_data_path, **{"models.student.lora.enable": True, "training.loop.max_train_steps": 2,
                                      "method.ema_start_step": 1, "training.checkpoint.save_final": True,
                                      "training.checkpoint.training_state_checkpointing_steps": 2})
    out = tmp_path / "out"
    keys = list(load_file(str(out / "pytorch_lora_weights.safetensors")))
    assert keys and not [k for k in keys if ".ema." in k or "_ema" in k]
    args = build_parser().parse_args([str(out), "--prompt", "a red circle", "--output", str(tmp_path / "lora.mp4"),
                                      "--steps", "2", "--num_frames", "21"])
    report = generate(args)
    assert report.streamed and report.chunks == 2 and report.frames == 21
