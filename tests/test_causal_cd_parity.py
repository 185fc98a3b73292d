"""fv_accel's causal consistency distillation against FastVideo 0.2.1's: with the role predictions
replaced by the stand-ins of tests/causal_cd_standins.py (each role's teacher-forced flow depends on
the block-causal mean of the clean context it is given and on its one parameter `w`, the first entry
of its `scale_shift_table`), the same batch and seeds, every step's loss, the student's `w` after the
optimizer step and the EMA's `w` after the EMA update equal, to 1e-5 relative, what FastVideo's own
`CausalConsistencyDistillationMethod` computed (tests/data/causal_cd_fastvideo_golden.json, written
by tests/fastvideo_reference/make_causal_cd_golden.py); the generator ends each step in FastVideo's
state and the roles are called at FastVideo's timesteps. Cases: batch 1 and 2, guidance 1 (where
fv_accel skips the unconditional pass), 2, 3 and 4.5, discrete_cd_N 2, 4, 8, 16 and 48, the EMA
starting at step 1, mid-run or never, shift 3, 5 and the default (5)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from causal_cd_helpers import CD_RECIPE, causal_cd_overrides
from causal_cd_standins import CHUNK, CONTEXT_WEIGHT, W_INIT, cd_standin_flow
from dmd2_standins import standin_batch

REPO = Path(__file__).resolve().parents[1]
GOLDEN = json.loads((REPO / "tests" / "data" / "causal_cd_fastvideo_golden.json").read_text())


def case_shapes(case: dict) -> dict:
    return {**GOLDEN["shapes"], **case.get("shapes", {})}


def w_of(role: Any) -> torch.Tensor:
    return role.transformer.scale_shift_table.view(-1)[0:1]


def install_standins(method: Any) -> list:
    """Each role's teacher-forcing forward becomes the stand-in (given the context and its timestep the
    method passes); returns the list the calls are recorded in."""
    calls: list = []
    for name in ("student", "teacher", "ema"):
        role = getattr(method, name)

        def teacher_forcing(context, context_t, noisy, timesteps, tb, *, conditional=True, _name=name, _role=role):
            calls.append({"role": _name, "conditional": bool(conditional), "timestep": float(timesteps.reshape(-1)[0]),
                          "shape": list(timesteps.shape)})
            return None, cd_standin_flow(_name, noisy, timesteps, conditional, context, context_t, w_of(_role))

        role.predict_noise_teacher_forcing = teacher_forcing
    return calls


def close(ours: float, theirs: dict, what: str, rel: float = 1e-5, floor: float = 1e-9) -> None:
    expected = float.fromhex(theirs["hex"])
    assert abs(ours - expected) <= max(rel * abs(expected), floor), f"{what}: ours {ours!r}, FastVideo's {expected!r}"


def overrides(case: dict, tmp_path: Path, data_path: str) -> dict:
    s, m, opt = case_shapes(case), case["method"], GOLDEN["optimizer"]
    shift = case["pipeline_flow_shift"]
    return causal_cd_overrides(tmp_path, data_path, **{
        **{f"method.{k}": v for k, v in m.items()},
        "models.student.flow_shift": shift or None,
        "models.student.latents_mean": [0.0] * s["C"],
        "models.student.latents_std": [1.0] * s["C"],
        "training.data.seed": GOLDEN["generator_seed"],
        "training.data.train_batch_size": s["B"],
        "training.data.text_max_length": s["L"],
        "training.loop.noise_rng": "rank",
        "training.loop.max_train_steps": len(GOLDEN["iterations"]),
        "training.optimizer.learning_rate": opt["learning_rate"],
        "training.optimizer.betas": opt["betas"],
        "training.optimizer.weight_decay": opt["weight_decay"],
        "training.optimizer.eps": 1e-8,
        "training.optimizer.lr_scheduler": opt["lr_scheduler"],
        "training.optimizer.lr_warmup_steps": 0,
        "training.checkpoint.save_final": False,
    })


def test_golden_file_is_fastvideo_0_2_1():
    assert GOLDEN["fastvideo_version"] == "0.2.1"
    assert (GOLDEN["chunk"], GOLDEN["context_weight"], GOLDEN["w_init"]) == (CHUNK, CONTEXT_WEIGHT, W_INIT)
    cases = GOLDEN["cases"]
    assert any(case_shapes(c)["B"] == 1 for c in cases) and any(case_shapes(c)["B"] == 2 for c in cases)
    assert {c["method"]["guidance_scale"] == 1.0 for c in cases} == {True, False}
    assert len({c["method"]["discrete_cd_N"] for c in cases}) >= 4
    starts = {c["method"]["ema_start_step"] for c in cases}
    assert min(starts) == 1 and max(starts) > len(GOLDEN["iterations"]) and starts & set(GOLDEN["iterations"][1:])
    # The EMA stays put before its start step and moves from it on, in the golden itself.
    for c in cases:
        for r in c["results"]:
            moved = float.fromhex(r["ema_w"]["hex"]) != float(torch.tensor(W_INIT))
            assert moved == (r["iteration"] >= c["method"]["ema_start_step"]), (c["name"], r["iteration"])


def case_method(run: Any, case: dict) -> Any:
    """A fresh method over the run's roles with the case's recipe (its keys and flow shift), the stand-ins
    installed and every role's `w` back at W_INIT, with a fresh optimizer and schedule of the recipe's."""
    from fv_accel.methods import METHODS
    from fv_accel.optim import build_lr_scheduler, build_optimizer

    cfg = run.config
    shift = case["pipeline_flow_shift"] or None
    cfg = dataclasses.replace(
        cfg, method=dataclasses.replace(cfg.method, **case["method"]),
        models=dataclasses.replace(cfg.models, student=dataclasses.replace(cfg.models.student, flow_shift=shift)),
    )
    method = METHODS["causal_cd"](cfg=cfg, role_models=run.method.role_models)
    method.optimizer = build_optimizer(cfg, method.student.trainable_parameters())
    method.lr_scheduler = build_lr_scheduler(cfg, method.optimizer)
    return method


def run_case(method: Any, case: dict) -> None:
    assert method.flow_shift == case["derived"]["flow_shift"], case["name"]
    assert torch.equal(method.timesteps, torch.tensor(case["derived"]["timesteps"])), case["name"]
    calls = install_standins(method)
    method.cuda_generator.manual_seed(GOLDEN["generator_seed"])
    batch = standin_batch(**case_shapes(case), seed=GOLDEN["batch_seed"])
    guidance = case["method"]["guidance_scale"]
    w_floor = 1e-5 * W_INIT  # `w` passes near 0 in some cases: its scale is W_INIT
    for record in case["results"]:
        step, where = record["iteration"], f"{case['name']} step {record['iteration']}"
        calls.clear()
        loss_map, outputs, _ = method.single_train_step(batch, step)
        method.backward(loss_map, outputs)
        method.optimizer.step()
        method.lr_scheduler.step()
        method.optimizer.zero_grad()
        method.on_step_end(step)
        close(float(loss_map["total_loss"].detach()), record["total_loss"], f"{where} loss")
        close(float(w_of(method.student).detach()), record["student_w"], f"{where} student w", floor=w_floor)
        close(float(w_of(method.ema)), record["ema_w"], f"{where} ema w", floor=w_floor)
        state = hashlib.sha256(method.cuda_generator.get_state().numpy().tobytes()).hexdigest()
        assert state == record["generator_state_sha256"], f"{where}: generator state"
        # At guidance 1 fv_accel skips the teacher's unconditional pass (its weight is 0).
        theirs = [c for c in record["model_calls"] if guidance != 1.0 or c["conditional"] or c["role"] != "teacher"]
        assert [(c["role"], c["conditional"], c["shape"]) for c in calls] == [
            (c["role"], c["conditional"], c["shape"]) for c in theirs], where
        for ours, expected in zip(calls, theirs):
            assert abs(ours["timestep"] - expected["timestep"]) <= 1e-4, f"{where}: {ours} vs {expected}"


def test_causal_cd_matches_fastvideo(tmp_path, tiny_data_path):
    """Every case of the golden file on one built run (a fresh method and optimizer per case)."""
    from fv_accel import build_from_config

    run = build_from_config(CD_RECIPE, overrides(GOLDEN["cases"][0], tmp_path, tiny_data_path))
    try:
        for case in GOLDEN["cases"]:
            with torch.no_grad():
                for role in (run.method.student, run.method.teacher, run.method.ema):
                    role.transformer.scale_shift_table.view(-1)[0] = W_INIT
            run_case(case_method(run, case), case)
    finally:
        if run.output_lock is not None:
            run.output_lock.release()
