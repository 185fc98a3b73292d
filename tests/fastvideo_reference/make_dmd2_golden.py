"""Writes tests/data/dmd2_fastvideo_golden.json: the DMD2 losses that FastVideo 0.2.1's own code
computes with stand-in role predictions (tests/dmd2_standins.py), for tests/test_dmd2_parity.py.

What runs is FastVideo's: `DMD2Method` (its real constructor and `single_train_step`), the
`TrainingMethod` and `ModelBase` base classes (`predict_x0`), the Wan plugin `WanModel` (its
`prepare_batch`, `add_noise`, `shift_and_clamp_timestep`, timestep sampling and timestep
mechanics), `FlowMatchEulerDiscreteScheduler`, `pred_noise_to_pred_video`, `shift_timestep`,
`compute_density_for_timestep_sampling`, `get_sigmas`, `normalize_dit_input` and the config helpers.
A stand-in role is a `WanModel` subclass that replaces only what needs a GPU, weights or a text
encoder: the transformer (a 1x1 linear layer, never called), its forward (`predict_noise` is the
shared stand-in), the training dtype (fp32, where Wan trains in bf16) and the VAE/dataloader
loading of `init_preprocessors` (its timestep mechanics run). The VAE statistics are mean 0 and
std 1, so `normalize_dit_input` leaves the stand-in latents as they are; the negative-prompt
embedding is given (zeros), so no text encoder is loaded. Everything runs in fp32 on the CPU, with
`cuda_generator` a CPU generator seeded as `on_train_start` seeds it on rank 0.

FastVideo's package `__init__` files import its whole inference stack (CUDA kernels, distributed
setup), so its packages are entered as bare namespace packages and the few leaf modules that need
those dependencies are stubbed (`install_fastvideo`); a stub that is called raises.

Usage: see tests/fastvideo_reference/README.md. FastVideo is never a dependency of fv_accel."""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.machinery
import json
import os
import sys
import types
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
from dmd2_standins import STANDIN_COEFFICIENTS, standin_batch, standin_predict_noise  # noqa: E402

OUT = REPO / "tests" / "data" / "dmd2_fastvideo_golden.json"
EXPECTED_VERSION = "0.2.1"
DMD2_FILE = "fastvideo/train/methods/distribution_matching/dmd2.py"

# Latent [B, C, T, H, W] (C and D are the tiny Wan's in_channels and text_dim), text [B, L, D].
SHAPES = {"B": 2, "C": 16, "T": 5, "H": 4, "W": 6, "L": 16, "D": 32}
BATCH_SEED = 7
GENERATOR_SEED = 42
ITERATIONS = [1, 2, 3, 4, 5, 6]
STEPS_4 = [1000, 750, 500, 250]
BOUNDS = {"min_timestep_ratio": 0.02, "max_timestep_ratio": 0.98}
# FastVideo's critic optimizer must be configured; it is built by the constructor and never stepped here.
CRITIC_OPTIMIZER = {"fake_score_learning_rate": 1.0e-5, "fake_score_betas": [0.0, 0.999], "fake_score_lr_scheduler": "constant"}


def _case(name: str, rollout_mode: str, *, steps=STEPS_4, warp=False, interval=1, guidance=1.0, bounds=None,
          shifts=(3.0, 3.0, 3.0)) -> dict[str, Any]:
    method = {
        "rollout_mode": rollout_mode,
        "dmd_denoising_steps": list(steps),
        "warp_denoising_step": warp,
        "generator_update_interval": interval,
        "real_score_guidance_scale": guidance,
        **(bounds or {}),
    }
    return {"name": name, "method": method, "flow_shift": dict(zip(("student", "teacher", "critic"), shifts))}


CASES = [
    _case("simulate_base", "simulate"),
    _case("simulate_warp_cfg", "simulate", warp=True, guidance=4.5),
    _case("simulate_interval5_bounds_cfg", "simulate", interval=5, guidance=4.5, bounds=BOUNDS),
    _case("simulate_shifts_3_5_1_cfg", "simulate", guidance=4.5, shifts=(3.0, 5.0, 1.0)),
    _case("simulate_two_steps_bounds", "simulate", steps=[1000, 500], bounds=BOUNDS),
    _case("simulate_warp_interval5_bounds", "simulate", warp=True, interval=5, bounds=BOUNDS),
    _case("data_latent_base", "data_latent"),
    _case("data_latent_warp_cfg", "data_latent", warp=True, guidance=4.5),
    _case("data_latent_interval5_bounds_cfg", "data_latent", interval=5, guidance=4.5, bounds=BOUNDS),
    _case("data_latent_warp_shifts_3_5_1_cfg", "data_latent", warp=True, guidance=4.5, shifts=(3.0, 5.0, 1.0)),
    _case("data_latent_two_steps_bounds_cfg", "data_latent", steps=[1000, 500], guidance=4.5, bounds=BOUNDS),
    _case("data_latent_warp_interval5", "data_latent", warp=True, interval=5),
]


