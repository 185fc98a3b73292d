"""Writes tests/data/self_forcing_fastvideo_golden.json: the Self-Forcing losses that FastVideo
0.2.1's own code computes with stand-in role predictions, for tests/test_self_forcing_parity.py.

What runs is FastVideo's `SelfForcingMethod` (its real constructor and `single_train_step`: the
chunk-by-chunk rollout, exit steps, sde/ode stepping, context noise, DMD and critic losses, its
`SelfForcingFlowMatchScheduler`) on the roles of make_dmd2_golden.py (its stand-in Wan plugin).
The student is additionally a `CausalModelBase`: its streaming prediction is the student's stand-in
plus a term of the cache, `CONTEXT_WEIGHT * sum_k mean(x_k) * (1 + t_k / 1000)` per sample over
the chunks written into the cache (x_k and t_k what the write forward was given), so what goes into
the cache (the chunk's x0, its context noise and timestep) moves the losses. The rollout's noises
come from torch's global generator, seeded with ROLLOUT_SEED once before the first iteration.
A case's `shapes` (batch 1) replace those of the file's head; FastVideo's rollout draws its noises
in another memory layout at batch 1 than above. The window cases set min/max_timestep_ratio, which
FastVideo's Self-Forcing does not apply: their score draws fall inside and outside the window.

Usage: see tests/fastvideo_reference/README.md. FastVideo is never a dependency of fv_accel."""

from __future__ import annotations

import hashlib
import importlib
import sys
import types
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import make_dmd2_golden as dmd2_golden  # noqa: E402
from dmd2_standins import STANDIN_COEFFICIENTS, standin_batch, standin_predict_noise  # noqa: E402

REPO = dmd2_golden.REPO
OUT = REPO / "tests" / "data" / "self_forcing_fastvideo_golden.json"
SF_FILE = "fastvideo/train/methods/distribution_matching/self_forcing.py"
SHAPES = {**dmd2_golden.SHAPES, "T": 6}
ROLLOUT_SEED = 1234
CONTEXT_WEIGHT = 0.2
ITERATIONS = [1, 2, 3, 4, 5, 6]
STEPS_4 = [1000, 750, 500, 250]


def standin_context(entries: list[tuple[torch.Tensor, float]], batch_size: int) -> torch.Tensor:
    """The cache term [B, 1, 1, 1, 1] of the stand-in student: entries are (x of a write, its timestep value)."""
    total = torch.zeros(batch_size, dtype=torch.float32)
    for x, t in entries:
        total = total + x.float().reshape(batch_size, -1).mean(dim=1).cpu() * (1.0 + t / 1000.0)
    return (CONTEXT_WEIGHT * total).view(batch_size, 1, 1, 1, 1)


def _case(name: str, *, chunk=3, sample_type="sde", context_noise=0, same_step=False, last_step_only=False,
          steps=STEPS_4, warp=False, interval=1, guidance=1.0, bounds=None, shifts=(3.0, 3.0, 3.0),
          batch_size=None) -> dict[str, Any]:
    method = {
        "rollout_mode": "simulate",
        "chunk_size": chunk,
        "student_sample_type": sample_type,
        "context_noise": context_noise,
        "same_step_across_blocks": same_step,
        "last_step_only": last_step_only,
        "dmd_denoising_steps": list(steps),
        "warp_denoising_step": warp,
        "generator_update_interval": interval,
        "real_score_guidance_scale": guidance,
        **(bounds or {}),
    }
    case = {"name": name, "method": method, "flow_shift": dict(zip(("student", "teacher", "critic"), shifts))}
    if batch_size is not None:
        case["shapes"] = {"B": batch_size}
    return case


BOUNDS = dmd2_golden.BOUNDS
WINDOW = {"min_timestep_ratio": 0.3, "max_timestep_ratio": 0.7}
CASES = [
    _case("sde_base"),
    _case("ode_base", sample_type="ode"),
    _case("sde_context_noise_warp_cfg", context_noise=200, warp=True, guidance=4.0),
    _case("ode_context_noise_same_step", sample_type="ode", context_noise=150, same_step=True),
    _case("sde_chunk2_interval5_bounds_cfg", chunk=2, interval=5, guidance=4.0, bounds=BOUNDS),
    _case("sde_last_step_only_shift5", last_step_only=True, shifts=(5.0, 5.0, 5.0)),
    _case("sde_shifts_3_5_1_cfg", guidance=4.0, shifts=(3.0, 5.0, 1.0), context_noise=100),
    _case("ode_warp_interval5_bounds_shift5", sample_type="ode", warp=True, interval=5, bounds=BOUNDS,
          shifts=(5.0, 5.0, 5.0)),
    _case("sde_two_steps_chunk1", chunk=1, steps=[1000, 500], guidance=4.0),
    _case("sde_batch1", batch_size=1),
    _case("ode_batch1_context_noise_warp_shift5", sample_type="ode", context_noise=150, warp=True, shifts=(5.0, 5.0, 5.0),
          batch_size=1),
    _case("sde_batch1_chunk2_context_noise_window_cfg", chunk=2, context_noise=100, guidance=4.0, bounds=WINDOW,
          batch_size=1),
    _case("ode_window_interval2", sample_type="ode", interval=2, bounds=WINDOW),
]


def case_shapes(case: dict[str, Any]) -> dict[str, int]:
    return {**SHAPES, **case.get("shapes", {})}


