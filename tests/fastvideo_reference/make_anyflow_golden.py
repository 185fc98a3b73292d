"""Writes tests/data/anyflow_fastvideo_golden.json: what FastVideo 0.2.1's own AnyFlowPretrainMethod
and AnyFlowMethod compute with stand-in role predictions, for tests/test_anyflow_parity.py.

What runs is FastVideo's: both methods' constructors and `single_train_step` (the pretraining's
(t, r) draws, shift, noising, fused guidance, central difference, weights and scale balance; the
on-policy rollout schedule, the gradient step's draw, the flow-map Euler steps, and DMD2's DMD and
critic losses it inherits), its FlowMapEulerDiscreteScheduler, the Wan plugin's `prepare_batch`
and `add_noise`, on the stand-in roles of make_dmd2_golden.py. The student is that stand-in Wan
plugin with `predict_velocity_with_r` the shared stand-in of tests/anyflow_standins.py; teacher and
critic keep the DMD2 stand-ins. A prediction made with gradient enabled is returned as a leaf
tensor that requires grad, so that after `backward` of the step's loss(es) its gradient (the
loss's derivative with respect to the prediction: the target and the weights, scale balance
included) is recorded per sample (L1, L2 and its dot product with the prediction).

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
from anyflow_standins import STUDENT_FLOW_MAP_COEFFICIENTS, standin_velocity_with_r  # noqa: E402
from dmd2_standins import STANDIN_COEFFICIENTS, standin_batch  # noqa: E402

REPO = dmd2_golden.REPO
OUT = REPO / "tests" / "data" / "anyflow_fastvideo_golden.json"
PRETRAIN_FILE = "fastvideo/train/methods/distribution_matching/anyflow_pretrain.py"
ANYFLOW_FILE = "fastvideo/train/methods/distribution_matching/anyflow.py"
SHAPES = dict(dmd2_golden.SHAPES)  # B 2, C 16, T 5, H 4, W 6, L 16, D 32
PRETRAIN_ITERATIONS = [1, 2, 3]
ONPOLICY_ITERATIONS = [1, 2, 3, 4, 5, 6]
T_LIST = [999.0, 937.0, 833.0, 624.0, 0.0]
BOUNDS = {"min_timestep_ratio": 0.02, "max_timestep_ratio": 0.98}


def _pretrain(name: str, *, batch: int = 4, shift: float = 5.0, ours: dict | None = None, **method: Any) -> dict[str, Any]:
    """A pretraining case: FastVideo's method keys as given; `ours` the values fv_accel must be
    given to compute what FastVideo computes (where FastVideo reads a key otherwise)."""
    base = {"diffusion_ratio": 0.5, "consistency_ratio": 0.25, "epsilon": 5, "weight_type": "beta08", "fuse_guidance_scale": 1.0}
    case = {"name": name, "kind": "pretrain", "method": {**base, **method}, "flow_shift": shift, "shapes": {**SHAPES, "B": batch}}
    if ours:
        case["ours_method"] = ours
    return case


def _onpolicy(name: str, *, batch: int = 2, shift: float = 5.0, **method: Any) -> dict[str, Any]:
    base = {"rollout_mode": "simulate", "generator_update_interval": 1, "real_score_guidance_scale": 3.0,
            "warp_denoising_step": False, "student_sample_steps": 4, "use_mean_velocity": True}
    return {"name": name, "kind": "onpolicy", "method": {**base, **method}, "flow_shift": shift, "shapes": {**SHAPES, "B": batch}}


PRETRAIN_CASES = [
    _pretrain("pretrain_base"),
    _pretrain("pretrain_fused_guidance_eps10_gaussian_shift3", fuse_guidance_scale=3.0, epsilon=10, weight_type="gaussian", shift=3.0),
    _pretrain("pretrain_uniform_ratios_25_50_eps1_shift1", diffusion_ratio=0.25, consistency_ratio=0.5, epsilon=1,
              weight_type="uniform", shift=1.0),
    _pretrain("pretrain_batch1_fused_guidance", batch=1, fuse_guidance_scale=3.0),
    _pretrain("pretrain_no_free_pairs_batch4", diffusion_ratio=0.75, consistency_ratio=0.25, fuse_guidance_scale=2.0),
    _pretrain("pretrain_batch3_beta08_eps20", batch=3, epsilon=20, diffusion_ratio=0.34, consistency_ratio=0.34),
    # FastVideo reads a configured 0 as its default (`or`): 0 -> 0.5 and 0 -> 0.25. fv_accel honours 0
    # (tests/test_anyflow.py); here it is given the values FastVideo uses.
    _pretrain("pretrain_fastvideo_reads_diffusion_ratio_0_as_0_5", diffusion_ratio=0.0, ours={"diffusion_ratio": 0.5}),
    _pretrain("pretrain_fastvideo_reads_consistency_ratio_0_as_0_25", diffusion_ratio=0.75, consistency_ratio=0.0,
              ours={"consistency_ratio": 0.25}),
]

ONPOLICY_CASES = [
    _onpolicy("onpolicy_t_list_guidance3", t_list_override=T_LIST),
    _onpolicy("onpolicy_dmd_steps_shift3_guidance1", dmd_denoising_steps=[1000, 750, 500, 250], real_score_guidance_scale=1.0,
              shift=3.0),
    _onpolicy("onpolicy_warp_instantaneous_velocity", dmd_denoising_steps=[1000, 750, 500, 250], warp_denoising_step=True,
              use_mean_velocity=False),
    _onpolicy("onpolicy_t_list_capped_2_steps_interval5_bounds", t_list_override=T_LIST, student_sample_steps=2,
              generator_update_interval=5, **BOUNDS),
    _onpolicy("onpolicy_batch1_data_latent_t_list", batch=1, rollout_mode="data_latent", t_list_override=T_LIST),
    _onpolicy("onpolicy_one_step_from_two", dmd_denoising_steps=[1000, 500], student_sample_steps=1, shift=3.0,
              real_score_guidance_scale=4.5),
    _onpolicy("onpolicy_t_list_interval2_instantaneous", t_list_override=[1000.0, 800.0, 400.0, 0.0], generator_update_interval=2,
              use_mean_velocity=False, **BOUNDS),
]


def install_fastvideo(root: Path) -> types.SimpleNamespace:
    fv = dmd2_golden.install_fastvideo(root)
    fv.anyflow_pretrain = importlib.import_module("fastvideo.train.methods.distribution_matching.anyflow_pretrain")
    fv.anyflow = importlib.import_module("fastvideo.train.methods.distribution_matching.anyflow")
    return fv


def standin_flow_map_class(fv: types.SimpleNamespace) -> type:
    wan_cls = dmd2_golden.standin_wan_class(fv)

    class StandinFlowMapWanModel(wan_cls):
        """The stand-in Wan plugin whose predictions made with gradient are recorded leaves."""

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.leaves: list[torch.Tensor] = []

        def _leaf(self, out: torch.Tensor) -> torch.Tensor:
            if not torch.is_grad_enabled():
                return out
            leaf = out.detach().requires_grad_(True)
            self.leaves.append(leaf)
            return leaf

        def predict_velocity_with_r(self, noisy_latents, timestep, r_timestep, batch, *, conditional, cfg_uncond=None,
                                    attn_kind="dense"):
            self.calls.append({
                "role": self.role, "conditional": bool(conditional), "attn_kind": attn_kind, "grad": torch.is_grad_enabled(),
                "t": [float(v) for v in timestep.reshape(-1)], "r": [float(v) for v in r_timestep.reshape(-1)],
            })
            x = noisy_latents.permute(0, 2, 1, 3, 4)  # [B, T, C, H, W] -> [B, C, T, H, W]
            return self._leaf(standin_velocity_with_r(x, timestep, r_timestep, conditional).permute(0, 2, 1, 3, 4))

        def predict_noise(self, noisy_latents, timestep, batch, **kwargs):
            return self._leaf(super().predict_noise(noisy_latents, timestep, batch, **kwargs))

    return StandinFlowMapWanModel


def build_method(fv: types.SimpleNamespace, case: dict[str, Any]) -> Any:
    shapes = case["shapes"]
    tc = dmd2_golden.training_config(fv, case["flow_shift"])  # pipeline flow_shift: AnyFlow's shift
    tc.data.train_batch_size = shapes["B"]
    cls = standin_flow_map_class(fv)
    calls: list[dict[str, Any]] = []
    roles = ("student",) if case["kind"] == "pretrain" else ("student", "teacher", "critic")
    models = {role: cls(role=role, call_log=calls, training_config=tc, trainable=role != "teacher", flow_shift=case["flow_shift"])
              for role in roles}
    if case["kind"] == "pretrain":
        cfg = types.SimpleNamespace(training=tc, method=dict(case["method"]), validation={})
        method = fv.anyflow_pretrain.AnyFlowPretrainMethod(cfg=cfg, role_models=models)
    else:
        cfg = types.SimpleNamespace(training=tc, method={**case["method"], **dmd2_golden.CRITIC_OPTIMIZER}, validation={})
        method = fv.anyflow.AnyFlowMethod(cfg=cfg, role_models=models)
    method.cuda_generator = torch.Generator("cpu").manual_seed(dmd2_golden.GENERATOR_SEED)
    return method


def gradient_record(leaves: list[torch.Tensor]) -> list[dict[str, list[str]]]:
    """Per leaf with a gradient, per sample: sum |g|, sum g^2, sum g * prediction and sum |g * prediction| (float.hex)."""
    out = []
    for leaf in leaves:
        if leaf.grad is None:
            continue
        g, p = leaf.grad.double(), leaf.detach().double()
        b = g.shape[0]
        stats = {"l1": g.abs().reshape(b, -1).sum(1), "l2": (g * g).reshape(b, -1).sum(1),
                 "dot": (g * p).reshape(b, -1).sum(1), "dot_abs": (g * p).abs().reshape(b, -1).sum(1)}
        out.append({k: [float(x).hex() for x in v] for k, v in stats.items()})
    return out


def _metric(value: Any) -> str:
    return float(value).hex()


def run_pretrain(method: Any, batch: dict, iteration: int) -> dict[str, Any]:
    student = method.student
    loss_map, _, metrics = method.single_train_step(batch, iteration)
    loss_map["total_loss"].backward()
    return {
        "iteration": iteration,
        "total_loss": dmd2_golden._loss(loss_map["total_loss"].detach()),
        "metrics": {k: _metric(v) for k, v in sorted(metrics.items())},
        "gradients": gradient_record(student.leaves),
    }


def run_onpolicy(method: Any, batch: dict, iteration: int) -> dict[str, Any]:
    loss_map, _, metrics = method.single_train_step(batch, iteration)
    record: dict[str, Any] = {"iteration": iteration, "update_student": bool(metrics["update_student"])}
    record.update({key: dmd2_golden._loss(loss_map[key].detach()) for key in ("generator_loss", "fake_score_loss", "total_loss")})
    if record["update_student"]:
        loss_map["generator_loss"].backward()
    loss_map["fake_score_loss"].backward()
    record["student_gradients"] = gradient_record(method.student.leaves)
    record["critic_gradients"] = gradient_record(method.critic.leaves)
    return record


def run_case(fv: types.SimpleNamespace, case: dict[str, Any]) -> list[dict[str, Any]]:
    method = build_method(fv, case)
    batch = standin_batch(**case["shapes"], seed=dmd2_golden.BATCH_SEED)
    iterations = PRETRAIN_ITERATIONS if case["kind"] == "pretrain" else ONPOLICY_ITERATIONS
    records = []
    for iteration in iterations:
        roles = [method.student] + ([] if case["kind"] == "pretrain" else [method.critic])
        for role in roles:
            role.leaves.clear()
        method.student.calls.clear()
        run = run_pretrain if case["kind"] == "pretrain" else run_onpolicy
        record = run(method, batch, iteration)
        record["generator_state_sha256"] = dmd2_golden.generator_sha256(method.cuda_generator)
        record["model_calls"] = list(method.student.calls)
        records.append(record)
    return records


def main(argv: list[str] | None = None) -> int:
    fv, args = dmd2_golden.fastvideo_from_cli(argv, __doc__, OUT, install_fastvideo)
    torch.set_num_threads(1)
    golden = {
        "fastvideo_version": fv.version,
        "anyflow_pretrain_py_sha256": hashlib.sha256((fv.root / PRETRAIN_FILE).read_bytes()).hexdigest(),
        "anyflow_py_sha256": hashlib.sha256((fv.root / ANYFLOW_FILE).read_bytes()).hexdigest(),
        "torch_version": torch.__version__,
        "standin_coefficients": {k: list(v) for k, v in STANDIN_COEFFICIENTS.items()},
        "student_flow_map_coefficients": list(STUDENT_FLOW_MAP_COEFFICIENTS),
        "batch_seed": dmd2_golden.BATCH_SEED,
        "generator_seed": dmd2_golden.GENERATOR_SEED,
        "pretrain_iterations": PRETRAIN_ITERATIONS,
        "onpolicy_iterations": ONPOLICY_ITERATIONS,
        "dtype": "float32",
        "device": "cpu",
        "cases": [],
    }
    for case in PRETRAIN_CASES + ONPOLICY_CASES:
        golden["cases"].append({**case, "results": run_case(fv, case)})
        print(case["name"], [r["total_loss"]["value"] for r in golden["cases"][-1]["results"]])
    dmd2_golden.write_golden(args.out, dmd2_golden.format_golden(golden))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
