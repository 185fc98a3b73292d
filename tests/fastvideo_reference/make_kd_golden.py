"""Writes tests/data/kd_fastvideo_golden.json: the KD losses that FastVideo 0.2.1's own
`KDMethod` and `KDCausalMethod` compute with a stand-in student prediction and a stand-in teacher
trajectory batch (tests/kd_standins.py), for tests/test_kd_parity.py.

What runs is FastVideo's: the methods' constructors (t_list / student_sample_steps parsing, the
dense `SelfForcingFlowMatchScheduler` of 1000 steps at the pipeline's flow_shift, the student's
optimizer), `single_train_step` (the step index draw, or the per-block draw of
`_sample_per_frame_step_idx`, the cached state's lookup, the Wan plugin's `prepare_batch` and its
draws, `pred_noise_to_pred_video`, the 0.5 * MSE loss), and the teacher's ODE timesteps of its
`SelfForcingFlowMatchScheduler(teacher_inference_steps, shift, sigma_min=0, extra_one_step=True)`,
recorded as the stand-in cache's `trajectory_timesteps`. The stand-in student is the DMD2 golden's
stand-in Wan plugin (make_dmd2_golden.py) with the KD stand-in prediction, which takes the timestep
per sample or per frame.

Two things are not FastVideo's own: its `single_train_step` passes `current_vsa_sparsity=` to
`prepare_batch`, which no 0.2.1 model plugin accepts (TypeError): the stand-in's `prepare_batch`
drops that keyword (its value is always 0.0) and runs the Wan plugin's. And `on_train_start` (which
builds the cache and then the `t_list` -> trajectory index table) needs a process group and a
teacher: its three lines that build the table from the cache's `trajectory_timesteps` are done here.

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
from kd_standins import KD_STANDIN, kd_standin_batch, kd_standin_predict  # noqa: E402

REPO = dmd2_golden.REPO
OUT = REPO / "tests" / "data" / "kd_fastvideo_golden.json"
KD_FILE = "fastvideo/train/methods/knowledge_distillation/kd.py"
SHAPES = {"B": 2, "C": 16, "T": 6, "H": 4, "W": 6, "L": 16, "D": 32}
BATCH_SEED = 11
GENERATOR_SEED = 42
ITERATIONS = [1, 2, 3, 4, 5, 6]


def _case(name: str, cls: str, t_list: list[int], *, shift=5.0, teacher_steps=48, block=None, batch=None,
          dtype="float32", sample_steps=None) -> dict[str, Any]:
    method = {"t_list": t_list, "teacher_path_cache": "/nonexistent/kd_cache", "teacher_inference_steps": teacher_steps,
              "teacher_guidance_scale": 1.0}
    if block is not None:
        method["num_frames_per_block"] = block
    if sample_steps is not None:
        method["student_sample_steps"] = sample_steps
    case = {"name": name, "class": cls, "method": method, "flow_shift": shift, "dtype": dtype}
    if batch is not None:
        case["shapes"] = {"B": batch}
    return case


T4_SHIFT5 = [995, 937, 833, 625, 0]  # FastVideo's 48-step teacher at shift 5
CASES = [
    _case("kd_base", "KDMethod", T4_SHIFT5),
    _case("kd_batch1", "KDMethod", T4_SHIFT5, batch=1),
    _case("kd_two_steps_shift3", "KDMethod", [1000, 750, 0], shift=3.0, sample_steps=2),
    _case("kd_teacher16_shift3_bf16", "KDMethod", [1000, 833, 500, 166, 0], shift=3.0, teacher_steps=16, dtype="bfloat16"),
    _case("kd_last_entry_not_cached", "KDMethod", [995, 937, 833, 625, 7], sample_steps=4),
    _case("causal_block3", "KDCausalMethod", T4_SHIFT5, block=3),
    _case("causal_block2_batch1", "KDCausalMethod", T4_SHIFT5, block=2, batch=1),
    _case("causal_block1_shift3", "KDCausalMethod", [1000, 750, 500, 0], block=1, shift=3.0),
    _case("causal_block4_uneven_bf16", "KDCausalMethod", T4_SHIFT5, block=4, dtype="bfloat16"),
    _case("causal_block3_teacher16_shift3", "KDCausalMethod", [1000, 833, 500, 166, 0], block=3, shift=3.0, teacher_steps=16),
]


def case_shapes(case: dict[str, Any]) -> dict[str, int]:
    return {**SHAPES, **case.get("shapes", {})}


def install_fastvideo(root: Path) -> types.SimpleNamespace:
    fv = dmd2_golden.install_fastvideo(root)
    # The KD module's cache loader and distributed helpers, none of which single_train_step calls.
    dataset = dmd2_golden._stub("fastvideo.dataset")
    dataset.__path__ = []
    dmd2_golden._stub("fastvideo.dataset.parquet_dataset_map_style",
                      DP_SP_BatchSampler=dmd2_golden._unreachable("DP_SP_BatchSampler"))
    dist = sys.modules["fastvideo.distributed"]
    for name in ("get_sp_world_size", "get_world_rank", "get_world_size"):
        setattr(dist, name, dmd2_golden._unreachable(name))
    fv.kd = importlib.import_module("fastvideo.train.methods.knowledge_distillation.kd")
    fv.sf_scheduler = importlib.import_module("fastvideo.models.schedulers.scheduling_self_forcing_flow_match")
    return fv


def standin_kd_class(fv: types.SimpleNamespace) -> type:
    wan_cls = dmd2_golden.standin_wan_class(fv)

    class StandinKDStudent(wan_cls):
        """The DMD2 golden's stand-in Wan plugin as the KD student (timestep per sample or per frame)."""

        def init_preprocessors(self, training_config: Any) -> None:
            super().init_preprocessors(training_config)
            self.dataloader = None  # KDMethod wraps it; the golden run never iterates it

        def prepare_batch(self, raw_batch: dict, **kwargs: Any) -> Any:
            kwargs.pop("current_vsa_sparsity")  # no 0.2.1 plugin takes it; always 0.0 here
            return super().prepare_batch(raw_batch, **kwargs)

        def predict_noise(self, noisy_latents, timestep, batch, *, conditional, cfg_uncond=None, attn_kind="dense", **kw):
            self.calls.append({"timestep": [float(v) for v in timestep.reshape(-1)], "shape": list(timestep.shape),
                               "conditional": bool(conditional), "input_dtype": str(noisy_latents.dtype).replace("torch.", "")})
            x = noisy_latents.permute(0, 2, 1, 3, 4)  # [B, T, C, H, W] -> ours
            return kd_standin_predict(x, timestep).permute(0, 2, 1, 3, 4)

    return StandinKDStudent


