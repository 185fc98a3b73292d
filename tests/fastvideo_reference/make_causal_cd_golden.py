"""Writes tests/data/causal_cd_fastvideo_golden.json: what FastVideo 0.2.1's own causal consistency
distillation computes with stand-in role predictions, for tests/test_causal_cd_parity.py.

What runs is FastVideo's `CausalConsistencyDistillationMethod` (its real constructor, with its
`SelfForcingFlowMatchScheduler` schedule and AdamW from `build_optimizer_and_scheduler`;
`single_train_step`, `backward`, `optimizers_schedulers_step` with its EMA update from
`ema_start_step` on, and `optimizers_zero_grad`, called per step as its trainer calls them) on the
stand-in Wan plugin of make_dmd2_golden.py (its `prepare_batch`, which draws its own noise and
timestep from the generator first). Each role's transformer is one parameter `w`; its teacher-forced
prediction (`predict_noise` with `clean_x`) is tests/causal_cd_standins.py's `cd_standin_flow`, whose
context term is the block-causal mean of the clean latents it is given. The role's `backward` is
`(loss / grad_accum_rounds).backward()` (Wan's enters its forward context first, which the stand-in
does not need). Per step the JSON records the loss (float.hex), the student's and the EMA's `w`
after the step, the generator's sha256 and every role call with its timestep.

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
import make_self_forcing_golden as sf_golden  # noqa: E402
from causal_cd_standins import CHUNK, CONTEXT_WEIGHT, STANDIN_KIND, W_INIT, cd_standin_flow  # noqa: E402
from dmd2_standins import STANDIN_COEFFICIENTS, standin_batch  # noqa: E402

REPO = dmd2_golden.REPO
OUT = REPO / "tests" / "data" / "causal_cd_fastvideo_golden.json"
CD_FILE = "fastvideo/train/methods/consistency_model/causal_cd.py"
SHAPES = {**dmd2_golden.SHAPES, "T": 6}
ITERATIONS = [1, 2, 3, 4, 5, 6]
OPTIMIZER = {"learning_rate": 1.0e-2, "betas": [0.9, 0.999], "weight_decay": 0.01, "lr_scheduler": "constant"}


def _case(name: str, *, guidance: float, n: int, decay: float, start: int, shift: float = 0.0, batch_size: Any = None) -> dict:
    case = {"name": name, "method": {"guidance_scale": guidance, "discrete_cd_N": n, "ema_decay": decay,
                                     "ema_start_step": start}, "pipeline_flow_shift": shift}
    if batch_size is not None:
        case["shapes"] = {"B": batch_size}
    return case


CASES = [
    _case("cfg3_n48_ema_from_1", guidance=3.0, n=48, decay=0.99, start=1),
    _case("cfg1_n8_ema_from_3", guidance=1.0, n=8, decay=0.9, start=3),
    _case("cfg4_5_n48_ema_never_shift3", guidance=4.5, n=48, decay=0.95, start=100, shift=3.0),
    _case("cfg2_n2_ema_from_2", guidance=2.0, n=2, decay=0.5, start=2),
    _case("batch1_cfg1_n16_ema_from_1_shift5", guidance=1.0, n=16, decay=0.8, start=1, shift=5.0, batch_size=1),
    _case("batch1_cfg3_n48_ema_from_4", guidance=3.0, n=48, decay=0.7, start=4, batch_size=1),
    _case("cfg3_n4_ema_from_5", guidance=3.0, n=4, decay=0.6, start=5),
]


def case_shapes(case: dict) -> dict:
    return {**SHAPES, **case.get("shapes", {})}


def install_fastvideo(root: Path) -> types.SimpleNamespace:
    fv = sf_golden.install_fastvideo(root)
    package = dmd2_golden._stub("fastvideo.train.methods.consistency_model")
    package.__path__ = [str(fv.root / "fastvideo/train/methods/consistency_model")]
    package.__spec__.submodule_search_locations = package.__path__
    # Its checkpoint module (torch.distributed.checkpoint) is read only by checkpoint_state, never here.
    dmd2_golden._stub("fastvideo.train.utils.checkpoint", _FullModelState=dmd2_golden._unreachable("_FullModelState"))
    fv.causal_cd = importlib.import_module("fastvideo.train.methods.consistency_model.causal_cd")
    return fv


class OneParameter(torch.nn.Module):
    """The stand-in transformer: the role's one parameter `w`."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([W_INIT], dtype=torch.float32))


