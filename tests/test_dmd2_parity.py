"""fv_accel's DMD2 method against FastVideo 0.2.1's: with the role models' transformers replaced by
the shared stand-in predictions (tests/dmd2_standins.py), the same batch and the same seed, every
iteration's generator, fake-score and total loss equals, to 1e-5 relative, the value FastVideo's own
`DMD2Method.single_train_step` computed (tests/data/dmd2_fastvideo_golden.json, written by
tests/fastvideo_reference/make_dmd2_golden.py), and the method's generator ends each iteration in
the same state (the same random draws, in the same order). The cases cover both rollout modes,
warped and plain denoising steps, generator_update_interval 1 and 5, guidance 1 and 4.5, score
timestep bounds and a different flow_shift per role."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("fv_accel.methods.distribution_matching.dmd2")

from dmd2_helpers import dmd2_overrides  # noqa: E402
from dmd2_standins import standin_batch, standin_predict_noise  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GOLDEN = json.loads((REPO / "tests" / "data" / "dmd2_fastvideo_golden.json").read_text())
RECIPE = REPO / "configs" / "tiny_dmd2.yaml"
LOSS_KEYS = ("generator_loss", "fake_score_loss", "total_loss")
LOSS_RTOL = 1e-5
ZERO_ATOL = 1e-7
# Each role keeps its own scheduler table (flow_shift); the method config keys are FastVideo's.
METHOD_KEYS = (
    "rollout_mode", "dmd_denoising_steps", "warp_denoising_step", "generator_update_interval",
    "real_score_guidance_scale", "min_timestep_ratio", "max_timestep_ratio",
)


def case_overrides(case: dict[str, Any], tmp_path: Path, data_path: str) -> dict[str, Any]:
    """The golden case as recipe overrides in FastVideo's key names, at the golden's shapes: the
    stand-in latents are used as they are (statistics 0 / 1), the text is L tokens long. The latent
    shape is the stand-in batch's (FastVideo's simulate rollout takes its zeros' shape from
    training.data.num_latent_t / num_height / num_width, set there to the same sizes; here those keys
    would filter the tiny dataset's rows, which the test does not read). The teacher is the tests' inline
tiny Wan (dmd2_helpers), which the stand-ins replace anyway."""
    s = GOLDEN["shapes"]
    # A case without score bounds runs FastVideo's defaults (0.0 / 1.0), not the tiny recipe's.
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
    return dmd2_overrides(tmp_path, **extra)


def install_standins(method: Any) -> None:
    """Each role's predict_noise becomes the stand-in of that role (fv_accel's layout, [B, C, T, H, W])."""
    for role in ("student", "teacher", "critic"):

        def predict_noise(noisy_latents, timesteps, training_batch, *, conditional=True, cfg_uncond=None,
                          attn_kind="dense", _role=role):
            return standin_predict_noise(_role, noisy_latents, timesteps, conditional)

        getattr(method, role).predict_noise = predict_noise


def generator_sha256(generator: torch.Generator) -> str:
    return hashlib.sha256(generator.get_state().numpy().tobytes()).hexdigest()


def assert_loss(value: torch.Tensor, recorded: dict[str, Any], where: str) -> None:
    got, want = float(value), float.fromhex(recorded["hex"])
    tolerance = ZERO_ATOL if want == 0.0 else LOSS_RTOL * abs(want)
    assert abs(got - want) <= tolerance, f"{where}: fv_accel {got!r} ({got.hex()}), FastVideo {want!r} ({recorded['hex']})"


def test_golden_file_is_fastvideo_0_2_1():
    assert GOLDEN["fastvideo_version"] == "0.2.1"
    assert len(GOLDEN["cases"]) >= 10
    modes = {case["method"]["rollout_mode"] for case in GOLDEN["cases"]}
    assert modes == {"simulate", "data_latent"}


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=[case["name"] for case in GOLDEN["cases"]])
def test_dmd2_losses_match_fastvideo(case, tmp_path, tiny_data_path):
    from fv_accel import build_from_config

    run = build_from_config(str(RECIPE), case_overrides(case, tmp_path, tiny_data_path))
    try:
        method = run.method
        install_standins(method)
        method.cuda_generator.manual_seed(GOLDEN["generator_seed"])
        batch = standin_batch(**GOLDEN["shapes"], seed=GOLDEN["batch_seed"])
        for record in case["results"]:
            iteration = record["iteration"]
            loss_map, _, metrics = method.single_train_step(batch, iteration)
            where = f"{case['name']} iteration {iteration}"
            assert bool(float(metrics["update_student"])) == record["update_student"], where
            for key in LOSS_KEYS:
                assert_loss(loss_map[key], record[key], f"{where} {key}")
            assert generator_sha256(method.cuda_generator) == record["generator_state_sha256"], (
                f"{where}: the generator's state differs from FastVideo's (another number or order of draws)"
            )
    finally:
        if run.output_lock is not None:
            run.output_lock.release()
