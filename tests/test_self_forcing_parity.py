"""fv_accel's Self-Forcing method against FastVideo 0.2.1's: with the role models replaced by the
stand-in predictions (tests/dmd2_standins.py; the student's streaming prediction adds a term of what
its KV cache holds, as in tests/fastvideo_reference/make_self_forcing_golden.py), the same batch and
seeds, every iteration's generator, fake-score and total loss equals, to 1e-5 relative, the value
FastVideo's own `SelfForcingMethod.single_train_step` computed
(tests/data/self_forcing_fastvideo_golden.json), and both generators (the rank's, and the rollout's,
which FastVideo keeps in torch's global generator) end each iteration in the same state. The cases
cover batch 1 and 2 (FastVideo draws the rollout's noises in another layout at batch 1), sde and
ode stepping, context noise, one exit step for all chunks, the last step only, chunks of 1, 2 and 3
latent frames, warped steps, generator_update_interval 1, 2 and 5, guidance 1 and 4, a different
flow_shift per role, and score windows (min/max_timestep_ratio) that FastVideo's Self-Forcing does
not apply, with score draws inside and outside them."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from dmd2_standins import standin_batch, standin_predict_noise
from self_forcing_helpers import SF_RECIPE, self_forcing_overrides
from test_dmd2_parity import assert_loss

REPO = Path(__file__).resolve().parents[1]
GOLDEN = json.loads((REPO / "tests" / "data" / "self_forcing_fastvideo_golden.json").read_text())
LOSS_KEYS = ("generator_loss", "fake_score_loss", "total_loss")
METHOD_KEYS = (
    "chunk_size", "student_sample_type", "context_noise", "same_step_across_blocks", "last_step_only",
    "dmd_denoising_steps", "warp_denoising_step", "generator_update_interval", "real_score_guidance_scale",
    "min_timestep_ratio", "max_timestep_ratio",
)


def standin_context(cache: Any, batch_size: int) -> torch.Tensor:
    total = torch.zeros(batch_size, dtype=torch.float32)
    for x, t in cache.segments.get("standin", []):
        total = total + x.float().reshape(batch_size, -1).mean(dim=1) * (1.0 + t / 1000.0)
    return (GOLDEN["context_weight"] * total).view(batch_size, 1, 1, 1, 1)


def install_standins(method: Any) -> None:
    for role in ("teacher", "critic"):

        def predict_noise(noisy_latents, timesteps, training_batch, *, conditional=True, cfg_uncond=None,
                          attn_kind="dense", _role=role):
            return standin_predict_noise(_role, noisy_latents, timesteps, conditional)

        getattr(method, role).predict_noise = predict_noise

    def chunk_velocity(x, timestep, tb, cache, start, *, write=False):
        pred = standin_predict_noise("student", x, timestep, True) + standin_context(cache, x.shape[0])
        if write:
            cache.segments.setdefault("standin", []).append((x.detach().clone(), float(timestep.reshape(-1)[0])))
        return pred

    method.chunk_velocity = chunk_velocity


def state_sha256(generator: torch.Generator) -> str:
    return hashlib.sha256(generator.get_state().numpy().tobytes()).hexdigest()


def case_shapes(case: dict[str, Any]) -> dict[str, int]:
    """The case's shapes: the file's, with the case's own (its batch size) over them."""
    return {**GOLDEN["shapes"], **case.get("shapes", {})}


def case_overrides(case: dict[str, Any], tmp_path: Path, data_path: str) -> dict[str, Any]:
    s = case_shapes(case)
    extra: dict[str, Any] = {"method.min_timestep_ratio": 0.0, "method.max_timestep_ratio": 1.0}
    extra.update({f"method.{key}": case["method"][key] for key in METHOD_KEYS if key in case["method"]})
    extra.update({f"models.{role}.flow_shift": shift for role, shift in case["flow_shift"].items()})
    extra.update({
        "models.student.latents_mean": [0.0] * s["C"],
        "models.student.latents_std": [1.0] * s["C"],
        "training.data.data_path": data_path,
        "training.data.seed": GOLDEN["generator_seed"],
        "training.data.train_batch_size": s["B"],
        "training.data.text_max_length": s["L"],
        "training.loop.noise_rng": "rank",
        "training.loop.max_train_steps": len(GOLDEN["iterations"]),
        "training.checkpoint.save_final": False,
    })
    return self_forcing_overrides(tmp_path, **extra)


def score_draws_against_window(case: dict[str, Any]) -> tuple[int, int]:
    """(inside, outside): the teacher's and critic's timesteps against the case's score window."""
    n = 1000
    lo = int(case["method"].get("min_timestep_ratio", 0.0) * n)
    hi = int(case["method"].get("max_timestep_ratio", 1.0) * n)
    ts = [c["timestep"] for r in case["results"] for c in r["model_calls"] if c["role"] != "student"]
    inside = sum(lo <= t <= hi for t in ts)
    return inside, len(ts) - inside


def test_golden_file_is_fastvideo_0_2_1():
    assert GOLDEN["fastvideo_version"] == "0.2.1"
    assert len(GOLDEN["cases"]) >= 13
    assert {c["method"]["student_sample_type"] for c in GOLDEN["cases"]} == {"sde", "ode"}
    assert {c["method"]["chunk_size"] for c in GOLDEN["cases"]} == {1, 2, 3}
    batch1 = [c for c in GOLDEN["cases"] if case_shapes(c)["B"] == 1]
    assert {c["method"]["student_sample_type"] for c in batch1} == {"sde", "ode"}
    assert any(c["method"]["context_noise"] > 0 and c["method"]["student_sample_type"] == "ode" for c in batch1)
    # Cases whose score draws fall on both sides of their window: applying it would change them.
    windowed = [score_draws_against_window(c) for c in GOLDEN["cases"] if c["method"].get("min_timestep_ratio", 0) >= 0.3]
    assert len(windowed) >= 2 and all(inside > 0 and outside > 0 for inside, outside in windowed), windowed


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=[case["name"] for case in GOLDEN["cases"]])
def test_self_forcing_losses_match_fastvideo(case, tmp_path, tiny_data_path):
    from fv_accel import build_from_config

    run = build_from_config(SF_RECIPE, case_overrides(case, tmp_path, tiny_data_path))
    try:
        method = run.method
        install_standins(method)
        method.cuda_generator.manual_seed(GOLDEN["generator_seed"])
        method.rollout_generator.manual_seed(GOLDEN["rollout_seed"])
        batch = standin_batch(**case_shapes(case), seed=GOLDEN["batch_seed"])
        for record in case["results"]:
            iteration = record["iteration"]
            loss_map, _, metrics = method.single_train_step(batch, iteration)
            where = f"{case['name']} iteration {iteration}"
            assert bool(float(metrics["update_student"])) == record["update_student"], where
            for key in LOSS_KEYS:
                assert_loss(loss_map[key], record[key], f"{where} {key}")
            assert state_sha256(method.cuda_generator) == record["generator_state_sha256"], f"{where}: rank generator"
            assert state_sha256(method.rollout_generator) == record["rollout_state_sha256"], f"{where}: rollout generator"
    finally:
        if run.output_lock is not None:
            run.output_lock.release()
