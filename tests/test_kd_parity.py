"""fv_accel's KD and causal KD against FastVideo 0.2.1's: with the student's prediction replaced by
the stand-in of tests/kd_standins.py and the same stand-in teacher-trajectory batch and seed, every
iteration's KD loss equals, to 1e-5 relative, what FastVideo's own `KDMethod` / `KDCausalMethod
.single_train_step` computed (tests/data/kd_fastvideo_golden.json), the student is given the same
timesteps (per sample, or per latent frame), the generator ends each iteration in the same state,
and the teacher's ODE timesteps (the cache's) are FastVideo's. The cases cover batch 1 and 2,
t_list choices (4 and 2 steps, a last entry that is not cached), teachers of 48 and 16 steps,
shifts 5 and 3, bf16 caches, and causal blocks of 1, 2, 3 and 4 frames (4: a shorter last block)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kd_helpers import KD_RECIPE, kd_overrides
from kd_standins import kd_standin_batch, kd_standin_predict
from test_dmd2_parity import assert_loss

REPO = Path(__file__).resolve().parents[1]
GOLDEN = json.loads((REPO / "tests" / "data" / "kd_fastvideo_golden.json").read_text())
CLASS_TO_NAME = {"KDMethod": "kd", "KDCausalMethod": "kd_causal"}


def case_shapes(case: dict[str, Any]) -> dict[str, int]:
    return {**GOLDEN["shapes"], **case.get("shapes", {})}


def build_kd_method(overrides: dict) -> Any:
    """The KD method of a tiny recipe, its roles built as the run builds them (no loader, no cache)."""
    from fv_accel.build import build_accelerator, build_other_roles
    from fv_accel.config import load_config
    from fv_accel.methods import METHODS
    from fv_accel.models import build_student

    cfg = load_config(KD_RECIPE, overrides)
    acc = build_accelerator(cfg)
    student = build_student(cfg)
    student.attach_accelerator(acc)
    roles = {"student": student, **build_other_roles(cfg, acc, student)}
    return METHODS[cfg.method.name](cfg=cfg, role_models=roles)


def case_overrides(case: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    s = case_shapes(case)
    mc = case["method"]
    t_list = mc["t_list"]
    block = mc.get("num_frames_per_block", 3)
    return kd_overrides(
        tmp_path,
        **{
            "method.name": CLASS_TO_NAME[case["class"]],
            "method.t_list": t_list,
            "method.student_sample_steps": mc.get("student_sample_steps", len(t_list) - 1),
            "method.teacher_inference_steps": mc["teacher_inference_steps"],
            "method.teacher_guidance_scale": mc["teacher_guidance_scale"],
            "method.chunk_size": block,
            "method.num_frames_per_block": mc.get("num_frames_per_block"),
            "models.student.causal": case["class"] == "KDCausalMethod",
            "models.student.flow_shift": case["flow_shift"],
            "models.teacher.flow_shift": case["flow_shift"],
            "training.data.seed": GOLDEN["generator_seed"],
            "training.data.train_batch_size": s["B"],
            "training.data.text_max_length": s["L"],
            "training.loop.noise_rng": "rank",
        },
    )


def test_golden_file_is_fastvideo_0_2_1():
    assert GOLDEN["fastvideo_version"] == "0.2.1"
    cases = GOLDEN["cases"]
    assert {c["class"] for c in cases} == {"KDMethod", "KDCausalMethod"}
    for cls in ("KDMethod", "KDCausalMethod"):
        mine = [c for c in cases if c["class"] == cls]
        assert len(mine) >= 4 and any(case_shapes(c)["B"] == 1 for c in mine)
        assert {c["flow_shift"] for c in mine} == {3.0, 5.0} and {c["dtype"] for c in mine} == {"float32", "bfloat16"}
    assert {c["method"].get("num_frames_per_block") for c in cases if c["class"] == "KDCausalMethod"} == {1, 2, 3, 4}
    # Every case draws more than one step index over its iterations (a step that is never drawn is not tested).
    for case in cases:
        key = "kd_step_idx" if case["class"] == "KDMethod" else "kd_mean_step_idx"
        assert len({r["metrics"][key] for r in case["results"]}) > 1, case["name"]


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=[case["name"] for case in GOLDEN["cases"]])
def test_kd_losses_match_fastvideo(case, tmp_path):
    from fv_accel.methods.knowledge_distillation.cache import teacher_timesteps

    cached = teacher_timesteps(case["method"]["teacher_inference_steps"], case["flow_shift"])
    assert cached == case["cached_timesteps"]
    method = build_kd_method(case_overrides(case, tmp_path))
    calls: list[dict] = []

    def predict_noise(noisy, timesteps, tb, *, conditional=True, cfg_uncond=None, attn_kind="dense"):
        calls.append({"timestep": [float(v) for v in timesteps.reshape(-1)], "shape": list(timesteps.shape)})
        return kd_standin_predict(noisy, timesteps)

    method.student.predict_noise = predict_noise
    method.cuda_generator.manual_seed(GOLDEN["generator_seed"])
    batch = kd_standin_batch(**case_shapes(case), timesteps=cached, seed=GOLDEN["batch_seed"], dtype=getattr(torch, case["dtype"]))
    for record in case["results"]:
        calls.clear()
        where = f"{case['name']} iteration {record['iteration']}"
        loss_map, _, metrics = method.single_train_step(batch, record["iteration"])
        assert_loss(loss_map["kd_loss"], record["kd_loss"], f"{where} kd_loss")
        assert_loss(loss_map["total_loss"], record["total_loss"], f"{where} total_loss")
        for key, value in record["metrics"].items():
            assert float(metrics[key]) == pytest.approx(value, rel=1e-6), f"{where} {key}"
        assert [(c["timestep"], c["shape"]) for c in calls] == [(c["timestep"], c["shape"]) for c in record["model_calls"]], where
        state = hashlib.sha256(method.cuda_generator.get_state().numpy().tobytes()).hexdigest()
        assert state == record["generator_state_sha256"], f"{where}: generator"