def teacher_timesteps(fv: types.SimpleNamespace, steps: int, shift: float) -> list[int]:
    """The teacher's ODE timesteps as FastVideo's `_teacher_ode_rollout` builds them."""
    sched = fv.sf_scheduler.SelfForcingFlowMatchScheduler(num_inference_steps=steps, num_train_timesteps=1000, shift=shift,
                                                          sigma_min=0.0, extra_one_step=True, training=False)
    return [int(t.item()) for t in sched.timesteps]


def build_method(fv: types.SimpleNamespace, case: dict[str, Any], cached: list[int]) -> Any:
    tc = dmd2_golden.training_config(fv, case["flow_shift"])
    tc.data.num_latent_t = case_shapes(case)["T"]
    student = standin_kd_class(fv)(role="student", call_log=[], training_config=tc, trainable=True,
                                   flow_shift=case["flow_shift"])
    cfg = types.SimpleNamespace(training=tc, method=dict(case["method"]), validation={})
    method = getattr(fv.kd, case["class"])(cfg=cfg, role_models={"student": student})
    # on_train_start's table of t_list -> trajectory index (its lines, run on the stand-in cache).
    t_to_idx = {int(t): i for i, t in enumerate(cached)}
    method._t_to_traj_idx = {t: t_to_idx[t] for t in method._t_list[:-1]}
    method.cuda_generator = torch.Generator("cpu").manual_seed(GENERATOR_SEED)
    return method


def fastvideo_batch(case: dict[str, Any], cached: list[int]) -> dict[str, torch.Tensor]:
    """The stand-in cache batch in FastVideo's layout ([B, S, T, C, H, W], [B, T, C, H, W])."""
    batch = kd_standin_batch(**case_shapes(case), timesteps=cached, seed=BATCH_SEED, dtype=getattr(torch, case["dtype"]))
    return {
        "trajectory_latents": batch["trajectory_latents"].permute(0, 1, 3, 2, 4, 5).contiguous(),
        "trajectory_timesteps": batch["trajectory_timesteps"],
        "real": batch["real"].permute(0, 2, 1, 3, 4).contiguous(),
        "text_embedding": batch["text_embedding"],
        "text_attention_mask": batch["text_attention_mask"],
    }


def run_case(fv: types.SimpleNamespace, case: dict[str, Any]) -> tuple[list[int], list[dict[str, Any]]]:
    cached = teacher_timesteps(fv, case["method"]["teacher_inference_steps"], case["flow_shift"])
    method = build_method(fv, case, cached)
    batch = fastvideo_batch(case, cached)
    records = []
    for iteration in ITERATIONS:
        method.student.calls.clear()
        loss_map, _, metrics = method.single_train_step(batch, iteration)
        records.append({
            "iteration": iteration,
            "kd_loss": dmd2_golden._loss(loss_map["kd_loss"]),
            "total_loss": dmd2_golden._loss(loss_map["total_loss"]),
            "metrics": {k: float(v) for k, v in metrics.items()},
            "generator_state_sha256": dmd2_golden.generator_sha256(method.cuda_generator),
            "model_calls": list(method.student.calls),
        })
    return cached, records


def main(argv: list[str] | None = None) -> int:
    fv, args = dmd2_golden.fastvideo_from_cli(argv, __doc__, OUT, install_fastvideo)
    torch.set_num_threads(1)
    golden = {
        "fastvideo_version": fv.version,
        "kd_py_sha256": hashlib.sha256((fv.root / KD_FILE).read_bytes()).hexdigest(),
        "torch_version": torch.__version__,
        "standin_coefficients": list(KD_STANDIN),
        "shapes": SHAPES,
        "batch_seed": BATCH_SEED,
        "generator_seed": GENERATOR_SEED,
        "iterations": ITERATIONS,
        "device": "cpu",
        "cases": [],
    }
    for case in CASES:
        cached, results = run_case(fv, case)
        golden["cases"].append({**case, "cached_timesteps": cached, "results": results})
        print(case["name"], [r["kd_loss"]["value"] for r in results])
    dmd2_golden.write_golden(args.out, dmd2_golden.format_golden(golden))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