def standin_class(fv: types.SimpleNamespace, shapes: dict) -> type:
    wan_cls = dmd2_golden.standin_wan_class(fv)

    class StandinTeacherForcingWan(wan_cls):
        """FastVideo's Wan plugin whose teacher-forced forward is `cd_standin_flow`."""

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.negative_prompt_embeds = torch.zeros(1, shapes["L"], shapes["D"])
            self.negative_prompt_attention_mask = torch.ones(1, shapes["L"])

        def _load_transformer(self, *, trainable: bool, **kwargs: Any) -> torch.nn.Module:
            return fv.module_state.apply_trainable(OneParameter(), trainable=trainable)

        def predict_noise(self, noisy_latents, timestep, batch, *, conditional, cfg_uncond=None, attn_kind="dense",
                          clean_x=None, aug_t=None):
            if clean_x is None:
                raise RuntimeError(f"{self.role}: causal CD's forwards are all teacher-forced (clean_x)")
            values = timestep.reshape(-1)
            if not bool((values == values[0]).all()):
                raise RuntimeError(f"{self.role}: a timestep that differs between frames")
            self.calls.append({"role": self.role, "conditional": bool(conditional), "timestep": float(values[0]),
                               "shape": list(timestep.shape)})
            ours = lambda v: v.permute(0, 2, 1, 3, 4)  # noqa: E731 - [B, T, C, H, W] -> [B, C, T, H, W]
            ctx_t = torch.zeros(1) if aug_t is None else aug_t
            flow = cd_standin_flow(self.role, ours(noisy_latents), timestep, conditional, ours(clean_x), ctx_t,
                                   self.transformer.w)
            return ours(flow)

        def backward(self, loss, ctx, *, grad_accum_rounds):
            (loss / grad_accum_rounds).backward()

    return StandinTeacherForcingWan


def build_method(fv: types.SimpleNamespace, case: dict) -> Any:
    shapes = case_shapes(case)
    tc = dmd2_golden.training_config(fv, case["pipeline_flow_shift"])
    tc.data.num_latent_t = shapes["T"]
    tc.data.train_batch_size = shapes["B"]
    tc.optimizer = fv.training_config.OptimizerConfig(
        learning_rate=OPTIMIZER["learning_rate"], betas=tuple(OPTIMIZER["betas"]), weight_decay=OPTIMIZER["weight_decay"],
        lr_scheduler=OPTIMIZER["lr_scheduler"],
    )
    cls = standin_class(fv, shapes)
    calls: list = []
    roles = {role: cls(role=role, call_log=calls, training_config=tc, trainable=role == "student", flow_shift=3.0)
             for role in ("student", "teacher", "ema")}
    cfg = types.SimpleNamespace(training=tc, method=dict(case["method"]), validation={})
    method = fv.causal_cd.CausalConsistencyDistillationMethod(cfg=cfg, role_models=roles)
    method.cuda_generator = torch.Generator("cpu").manual_seed(dmd2_golden.GENERATOR_SEED)
    return method


def run_case(fv: types.SimpleNamespace, case: dict) -> tuple[list, dict]:
    method = build_method(fv, case)
    batch = standin_batch(**case_shapes(case), seed=dmd2_golden.BATCH_SEED)
    records = []
    for step in ITERATIONS:
        method.student.calls.clear()
        loss_map, outputs, _ = method.single_train_step(batch, step)
        method.backward(loss_map, outputs, grad_accum_rounds=1)
        method.optimizers_schedulers_step(step)
        method.optimizers_zero_grad(step)
        records.append({
            "iteration": step,
            "total_loss": dmd2_golden._loss(loss_map["total_loss"]),
            "student_w": dmd2_golden._loss(method.student.transformer.w.detach()[0]),
            "ema_w": dmd2_golden._loss(method.ema_model.transformer.w.detach()[0]),
            "generator_state_sha256": dmd2_golden.generator_sha256(method.cuda_generator),
            "model_calls": list(method.student.calls),
        })
    derived = {"flow_shift": method._flow_shift, "timesteps": [float(t) for t in method._sf_scheduler.timesteps]}
    return records, derived


def main(argv: list[str] | None = None) -> int:
    fv, args = dmd2_golden.fastvideo_from_cli(argv, __doc__, OUT, install_fastvideo)
    torch.set_num_threads(1)
    golden = {
        "fastvideo_version": fv.version,
        "causal_cd_py_sha256": hashlib.sha256((fv.root / CD_FILE).read_bytes()).hexdigest(),
        "torch_version": torch.__version__,
        "standin_coefficients": {k: list(STANDIN_COEFFICIENTS[v]) for k, v in STANDIN_KIND.items()},
        "context_weight": CONTEXT_WEIGHT,
        "chunk": CHUNK,
        "w_init": W_INIT,
        "shapes": SHAPES,
        "batch_seed": dmd2_golden.BATCH_SEED,
        "generator_seed": dmd2_golden.GENERATOR_SEED,
        "optimizer": OPTIMIZER,
        "iterations": ITERATIONS,
        "dtype": "float32",
        "device": "cpu",
        "cases": [],
    }
    for case in CASES:
        results, derived = run_case(fv, case)
        golden["cases"].append({**case, "derived": derived, "results": results})
        print(case["name"], [r["total_loss"]["value"] for r in results])
    dmd2_golden.write_golden(args.out, dmd2_golden.format_golden(golden))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