def install_fastvideo(root: Path) -> types.SimpleNamespace:
    fv = dmd2_golden.install_fastvideo(root)
    fv.self_forcing = importlib.import_module("fastvideo.train.methods.distribution_matching.self_forcing")
    fv.base = importlib.import_module("fastvideo.train.models.base")
    return fv


def standin_causal_class(fv: types.SimpleNamespace) -> type:
    wan_cls = dmd2_golden.standin_wan_class(fv)

    class StandinCausalWanModel(wan_cls, fv.base.CausalModelBase):
        """The stand-in Wan plugin as a causal student: streaming predictions over a stand-in cache."""

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.caches: dict[str, list] = {}

        def clear_caches(self, *, cache_tag: str = "pos") -> None:
            self.caches[cache_tag] = []

        def predict_noise_streaming(self, noisy_latents, timestep, batch, *, conditional, cache_tag="pos", store_kv=False,
                                    cur_start_frame=0, cfg_uncond=None, attn_kind="dense"):
            entries = self.caches.setdefault(cache_tag, [])
            t_value = float(timestep.reshape(-1)[0])
            self.calls.append({
                "role": self.role, "streaming": True, "store_kv": bool(store_kv), "start": int(cur_start_frame),
                "frames": int(noisy_latents.shape[1]), "timestep": t_value,
            })
            x = noisy_latents.permute(0, 2, 1, 3, 4)  # [B, T, C, H, W] -> ours
            pred = standin_predict_noise(self.role, x, timestep, conditional) + standin_context(entries, x.shape[0])
            if store_kv:
                entries.append((x.detach().clone(), t_value))
            return pred.permute(0, 2, 1, 3, 4)

    return StandinCausalWanModel


def build_method(fv: types.SimpleNamespace, case: dict[str, Any]) -> Any:
    shifts = case["flow_shift"]
    shapes = case_shapes(case)
    tc = dmd2_golden.training_config(fv, shifts["student"])
    tc.data.num_latent_t = shapes["T"]
    tc.data.train_batch_size = shapes["B"]
    causal_cls = standin_causal_class(fv)
    plain_cls = dmd2_golden.standin_wan_class(fv)
    call_log: list[dict[str, Any]] = []
    roles = {}
    for role in ("student", "teacher", "critic"):
        cls = causal_cls if role == "student" else plain_cls
        roles[role] = cls(role=role, call_log=call_log, training_config=tc, trainable=role != "teacher", flow_shift=shifts[role])
    cfg = types.SimpleNamespace(training=tc, method={**case["method"], **dmd2_golden.CRITIC_OPTIMIZER}, validation={})
    method = fv.self_forcing.SelfForcingMethod(cfg=cfg, role_models=roles)
    method.cuda_generator = torch.Generator("cpu").manual_seed(dmd2_golden.GENERATOR_SEED)
    return method


def state_sha256(state: torch.Tensor) -> str:
    return hashlib.sha256(state.numpy().tobytes()).hexdigest()


def run_case(fv: types.SimpleNamespace, case: dict[str, Any]) -> list[dict[str, Any]]:
    method = build_method(fv, case)
    batch = standin_batch(**case_shapes(case), seed=dmd2_golden.BATCH_SEED)
    torch.manual_seed(ROLLOUT_SEED)
    records = []
    for iteration in ITERATIONS:
        method.student.calls.clear()
        loss_map, outputs, metrics = method.single_train_step(batch, iteration)
        records.append({
            "iteration": iteration,
            "update_student": bool(metrics["update_student"]),
            **{key: dmd2_golden._loss(loss_map[key]) for key in ("generator_loss", "fake_score_loss", "total_loss")},
            "generator_state_sha256": state_sha256(method.cuda_generator.get_state()),
            "rollout_state_sha256": state_sha256(torch.get_rng_state()),
            "model_calls": list(method.student.calls),
        })
    return records


def main(argv: list[str] | None = None) -> int:
    fv, args = dmd2_golden.fastvideo_from_cli(argv, __doc__, OUT, install_fastvideo)
    torch.set_num_threads(1)
    golden = {
        "fastvideo_version": fv.version,
        "self_forcing_py_sha256": hashlib.sha256((fv.root / SF_FILE).read_bytes()).hexdigest(),
        "torch_version": torch.__version__,
        "standin_coefficients": {k: list(v) for k, v in STANDIN_COEFFICIENTS.items()},
        "context_weight": CONTEXT_WEIGHT,
        "shapes": SHAPES,
        "batch_seed": dmd2_golden.BATCH_SEED,
        "generator_seed": dmd2_golden.GENERATOR_SEED,
        "rollout_seed": ROLLOUT_SEED,
        "iterations": ITERATIONS,
        "dtype": "float32",
        "device": "cpu",
        "cases": [],
    }
    for case in CASES:
        golden["cases"].append({
            "name": case["name"],
            "method": case["method"],
            "flow_shift": case["flow_shift"],
            "pipeline_flow_shift": case["flow_shift"]["student"],
            **({"shapes": case["shapes"]} if "shapes" in case else {}),
            "results": run_case(fv, case),
        })
        print(case["name"], [r["total_loss"]["value"] for r in golden["cases"][-1]["results"]])
    dmd2_golden.write_golden(args.out, dmd2_golden.format_golden(golden))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
