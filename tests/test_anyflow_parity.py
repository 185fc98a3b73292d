"""fv_accel's AnyFlow methods against FastVideo 0.2.1's: with the role models' transformers replaced
by the shared stand-ins (tests/anyflow_standins.py for the student's flow map, tests/dmd2_standins.py
for teacher and critic), the same batch and seed, every iteration's losses, the gradient of the
loss with respect to each prediction made with gradient (per sample: L1, L2 and its dot product
with the prediction, which fix the target, the timestep weights and the scale balance), the
metrics, every flow-map call's (t, r) and the generator's state equal, to 1e-5 relative, what
FastVideo's own `AnyFlowPretrainMethod` / `AnyFlowMethod.single_train_step` gave
(tests/data/anyflow_fastvideo_golden.json, written by tests/fastvideo_reference/make_anyflow_golden.py).

The student here is the tests' tiny Wan given a `predict_velocity_with_r` (the stand-in replaces
its forward anyway), so the test needs nothing of the AnyFlow model family."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from anyflow_standins import standin_velocity_with_r
from conftest import tiny_overrides
from dmd2_helpers import dmd2_overrides
from dmd2_standins import standin_batch, standin_predict_noise
from test_dmd2_parity import assert_loss, generator_sha256

REPO = Path(__file__).resolve().parents[1]
GOLDEN = json.loads((REPO / "tests" / "data" / "anyflow_fastvideo_golden.json").read_text())
RTOL = 1e-5
PRETRAIN_RECIPE = REPO / "configs" / "tiny_finetune.yaml"
ONPOLICY_RECIPE = REPO / "configs" / "tiny_dmd2.yaml"
PRETRAIN_CASES = [c for c in GOLDEN["cases"] if c["kind"] == "pretrain"]
ONPOLICY_CASES = [c for c in GOLDEN["cases"] if c["kind"] == "onpolicy"]
# The on-policy keys a case may leave out: the tiny DMD2 recipe's values then give way to FastVideo's defaults.
ONPOLICY_DEFAULTS = {"dmd_denoising_steps": None, "t_list_override": None, "min_timestep_ratio": 0.0, "max_timestep_ratio": 1.0}


@pytest.fixture
def flow_map_wan(monkeypatch):
    """The tiny Wan student class with a `predict_velocity_with_r` (replaced per instance by the stand-in)."""
    from fv_accel.models.wan import WanStudent

    def unreachable(self, *args, **kwargs):
        raise AssertionError("the stand-in replaces the student's flow map")

    monkeypatch.setattr(WanStudent, "predict_velocity_with_r", unreachable, raising=False)


def common_overrides(case: dict[str, Any], data_path: str) -> dict[str, Any]:
    s = case["shapes"]
    return {
        "models.student.latents_mean": [0.0] * s["C"],
        "models.student.latents_std": [1.0] * s["C"],
        "models.student.flow_shift": case["flow_shift"],
        "training.data.data_path": data_path,
        "training.data.seed": GOLDEN["generator_seed"],
        "training.data.train_batch_size": s["B"],
        "training.data.text_max_length": s["L"],
        "training.loop.noise_rng": "rank",
        "training.loop.max_train_steps": 6,
        "training.checkpoint.save_final": False,
    }


def case_overrides(case: dict[str, Any], tmp_path: Path, data_path: str) -> dict[str, Any]:
    method = {**case["method"], **case.get("ours_method", {})}
    if case["kind"] == "pretrain":
        out = tiny_overrides(tmp_path, **{"method.name": "anyflow_pretrain"})
        out.update(common_overrides(case, data_path))
        out.update({f"method.{k}": v for k, v in method.items()})
        return out
    extra = {f"method.{k}": v for k, v in {**ONPOLICY_DEFAULTS, **method}.items()}
    extra.update(common_overrides(case, data_path))
    extra.update({f"models.{role}.flow_shift": case["flow_shift"] for role in ("teacher", "critic")})
    extra["method.name"] = "anyflow"
    return dmd2_overrides(tmp_path, **extra)


class Recorder:
    """The stand-in predictions, each made with gradient returned as a recorded leaf, and the student's flow-map calls."""

    def __init__(self) -> None:
        self.leaves: dict[str, list[torch.Tensor]] = {"student": [], "critic": []}
        self.calls: list[dict[str, Any]] = []

    def leaf(self, role: str, out: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return out
        leaf = out.detach().requires_grad_(True)
        self.leaves.setdefault(role, []).append(leaf)
        return leaf

    def install(self, method: Any) -> None:
        def velocity(x, t, r, tb, *, conditional=True, cfg_uncond=None, attn_kind="dense"):
            self.calls.append({"conditional": bool(conditional), "grad": torch.is_grad_enabled(),
                               "t": [float(v) for v in t.reshape(-1)], "r": [float(v) for v in r.reshape(-1)]})
            return self.leaf("student", standin_velocity_with_r(x, t, r, conditional))

        method.student.predict_velocity_with_r = velocity
        for role in ("teacher", "critic"):
            if role not in method.role_models:
                continue

            def predict_noise(x, t, tb, *, conditional=True, cfg_uncond=None, attn_kind="dense", _role=role):
                return self.leaf(_role, standin_predict_noise(_role, x, t, conditional))

            method.role_models[role].predict_noise = predict_noise

    def clear(self) -> None:
        for leaves in self.leaves.values():
            leaves.clear()
        self.calls.clear()


def close(got: float, want: float, scale: float, where: str) -> None:
    assert abs(got - want) <= RTOL * max(abs(scale), 1e-12), f"{where}: fv_accel {got!r}, FastVideo {want!r}"


def assert_gradients(leaves: list[torch.Tensor], recorded: list[dict[str, list[str]]], where: str) -> None:
    mine = [leaf for leaf in leaves if leaf.grad is not None]
    assert len(mine) == len(recorded), f"{where}: {len(mine)} predictions with a gradient, FastVideo {len(recorded)}"
    for k, (leaf, rec) in enumerate(zip(mine, recorded)):
        g, p = leaf.grad.double(), leaf.detach().double()
        b = g.shape[0]
        ours = {"l1": g.abs().reshape(b, -1).sum(1), "l2": (g * g).reshape(b, -1).sum(1),
                "dot": (g * p).reshape(b, -1).sum(1), "dot_abs": (g * p).abs().reshape(b, -1).sum(1)}
        for i in range(b):
            for key in ("l1", "l2", "dot_abs"):
                want = float.fromhex(rec[key][i])
                close(float(ours[key][i]), want, want, f"{where} prediction {k} sample {i} gradient {key}")
            close(float(ours["dot"][i]), float.fromhex(rec["dot"][i]), float.fromhex(rec["dot_abs"][i]),
                  f"{where} prediction {k} sample {i} gradient dot")


def calls_that_count(recorded: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """FastVideo's flow-map calls without those its gradient rollout makes after the gradient step
    (it runs the remaining steps and discards them; fv_accel stops there). A rollout ends where the
    next call's t is not below the last one's."""
    out, skipping, last_t = [], False, None
    for call in (c for c in recorded if "t" in c):
        new_rollout = last_t is None or call["t"][0] >= last_t
        last_t = call["t"][0]
        if new_rollout:
            skipping = False
        if not skipping:
            out.append(call)
        skipping = skipping or call["grad"]
    return out


def assert_calls(calls: list[dict[str, Any]], recorded: list[dict[str, Any]], kind: str, where: str) -> None:
    student = calls_that_count(recorded) if kind == "onpolicy" else [c for c in recorded if "t" in c]
    assert len(calls) == len(student), f"{where}: {len(calls)} flow-map calls, FastVideo {len(student)}"
    for k, (mine, theirs) in enumerate(zip(calls, student)):
        assert (mine["conditional"], mine["grad"]) == (theirs["conditional"], theirs["grad"]), f"{where} call {k}"
        for key in ("t", "r"):
            assert len(mine[key]) == len(theirs[key]), f"{where} call {k} {key}"
            for a, b in zip(mine[key], theirs[key]):
                close(a, b, max(abs(b), 1.0), f"{where} call {k} {key}")


def build(case: dict[str, Any], tmp_path: Path, data_path: str) -> Any:
    from fv_accel import build_from_config

    recipe = PRETRAIN_RECIPE if case["kind"] == "pretrain" else ONPOLICY_RECIPE
    return build_from_config(str(recipe), case_overrides(case, tmp_path, data_path))


def run_iteration(method: Any, case: dict[str, Any], record: dict[str, Any], batch: dict, rec: Recorder) -> None:
    where = f"{case['name']} iteration {record['iteration']}"
    rec.clear()
    loss_map, _, metrics = method.single_train_step(batch, record["iteration"])
    if case["kind"] == "pretrain":
        assert_loss(loss_map["total_loss"].detach(), record["total_loss"], f"{where} total_loss")
        loss_map["total_loss"].backward()
        for key, value in record["metrics"].items():
            want = float.fromhex(value)
            close(float(metrics[key]), want, max(abs(want), 1.0), f"{where} metric {key}")
        assert_gradients(rec.leaves["student"], record["gradients"], f"{where} student")
    else:
        assert bool(float(metrics["update_student"])) == record["update_student"], where
        for key in ("generator_loss", "fake_score_loss", "total_loss"):
            assert_loss(loss_map[key].detach(), record[key], f"{where} {key}")
        if record["update_student"]:
            loss_map["generator_loss"].backward()
        loss_map["fake_score_loss"].backward()
        assert_gradients(rec.leaves["student"], record["student_gradients"], f"{where} student")
        assert_gradients(rec.leaves["critic"], record["critic_gradients"], f"{where} critic")
    assert_calls(rec.calls, record["model_calls"], case["kind"], where)
    assert generator_sha256(method.cuda_generator) == record["generator_state_sha256"], (
        f"{where}: the generator's state differs from FastVideo's (another number or order of draws)"
    )


def test_golden_file_is_fastvideo_0_2_1():
    assert GOLDEN["fastvideo_version"] == "0.2.1"
    assert len(PRETRAIN_CASES) >= 6 and len(ONPOLICY_CASES) >= 6
    assert {c["shapes"]["B"] for c in GOLDEN["cases"]} >= {1, 2, 4}
    # Every key takes more than one value across the cases.
    for kind, keys in (("pretrain", ("diffusion_ratio", "consistency_ratio", "epsilon", "weight_type", "fuse_guidance_scale")),
                       ("onpolicy", ("generator_update_interval", "use_mean_velocity", "student_sample_steps",
                                     "real_score_guidance_scale", "warp_denoising_step"))):
        for key in keys:
            values = {json.dumps(c["method"].get(key)) for c in GOLDEN["cases"] if c["kind"] == kind}
            assert len(values) > 1, f"{kind} cases all have {key} {values}"


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=[c["name"] for c in GOLDEN["cases"]])
def test_anyflow_matches_fastvideo(case, tmp_path, tiny_data_path, flow_map_wan):
    run = build(case, tmp_path, tiny_data_path)
    try:
        method = run.method
        rec = Recorder()
        rec.install(method)
        method.cuda_generator.manual_seed(GOLDEN["generator_seed"])
        batch = standin_batch(**case["shapes"], seed=GOLDEN["batch_seed"])
        for record in case["results"]:
            run_iteration(method, case, record, batch, rec)
    finally:
        if run.output_lock is not None:
            run.output_lock.release()