# ---- importing FastVideo's own modules without its inference stack ----
NAMESPACE_PACKAGES = [
    "fastvideo", "fastvideo.api", "fastvideo.attention", "fastvideo.distributed", "fastvideo.models",
    "fastvideo.models.schedulers", "fastvideo.pipelines", "fastvideo.platforms", "fastvideo.train",
    "fastvideo.train.methods", "fastvideo.train.methods.distribution_matching", "fastvideo.train.models",
    "fastvideo.train.models.wan", "fastvideo.train.utils", "fastvideo.training",
]


def _unreachable(what: str):
    def call(*args, **kwargs):
        raise RuntimeError(f"{what} is stubbed out for the DMD2 golden run and must not be called")

    return call


def _stub(name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__dict__.update(attrs)
    sys.modules[name] = module
    return module


def _coerce_attn_backend(value: Any) -> None:
    if value is not None:
        raise RuntimeError("the stand-in roles use the default attention backend")
    return None


class _NoLora:
    @classmethod
    def coerce(cls, obj: Any) -> None:
        if obj is not None:
            raise RuntimeError("the stand-in roles have no LoRA")
        return None


def install_fastvideo(root: Path) -> types.SimpleNamespace:
    """Enter FastVideo's packages as namespace packages rooted in the unpacked wheel, stub the leaf
    modules that pull CUDA, distributed or model-loading dependencies, and import the real rest."""
    root = Path(root).resolve()
    if not (root / DMD2_FILE).is_file():
        raise SystemExit(f"--fastvideo {root}: no {DMD2_FILE} under it (unzip the fastvideo wheel there)")
    for name in NAMESPACE_PACKAGES:
        package = _stub(name)
        package.__path__ = [str(root / name.replace(".", "/"))]
        package.__spec__.submodule_search_locations = package.__path__
    try:  # the scheduler module imports scipy.stats for beta sigmas, which DMD2 never uses
        import scipy.stats  # noqa: F401
    except ImportError:
        _stub("scipy", __path__=[], stats=_stub("scipy.stats"))
    sys.modules["fastvideo.distributed"].__dict__.update(
        get_local_torch_device=lambda: torch.device("cpu"),  # FastVideo's answers CUDA (or MPS)
        get_sp_group=_unreachable("get_sp_group"),
        get_world_group=_unreachable("get_world_group"),
    )
    interface = importlib.import_module("fastvideo.platforms.interface")
    sys.modules["fastvideo.platforms"].AttentionBackendEnum = interface.AttentionBackendEnum
    abstract = importlib.import_module("fastvideo.attention.backends.abstract")
    sys.modules["fastvideo.attention"].AttentionMetadata = abstract.AttentionMetadata
    _stub("fastvideo.attention.selector", coerce_attn_backend=_coerce_attn_backend)
    _stub("fastvideo.utils", is_vsa_available=lambda: False, is_vmoba_available=lambda: False)
    _stub("fastvideo.api.sampling_param", SamplingParam=types.SimpleNamespace(from_pretrained=_unreachable("SamplingParam")))
    _stub("fastvideo.train.utils.lora", LoraConfig=_NoLora)
    _stub("fastvideo.train.utils.moduleloader", load_module_from_path=_unreachable("load_module_from_path"))
    _stub("fastvideo.train.utils.negative_prompt", encode_negative_prompt=_unreachable("encode_negative_prompt"))
    batch_info = importlib.import_module("fastvideo.pipelines.pipeline_batch_info")
    sys.modules["fastvideo.pipelines"].TrainingBatch = batch_info.TrainingBatch
    return types.SimpleNamespace(
        root=root,
        version=(root / "fastvideo/version.py").read_text().split("=")[-1].strip().strip("\"'"),
        dmd2=importlib.import_module("fastvideo.train.methods.distribution_matching.dmd2"),
        wan=importlib.import_module("fastvideo.train.models.wan.wan"),
        training_config=importlib.import_module("fastvideo.train.utils.training_config"),
        module_state=importlib.import_module("fastvideo.train.utils.module_state"),
    )


# ---- stand-in roles: FastVideo's Wan plugin with the transformer replaced ----
def standin_wan_class(fv: types.SimpleNamespace) -> type:
    class StandinWanModel(fv.wan.WanModel):
        """FastVideo's WanModel whose transformer is the shared stand-in prediction."""

        def __init__(self, *, role: str, call_log: list, **kwargs: Any) -> None:
            super().__init__(init_from=f"standin-{role}", **kwargs)
            self.role = role
            self.calls = call_log  # shared by the three roles: the model calls in their order
            self.last_batch: Any = None
            # Given, so that ensure_negative_conditioning loads no text encoder.
            self.negative_prompt_embeds = torch.zeros(1, SHAPES["L"], SHAPES["D"])
            self.negative_prompt_attention_mask = torch.ones(1, SHAPES["L"])

        def _load_transformer(self, *, trainable: bool, **kwargs: Any) -> torch.nn.Module:
            return fv.module_state.apply_trainable(torch.nn.Linear(1, 1), trainable=trainable)

        def _get_training_dtype(self) -> torch.dtype:
            return torch.float32

        def init_preprocessors(self, training_config: Any) -> None:
            # WanModel's loads the VAE and the dataloader; its timestep mechanics are what DMD2 uses.
            self.vae = types.SimpleNamespace(latents_mean=[0.0] * SHAPES["C"], latents_std=[1.0] * SHAPES["C"])
            self._init_timestep_mechanics()

        def prepare_batch(self, raw_batch: dict, **kwargs: Any) -> Any:
            self.last_batch = super().prepare_batch(raw_batch, **kwargs)
            return self.last_batch

        def predict_noise(self, noisy_latents, timestep, batch, *, conditional, cfg_uncond=None, attn_kind="dense",
                          clean_x=None, aug_t=None):
            if tuple(timestep.shape) != (1,):
                raise RuntimeError(f"{self.role} was given a timestep of shape {tuple(timestep.shape)}, not [1]")
            self.calls.append({
                "role": self.role, "conditional": bool(conditional), "attn_kind": attn_kind,
                "timestep": float(timestep[0]), "dtype": str(timestep.dtype).replace("torch.", ""),
            })
            x = noisy_latents.permute(0, 2, 1, 3, 4)  # [B, T, C, H, W] -> [B, C, T, H, W]
            return standin_predict_noise(self.role, x, timestep, conditional).permute(0, 2, 1, 3, 4)

        def backward(self, loss, ctx, *, grad_accum_rounds):
            raise RuntimeError("the golden run calls only single_train_step")

    return StandinWanModel


def training_config(fv: types.SimpleNamespace, student_shift: float) -> Any:
    tc = fv.training_config
    s = SHAPES
    config = tc.TrainingConfig(
        data=tc.DataConfig(train_batch_size=s["B"], seed=GENERATOR_SEED, num_height=s["H"] * 8, num_width=s["W"] * 8,
                           num_latent_t=s["T"]),
        optimizer=tc.OptimizerConfig(learning_rate=1.0e-5),
        loop=tc.TrainingLoopConfig(max_train_steps=len(ITERATIONS)),
    )
    # The student's score-timestep shift is the pipeline's flow_shift (WanModel._init_timestep_mechanics);
    # here it equals the student's flow_shift in every case.
    config.pipeline_config = types.SimpleNamespace(
        flow_shift=student_shift,
        vae_config=types.SimpleNamespace(arch_config=types.SimpleNamespace(z_dim=s["C"], spatial_compression_ratio=8)),
        dit_config=types.SimpleNamespace(patch_size=(1, 2, 2)),
    )
    return config


def build_method(fv: types.SimpleNamespace, case: dict[str, Any]) -> Any:
    """FastVideo's DMD2Method through its own constructor, with stand-in roles."""
    shifts = case["flow_shift"]
    tc = training_config(fv, shifts["student"])
    model_cls = standin_wan_class(fv)
    call_log: list[dict[str, Any]] = []
    roles = {
        role: model_cls(role=role, call_log=call_log, training_config=tc, trainable=role != "teacher",
                        flow_shift=shifts[role])
        for role in ("student", "teacher", "critic")
    }
    cfg = types.SimpleNamespace(training=tc, method={**case["method"], **CRITIC_OPTIMIZER}, validation={})
    method = fv.dmd2.DMD2Method(cfg=cfg, role_models=roles)
    # TrainingMethod.on_train_start on rank 0 without sequence parallelism: seed + 0.
    method.cuda_generator = torch.Generator("cpu").manual_seed(GENERATOR_SEED)
    return method


def generator_sha256(generator: torch.Generator) -> str:
    return hashlib.sha256(generator.get_state().numpy().tobytes()).hexdigest()


def _loss(value: torch.Tensor) -> dict[str, Any]:
    v = float(value)
    return {"hex": v.hex(), "value": v}


def _timestep_record(t: torch.Tensor) -> dict[str, Any]:
    return {"values": [float(v) for v in t.detach().reshape(-1)], "dtype": str(t.dtype), "shape": list(t.shape)}


def run_case(fv: types.SimpleNamespace, case: dict[str, Any]) -> list[dict[str, Any]]:
    method = build_method(fv, case)
    batch = standin_batch(**SHAPES, seed=BATCH_SEED)
    records = []
    for iteration in ITERATIONS:
        method.student.calls.clear()
        loss_map, outputs, metrics = method.single_train_step(batch, iteration)
        tb = method.student.last_batch
        records.append({
            "iteration": iteration,
            "update_student": bool(metrics["update_student"]),
            **{key: _loss(loss_map[key]) for key in ("generator_loss", "fake_score_loss", "total_loss")},
            "generator_state_sha256": generator_sha256(method.cuda_generator),
            "prepare_batch_timesteps": _timestep_record(tb.timesteps),
            "fake_score_timestep": _timestep_record(outputs["fake_score_latent_vis_dict"]["fake_score_timestep"]),
            "model_calls": list(method.student.calls),
        })
    return records


def write_golden(out: str | Path, text: str) -> None:
    """Writes a golden file's text to `out` whole: a temporary file beside it, renamed over it."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(text)
    os.replace(tmp, out)
    print(f"wrote {out}")


def format_golden(golden: dict[str, Any]) -> str:
    """The JSON with one line per iteration's record (and per case's settings)."""
    head = {k: v for k, v in golden.items() if k != "cases"}
    cases = []
    for case in golden["cases"]:
        settings = json.dumps({k: v for k, v in case.items() if k != "results"})
        results = ",\n".join("    " + json.dumps(r) for r in case["results"])
        cases.append(f'  {settings[:-1]}, "results": [\n{results}\n  ]}}')
    text = json.dumps(head, indent=1)[:-2] + ',\n "cases": [\n' + ",\n".join(cases) + "\n ]\n}\n"
    if json.loads(text) != golden:
        raise AssertionError("format_golden changed the data")
    return text


def fastvideo_from_cli(argv: list[str] | None, doc: str, out: Path, install: Any) -> tuple[types.SimpleNamespace, Any]:
    """A golden generator's command line (--fastvideo, --out) and `install(root)`'s FastVideo,
    checked to be EXPECTED_VERSION: (the installed modules, the parsed arguments)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--fastvideo", required=True, help="the unzipped fastvideo wheel (the folder holding fastvideo/)")
    parser.add_argument("--out", default=str(out), help=f"the JSON to write (default {out.relative_to(REPO)})")
    args = parser.parse_args(argv)
    fv = install(Path(args.fastvideo))
    if fv.version != EXPECTED_VERSION:
        raise SystemExit(f"--fastvideo {fv.root}: FastVideo {fv.version}, expected {EXPECTED_VERSION}")
    return fv, args


def main(argv: list[str] | None = None) -> int:
    fv, args = fastvideo_from_cli(argv, __doc__, OUT, install_fastvideo)
    torch.set_num_threads(1)
    golden = {
        "fastvideo_version": fv.version,
        "dmd2_py_sha256": hashlib.sha256((fv.root / DMD2_FILE).read_bytes()).hexdigest(),
        "torch_version": torch.__version__,
        "standin_coefficients": {k: list(v) for k, v in STANDIN_COEFFICIENTS.items()},
        "shapes": SHAPES,
        "batch_seed": BATCH_SEED,
        "generator_seed": GENERATOR_SEED,
        "iterations": ITERATIONS,
        "dtype": "float32",
        "device": "cpu",
        "model_timestep_shape": [1],
        "cases": [],
    }
    for case in CASES:
        golden["cases"].append({
            "name": case["name"],
            "method": case["method"],
            "flow_shift": case["flow_shift"],
            "pipeline_flow_shift": case["flow_shift"]["student"],
            "results": run_case(fv, case),
        })
        print(case["name"], [r["total_loss"]["value"] for r in golden["cases"][-1]["results"]])
    write_golden(args.out, format_golden(golden))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
