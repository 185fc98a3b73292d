"""Scale-out on Accelerate's engines: results that do not depend on the process count.

The multi-process tests launch real `accelerate launch` runs on two CPU processes (gloo) through
tests/dist_driver.py, which records per rank the world size, the local losses, the samples seen
and the final weights. They launch as a user would on a machine without a GPU (no
ACCELERATE_USE_CPU): DDP with accelerate_configs/cpu_2proc.yaml; FSDP2 with
accelerate_configs/fsdp2.yaml through Accelerate's own FSDP2 path (torch `fully_shard`), which
fv_accel.build enables on CPU (fsdp2_on_cpu). DeepSpeed's config handling is tested here
in-process; its engine on two CPU processes in tests/test_deepspeed.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tests.conftest import TEST_SCALE
from tests.launch_helpers import ANY_FREE_PORT

REPO = Path(__file__).resolve().parent.parent
DRIVER = REPO / "tests" / "dist_driver.py"
ACCELERATE = Path(sys.executable).parent / "accelerate"
RECIPES = {"finetune": "configs/tiny_finetune.yaml", "dfsft": "configs/tiny_dfsft.yaml"}
DMD2_RECIPE = "configs/tiny_dmd2.yaml"
SF_RECIPE = "configs/tiny_self_forcing.yaml"
STEPS = 3
WEIGHT_TOL = 1e-5
LORA = {"training.data.train_batch_size": 1, "models.student.lora.enable": True}
LORA_FILE = "pytorch_lora_weights.safetensors"
# Context parallelism: Ulysses 2 on the 2 processes (data parallel 1), against one process.
ULYSSES2 = {"training.model.context_parallel.ulysses": 2}
CAUSAL = {"models.student.causal": True, "training.data.train_batch_size": 1}
ULYSSES_RUNS = {
    # Full SFT at batch 2 with the per-rank noise generator, held-out loss and a sample video at the end.
    "finetune_ulysses2": (
        "finetune",
        {
            "training.data.train_batch_size": 2,
            "training.loop.noise_rng": "rank",
            "callbacks.validation.enable": True,
            "callbacks.validation.at_start": False,
            "callbacks.validation.prompts": ["a white square moving up on a light background"],
            "callbacks.validation.sampling_steps": 2,
        },
    ),
    # Block-causal DFSFT with LoRA.
    "dfsft_causal_lora_ulysses2": ("dfsft", {**CAUSAL, **LORA}),
}


def _driver():
    spec = importlib.util.spec_from_file_location("fv_dist_driver", DRIVER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def overrides(out_dir: Path, **extra) -> dict:
    """`noise_rng: sample`, 3 steps at a constant LR (updates of ~1e-3 per step, so a 1e-5 match
    means the same gradients), no sample videos.

    Adam's eps is raised to 1e-5: a batch of 2 in one forward and two batches of 1 give the same
    gradients up to fp32 rounding (~2e-9 here), but with eps=1e-8 Adam divides that rounding by
    gradients of ~1e-9 (cross-attention weights against zero-padded text) and turns it into weight
    differences of ~5e-5. With 1e-5 the rounding stays below 1e-6 in the weights, while gradients
    above eps still move each weight by ~lr per step."""
    base = {
        **TEST_SCALE,
        "training.loop.noise_rng": "sample",
        "training.loop.max_train_steps": STEPS,
        "training.optimizer.lr_warmup_steps": 0,
        "training.optimizer.eps": 1e-5,
        "training.tracker.trackers": ["none"],
        "training.checkpoint.output_dir": str(out_dir),
        "training.checkpoint.training_state_checkpointing_steps": 0,
        "callbacks.validation.enable": False,
    }
    base.update(extra)
    return base


def launch(config: str, runs: list[dict], root: Path, *extra_args: str, processes: int = 2) -> dict[str, list[dict]]:
    """One `accelerate launch` of the driver on CPU; returns each run's per-rank records."""
    spec_path = root / "spec.json"
    spec_path.write_text(json.dumps({"out_root": str(root / "records"), "runs": runs}))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("ACCELERATE_USE_CPU", None)
    cmd = [str(ACCELERATE), "launch", "--config_file", str(REPO / config), "--num_processes", str(processes),
           *ANY_FREE_PORT, *extra_args]
    proc = subprocess.run(
        [*cmd, str(DRIVER), str(spec_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=1200
    )
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}")
    records = {}
    for run in runs:
        folder = root / "records" / run["name"]
        records[run["name"]] = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(processes)]
        # The world size is asserted from inside the run, on every rank.
        assert [rec["world_size"] for rec in records[run["name"]]] == [processes] * processes, run["name"]
        assert [rec["rank"] for rec in records[run["name"]]] == list(range(processes))
    return records


def max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def metrics_values(output_dir: str, key: str) -> dict[int, float]:
    lines = (Path(output_dir) / "logs" / "metrics.jsonl").read_text().splitlines()
    return {rec["step"]: rec[key] for rec in map(json.loads, lines) if key in rec}


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory, tiny_data_path):
    """Two processes x batch 1 under DDP, both methods; the SFT run also checkpoints at step 2."""
    root = tmp_path_factory.mktemp("ddp")
    runs = [
        {
            "name": f"{method}_2proc",
            "recipe": RECIPES[method],
            "engine": "launch",
            "overrides": overrides(
                root / f"{method}_2proc",
                **{"training.data.train_batch_size": 1},
                **({"training.checkpoint.training_state_checkpointing_steps": 2} if method == "finetune" else {}),
            ),
        }
        for method in RECIPES
    ]
    runs.append(
        {
            "name": "dfsft_lora_2proc",
            "recipe": RECIPES["dfsft"],
            "engine": "launch",
            "overrides": overrides(root / "dfsft_lora_2proc", **LORA),
        }
    )
    runs += [
        {"name": name, "recipe": RECIPES[method], "engine": "launch", "overrides": overrides(root / name, **extra, **ULYSSES2)}
        for name, (method, extra) in ULYSSES_RUNS.items()
    ]
    runs.append({"name": "dmd2_2proc", "recipe": DMD2_RECIPE, "engine": "launch", "overrides": dmd2_run(root / "dmd2_2proc")})
    runs.append({"name": "sf_2proc", "recipe": SF_RECIPE, "engine": "launch", "overrides": self_forcing_run(root / "sf_2proc")})
    return root, launch("accelerate_configs/cpu_2proc.yaml", runs, root)


def dmd2_run(out_dir: Path, **extra) -> dict:
    """A tiny DMD2 run (the tests' inline teacher; student and critic start from it) at batch 1 per
    process with per-sample generators: 3 steps, the student updated at step 2."""
    from tests.dmd2_helpers import dmd2_overrides

    base = dmd2_overrides(out_dir.parent, **{
        "training.checkpoint.output_dir": str(out_dir),
        "training.loop.noise_rng": "sample",
        "training.loop.max_train_steps": STEPS,
        "training.optimizer.eps": 1e-5,
        "training.data.train_batch_size": 1,
        "method.generator_update_interval": 2,
    })
    base.update(extra)
    return base


def self_forcing_run(out_dir: Path, **extra) -> dict:
    """A tiny Self-Forcing run as `dmd2_run`: the block-causal student (chunks of 1 latent frame,
    3 chunks) inherits the inline teacher's weights."""
    from tests.self_forcing_helpers import self_forcing_overrides

    base = dmd2_run(out_dir)
    base.update(self_forcing_overrides(out_dir.parent, **{k: v for k, v in base.items() if not k.startswith("models.")}))
    base.update(extra)
    return base


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory, tiny_data_path, ddp_runs):
    """Two processes x batch 1 under FSDP2 (the fsdp2.yaml launch config, activation checkpointing
    switched on), SFT and DMD2 checkpointing at step 2; then fresh runs resuming those sharded
    checkpoints, and one asked to resume the DDP run's checkpoint (refused)."""
    root = tmp_path_factory.mktemp("fsdp2")
    ddp_root, _ = ddp_runs
    common = {"training.data.train_batch_size": 1}
    runs = [
        {
            "name": "finetune_fsdp2",
            "recipe": RECIPES["finetune"],
            "engine": "fsdp2",
            "overrides": overrides(
                root / "finetune_fsdp2", **common, **{"training.checkpoint.training_state_checkpointing_steps": 2}
            ),
        },
        {
            "name": "dfsft_lora_fsdp2",
            "recipe": RECIPES["dfsft"],
            "engine": "fsdp2",
            "overrides": overrides(root / "dfsft_lora_fsdp2", **LORA),
        },
        {
            # bf16 compute: the recipe's mixed_precision overrides the launch's "no".
            "name": "dfsft_fsdp2_bf16",
            "recipe": RECIPES["dfsft"],
            "engine": "fsdp2",
            "overrides": overrides(
                root / "dfsft_fsdp2_bf16",
                **common,
                **{"training.loop.mixed_precision": "bf16", "training.loop.max_train_steps": 2},
            ),
        },
        {
            # Context parallelism under FSDP2 (with the launch's activation checkpointing).
            "name": "dfsft_causal_ulysses2_fsdp2",
            "recipe": RECIPES["dfsft"],
            "engine": "fsdp2",
            "overrides": overrides(root / "dfsft_causal_ulysses2_fsdp2", **CAUSAL, **ULYSSES2),
        },
        {
            "name": "dmd2_fsdp2",
            "recipe": DMD2_RECIPE,
            "engine": "fsdp2",
            "overrides": dmd2_run(root / "dmd2_fsdp2", **{"training.checkpoint.training_state_checkpointing_steps": 2}),
        },
        {"name": "sf_fsdp2", "recipe": SF_RECIPE, "engine": "fsdp2", "overrides": self_forcing_run(root / "sf_fsdp2")},
        # DMD2 resumed from its step-2 checkpoint, and from a copy laid out as older checkpoints were
        # (with the teacher's shards, without the teacher's record).
        {
            "name": "dmd2_fsdp2_resumed",
            "recipe": DMD2_RECIPE,
            "engine": "fsdp2",
            "overrides": dmd2_run(
                root / "dmd2_fsdp2_resumed",
                **{"training.checkpoint.resume_from_checkpoint": str(root / "dmd2_fsdp2" / "checkpoint-2")},
            ),
        },
        {
            # The teacher in bf16 (student and critic as they were): other weights, refused on every rank.
            "name": "dmd2_fsdp2_changed_teacher",
            "recipe": DMD2_RECIPE,
            "engine": "fsdp2",
            "expect_error": True,
            "overrides": dmd2_run(
                root / "dmd2_fsdp2_changed_teacher",
                **{"models.teacher.torch_dtype": "bfloat16", "models.student.torch_dtype": "float32",
                   "models.critic.torch_dtype": "float32",
                   "training.checkpoint.resume_from_checkpoint": str(root / "dmd2_fsdp2" / "checkpoint-2")},
            ),
        },
        {
            "name": "dmd2_fsdp2_older_resumed",
            "recipe": DMD2_RECIPE,
            "engine": "fsdp2",
            "older_checkpoint": [str(root / "dmd2_fsdp2" / "checkpoint-2"), str(root / "dmd2_older" / "checkpoint-2")],
            "overrides": dmd2_run(
                root / "dmd2_fsdp2_older_resumed",
                **{"training.checkpoint.resume_from_checkpoint": str(root / "dmd2_older" / "checkpoint-2")},
            ),
        },
        {
            "name": "finetune_fsdp2_resumed",
            "recipe": RECIPES["finetune"],
            "engine": "fsdp2",
            "overrides": overrides(
                root / "finetune_fsdp2_resumed",
                **common,
                **{"training.checkpoint.resume_from_checkpoint": str(root / "finetune_fsdp2" / "checkpoint-2")},
            ),
        },
        {
            # Another engine's checkpoint: refused before anything is loaded.
            "name": "ddp_checkpoint_under_fsdp2",
            "recipe": RECIPES["finetune"],
            "engine": "fsdp2",
            "expect_error": True,
            "overrides": overrides(
                root / "ddp_checkpoint_under_fsdp2",
                **common,
                **{"training.checkpoint.resume_from_checkpoint": str(ddp_root / "finetune_2proc" / "checkpoint-2")},
            ),
        },
    ]
    extra = ("--mixed_precision", "no", "--fsdp_activation_checkpointing", "true")
    return root, launch("accelerate_configs/fsdp2.yaml", runs, root, *extra)


def _single_process(name: str, method: str, root: Path, **extra) -> tuple[dict, dict]:
    driver = _driver()
    driver.reset_accelerate()
    record = driver.run_one(
        {"name": name, "recipe": RECIPES[method], "engine": "launch", "overrides": overrides(root / name, **extra)},
        root / "records",
    )
    assert record["world_size"] == 1
    return record, load_file(str(root / "records" / name / "rank0.safetensors"))


@pytest.mark.multiproc
@pytest.mark.parametrize("method", list(RECIPES))
def test_two_processes_equal_one_process(method, ddp_runs, tmp_path):
    """2 processes x batch 1 == 1 process x batch 2 == 1 process x batch 1 x 2 accumulation steps."""
    root, records = ddp_runs
    ranks = records[f"{method}_2proc"]
    folder = root / "records" / f"{method}_2proc"
    w_rank0, w_rank1 = (load_file(str(folder / f"rank{r}.safetensors")) for r in (0, 1))
    assert max_diff(w_rank0, w_rank1) == 0.0  # DDP leaves both ranks with the same weights
    init = load_file(str(folder / "init.safetensors"))
    assert max_diff(w_rank0, init) > 1e-3  # the runs did train

    batch2, w_batch2 = _single_process(f"{method}_batch2", method, tmp_path, **{"training.data.train_batch_size": 2})
    accum2, w_accum2 = _single_process(
        f"{method}_accum2",
        method,
        tmp_path,
        **{"training.data.train_batch_size": 1, "training.loop.gradient_accumulation_steps": 2},
    )
    assert max_diff(w_rank0, w_batch2) < WEIGHT_TOL
    assert max_diff(w_rank0, w_accum2) < WEIGHT_TOL
    assert max_diff(w_batch2, w_accum2) < WEIGHT_TOL

    for step in range(STEPS):
        # The same samples per optimizer step, however the work is split.
        two_proc = sorted(ranks[0]["steps"][step]["samples"] + ranks[1]["steps"][step]["samples"])
        assert two_proc == sorted(batch2["steps"][step]["samples"]) == sorted(accum2["steps"][step]["samples"])
        assert len(set(two_proc)) == 2
        # Logged loss == mean of the ranks' losses == the one-process loss of the same samples.
        mean_of_ranks = (ranks[0]["steps"][step]["local_loss"] + ranks[1]["steps"][step]["local_loss"]) / 2
        assert ranks[0]["logged"][step]["loss"] == pytest.approx(mean_of_ranks, abs=1e-6)
        assert ranks[1]["logged"][step]["loss"] == pytest.approx(mean_of_ranks, abs=1e-6)
        assert batch2["logged"][step]["loss"] == pytest.approx(mean_of_ranks, abs=1e-5)
        assert accum2["logged"][step]["loss"] == pytest.approx(mean_of_ranks, abs=1e-5)
    # What the main process wrote to logs/metrics.jsonl is that mean too.
    written = metrics_values(ranks[0]["output_dir"], "loss")
    assert sorted(written) == [1, 2, 3]
    for step in range(STEPS):
        mean_of_ranks = (ranks[0]["steps"][step]["local_loss"] + ranks[1]["steps"][step]["local_loss"]) / 2
        assert written[step + 1] == pytest.approx(mean_of_ranks, abs=1e-6)
    # The two ranks' losses differ (different samples): the mean is not one rank's value.
    assert abs(ranks[0]["steps"][0]["local_loss"] - ranks[1]["steps"][0]["local_loss"]) > 1e-4


@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(ULYSSES_RUNS))
def test_ulysses_two_processes_equal_one_process(name, ddp_runs, tmp_path):
    """Ulysses 2 on 2 processes: both hold half of every sequence of the same samples, and end where
    one process ends alone (losses, weights; for SFT also the held-out loss)."""
    method, extra = ULYSSES_RUNS[name]
    root, records = ddp_runs
    ranks = records[name]
    assert [r["context_parallel"] for r in ranks] == [
        {"ulysses": 2, "ring": 1, "group_rank": 0}, {"ulysses": 2, "ring": 1, "group_rank": 1}
    ]
    one, w_one = _single_process(f"{name}_one_process", method, tmp_path, **extra)
    assert one["context_parallel"] is None
    folder = root / "records" / name
    w_rank0, w_rank1 = (load_file(str(folder / f"rank{r}.safetensors")) for r in (0, 1))
    assert max_diff(w_rank0, w_rank1) == 0.0
    assert max_diff(w_rank0, load_file(str(folder / "init.safetensors"))) > 1e-3  # it trained
    assert max_diff(w_rank0, w_one) < WEIGHT_TOL
    for step in range(STEPS):
        samples = one["steps"][step]["samples"]
        assert ranks[0]["steps"][step]["samples"] == ranks[1]["steps"][step]["samples"] == samples
        for rank in ranks:
            assert rank["steps"][step]["local_loss"] == pytest.approx(one["steps"][step]["local_loss"], abs=1e-5)
            assert rank["logged"][step]["loss"] == pytest.approx(one["logged"][step]["loss"], abs=1e-5)
    if extra.get("callbacks.validation.enable"):
        heldout = metrics_values(ranks[0]["output_dir"], "heldout/loss")
        assert sorted(heldout) == [STEPS]
        assert heldout[STEPS] == pytest.approx(metrics_values(one["output_dir"], "heldout/loss")[STEPS], abs=1e-5)
        assert len(list((Path(ranks[0]["output_dir"]) / "samples" / f"step-{STEPS}").glob("*.mp4"))) == 1


@pytest.mark.multiproc
def test_ulysses_under_fsdp2_equals_one_process(fsdp_runs, tmp_path):
    root, records = fsdp_runs
    ranks = records["dfsft_causal_ulysses2_fsdp2"]
    assert [(r["is_fsdp2"], r["context_parallel"]["ulysses"]) for r in ranks] == [(True, 2), (True, 2)]
    one, w_one = _single_process("dfsft_causal_one_process", "dfsft", tmp_path, **CAUSAL)
    final = load_file(str(root / "dfsft_causal_ulysses2_fsdp2" / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert max_diff(final, w_one) < WEIGHT_TOL
    for step in range(STEPS):
        assert ranks[0]["steps"][step]["samples"] == ranks[1]["steps"][step]["samples"] == one["steps"][step]["samples"]
        assert ranks[0]["logged"][step]["loss"] == pytest.approx(one["logged"][step]["loss"], abs=1e-5)


@pytest.mark.multiproc
def test_two_process_checkpoint_resumes_in_one_process(ddp_runs, tmp_path):
    """A checkpoint written by 2 processes x batch 1 resumes in 1 process x batch 2 and ends
    where the uninterrupted two-process run ended."""
    root, records = ddp_runs
    ckpt = root / "finetune_2proc" / "checkpoint-2"
    assert json.loads((ckpt / "metadata.json").read_text())["world_size"] == 2
    resumed, w_resumed = _single_process(
        "finetune_resumed_1proc",
        "finetune",
        tmp_path,
        **{"training.data.train_batch_size": 2, "training.checkpoint.resume_from_checkpoint": str(ckpt)},
    )
    assert resumed["start_step"] == 2 and [s["step"] for s in resumed["steps"]] == [3]
    two_proc = records["finetune_2proc"]
    assert sorted(resumed["steps"][0]["samples"]) == sorted(
        two_proc[0]["steps"][2]["samples"] + two_proc[1]["steps"][2]["samples"]
    )
    w_two_proc = load_file(str(root / "records" / "finetune_2proc" / "rank0.safetensors"))
    assert max_diff(w_resumed, w_two_proc) < WEIGHT_TOL


@pytest.mark.multiproc
def test_fsdp2_equals_ddp_and_its_sharded_checkpoint_resumes(fsdp_runs, ddp_runs):
    root, records = fsdp_runs
    ddp_root, ddp_records = ddp_runs
    fsdp = records["finetune_fsdp2"]
    for rec in fsdp:
        # Accelerate's FSDP2 (DTensor parameters); the launch's fsdp_activation_checkpointing is
        # served by diffusers' per-block checkpointing (fv_accel.build.configure_fsdp2), with no
        # checkpoint wrapper renaming the blocks.
        assert rec["distributed_type"] == "DistributedType.FSDP" and rec["is_fsdp2"]
        assert rec["param_type"] == "DTensor"
        assert rec["checkpoint_wrapped_blocks"] == 0
        assert rec["diffusers_gradient_checkpointing"] is True
    # The gathered final weights (one diffusers folder) equal the DDP run's after 3 steps.
    final = load_file(str(root / "finetune_fsdp2" / "transformer" / "diffusion_pytorch_model.safetensors"))
    ddp = load_file(str(ddp_root / "records" / "finetune_2proc" / "rank0.safetensors"))
    assert max_diff(final, ddp) < WEIGHT_TOL
    for step in range(STEPS):
        assert fsdp[0]["logged"][step]["loss"] == pytest.approx(ddp_records["finetune_2proc"][0]["logged"][step]["loss"], abs=1e-5)

    # The checkpoint holds each rank's shard (torch.distributed.checkpoint), model and optimizer.
    ckpt = root / "finetune_fsdp2" / "checkpoint-2"
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):
        assert sorted(p.name for p in (ckpt / part).glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert not (ckpt / "model.safetensors").exists()
    # A fresh run resumed from it continues to the same weights as the uninterrupted run.
    resumed = records["finetune_fsdp2_resumed"]
    assert [rec["start_step"] for rec in resumed] == [2, 2]
    assert [s["step"] for s in resumed[0]["steps"]] == [3]
    assert resumed[0]["steps"][0]["samples"] == fsdp[0]["steps"][2]["samples"]
    resumed_final = load_file(
        str(root / "finetune_fsdp2_resumed" / "transformer" / "diffusion_pytorch_model.safetensors")
    )
    assert max_diff(resumed_final, final) < WEIGHT_TOL
    # The EMA: one file of full tensors gathered from the shards, sharded again on resume.
    with safe_open(str(ckpt / "ema.safetensors"), framework="pt") as fh:
        ema_shapes = sorted(tuple(fh.get_slice(k).get_shape()) for k in fh.keys())
    assert ema_shapes == sorted(tuple(v.shape) for v in final.values())
    for r in (0, 1):
        with safe_open(str(ckpt / f"fv_rank_{r}.safetensors"), framework="pt") as fh:
            assert all(k.startswith("rng/") for k in fh.keys())
    ema_file = "ema/transformer/diffusion_pytorch_model.safetensors"
    ema_resumed, ema_full = load_file(str(root / "finetune_fsdp2_resumed" / ema_file)), load_file(str(root / "finetune_fsdp2" / ema_file))
    assert max_diff(ema_resumed, ema_full) < WEIGHT_TOL
    assert max_diff(ema_full, final) > 1e-5  # the average is not the weights


@pytest.mark.multiproc
def test_fsdp2_checkpoint_of_two_processes_resumes_in_one(fsdp_runs, tmp_path):
    """torch.distributed.checkpoint reshards: the two-process FSDP2 checkpoint resumes under FSDP2
    in one process (batch 2) and ends with the two-process run's weights; the EMA, saved as full
    tensors, resumes too and ends with the two-process run's average."""
    root, records = fsdp_runs
    runs = [
        {
            "name": "finetune_fsdp2_resumed_1proc",
            "recipe": RECIPES["finetune"],
            "engine": "fsdp2",
            "overrides": overrides(
                tmp_path / "finetune_fsdp2_resumed_1proc",
                **{
                    "training.data.train_batch_size": 2,
                    "training.checkpoint.resume_from_checkpoint": str(root / "finetune_fsdp2" / "checkpoint-2"),
                },
            ),
        }
    ]
    one = launch("accelerate_configs/fsdp2.yaml", runs, tmp_path, "--mixed_precision", "no", processes=1)
    (rec,) = one["finetune_fsdp2_resumed_1proc"]
    assert rec["is_fsdp2"] and rec["start_step"] == 2
    assert sorted(rec["steps"][0]["samples"]) == sorted(
        records["finetune_fsdp2"][0]["steps"][2]["samples"] + records["finetune_fsdp2"][1]["steps"][2]["samples"]
    )
    final = load_file(str(tmp_path / "finetune_fsdp2_resumed_1proc" / "transformer" / "diffusion_pytorch_model.safetensors"))
    two_proc = load_file(str(root / "finetune_fsdp2" / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert max_diff(final, two_proc) < WEIGHT_TOL
    ema_file = "ema/transformer/diffusion_pytorch_model.safetensors"
    ema_one = load_file(str(tmp_path / "finetune_fsdp2_resumed_1proc" / ema_file))
    assert max_diff(ema_one, load_file(str(root / "finetune_fsdp2" / ema_file))) < WEIGHT_TOL


@pytest.mark.multiproc
def test_a_checkpoint_of_another_engine_is_refused_in_one_line(fsdp_runs, ddp_runs, tmp_path):
    """Issue 31: a DDP checkpoint under an FSDP2 launch (was: AssertionError on `.metadata` in
    torch.distributed.checkpoint) and an FSDP2 checkpoint in one process (was: "pytorch_model.bin
    missing ... no complete checkpoint", as if damaged): one line naming both engines, and how to take
    the weights to a new run."""
    from fv_accel.build import build_from_config
    from fv_accel.checkpoint import CheckpointError

    root, records = fsdp_runs
    ddp_root, _ = ddp_runs
    ddp_ckpt = ddp_root / "finetune_2proc" / "checkpoint-2"
    refused = records["ddp_checkpoint_under_fsdp2"]
    assert [r["distributed_type"] for r in refused] == ["DistributedType.FSDP"] * 2
    assert [r["error"] for r in refused] == [
        f"CheckpointError: {ddp_ckpt}: checkpoint written by DDP, this launch is FSDP2: it cannot be converted (each engine "
        "stores the model and optimizer state in its own layout); resume it under DDP (the launch configuration that "
        f"wrote it), or start a new run from its weights with a fresh optimizer: `python -m fv_accel.export {ddp_ckpt} "
        "--to diffusers` writes them as a transformer folder for models.student.init_from"
    ] * 2
    assert not (root / "ddp_checkpoint_under_fsdp2").exists()

    fsdp_ckpt = root / "finetune_fsdp2" / "checkpoint-2"
    _driver().reset_accelerate()
    with pytest.raises(CheckpointError) as err:
        build_from_config(REPO / RECIPES["finetune"], overrides(tmp_path / "one", **{
            "training.checkpoint.resume_from_checkpoint": str(fsdp_ckpt)}))
    assert str(err.value) == (
        f"{fsdp_ckpt}: checkpoint written by FSDP2, this launch is one process: it cannot be converted (each engine stores "
        "the model and optimizer state in its own layout); resume it under FSDP2 (the launch configuration that wrote "
        f"it), or start a new run from its weights with a fresh optimizer: `accelerate merge-weights "
        f"{fsdp_ckpt / 'pytorch_model_fsdp_0'} <folder>` gathers them into one safetensors file"
    )


@pytest.mark.multiproc
def test_lora_dfsft_under_fsdp2_equals_ddp(fsdp_runs, ddp_runs):
    """A LoRA (frozen base, trainable adapter) DFSFT run: the adapter FSDP2 gathers and writes
    equals the DDP run's, step losses too."""
    root, records = fsdp_runs
    ddp_root, ddp_records = ddp_runs
    assert all(rec["is_fsdp2"] and rec["param_type"] == "DTensor" for rec in records["dfsft_lora_fsdp2"])
    assert all(rec["diffusers_gradient_checkpointing"] for rec in records["dfsft_lora_fsdp2"])
    fsdp_lora = load_file(str(root / "dfsft_lora_fsdp2" / LORA_FILE))
    ddp_lora = load_file(str(ddp_root / "dfsft_lora_2proc" / LORA_FILE))
    assert fsdp_lora and any(".lora_B." in k for k in fsdp_lora)
    assert max(v.abs().max().item() for k, v in ddp_lora.items() if ".lora_B." in k) > 1e-3  # it trained
    assert max_diff(fsdp_lora, ddp_lora) < WEIGHT_TOL
    for step in range(STEPS):
        assert records["dfsft_lora_fsdp2"][0]["logged"][step]["loss"] == pytest.approx(
            ddp_records["dfsft_lora_2proc"][0]["logged"][step]["loss"], abs=1e-5
        )


@pytest.mark.multiproc
def test_fsdp2_bf16_computes_in_bf16_with_fp32_timesteps_and_reduction(fsdp_runs, ddp_runs):
    """Under bf16 the blocks compute in bf16 over fp32 master weights, gradients are reduced in
    fp32, and the timesteps reach the model in fp32 (FSDP2's input cast would round t = 999.2 to
    1000); the first step's loss (before any update) matches the fp32 DDP run's to bf16 accuracy."""
    _, records = fsdp_runs
    _, ddp_records = ddp_runs
    for rec in records["dfsft_fsdp2_bf16"]:
        assert rec["is_fsdp2"] and rec["mixed_precision"] == "bf16"
        assert "param_dtype=torch.bfloat16, reduce_dtype=torch.float32" in rec["mp_policy"]
        assert rec["block_compute_dtypes"] == ["torch.bfloat16"]
        assert rec["timestep_dtypes"] == ["torch.float32"]
    first_bf16 = records["dfsft_fsdp2_bf16"][0]["logged"][0]["loss"]
    first_fp32 = ddp_records["dfsft_2proc"][0]["logged"][0]["loss"]
    assert first_bf16 == pytest.approx(first_fp32, rel=2e-2)
    # The fp32 runs: fp32 all the way.
    assert records["finetune_fsdp2"][0]["block_compute_dtypes"] == ["torch.float32"]


# ---------------------------------------------------------------------------------------------
# Launch configs and engine settings (in-process)
# ---------------------------------------------------------------------------------------------


def launch_env(config: Path, *cli: str, with_args: bool = False):
    """The environment `accelerate launch --config_file <config>` gives the training processes
    (and, with `with_args`, the launcher's resolved arguments and DeepSpeed command)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    # A free port unless the command names one: a launch config for several machines makes the
    # first machine's launcher refuse a port in use (the default 29500 on a busy machine).
    port = () if "--main_process_port" in cli else ANY_FREE_PORT
    args = launch_command_parser().parse_args(["--config_file", str(config), *port, *cli, "train.py"])
    args, defaults, _ = _validate_launch_command(args)
    cmd = None
    if args.use_deepspeed:
        # What `launch_command` adds before handing over to the DeepSpeed launcher.
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
        cmd, env = prepare_deepspeed_cmd_env(args)
    else:
        env = prepare_multi_gpu_env(args)
    return (env, args, cmd) if with_args else env


@pytest.mark.parametrize("name", ["fsdp2.yaml", "fsdp2_hybrid.yaml", "deepspeed_zero2.yaml", "deepspeed_zero3_offload.yaml"])
def test_multinode_launch_command_is_accepted(name):
    """The second-node command of docs/distributed-and-multi-node.md: torchrun on each node with its machine rank (for
    DeepSpeed too, not its pdsh launcher, so SLURM can start one launcher per node)."""
    cli = ("--num_machines", "2", "--num_processes", "16", "--machine_rank", "1",
           "--main_process_ip", "10.0.0.1", "--main_process_port", "29500")
    env, args, cmd = launch_env(REPO / "accelerate_configs" / name, *cli, with_args=True)
    assert cmd is None  # no `deepspeed --hostfile ...` command: accelerate runs torchrun itself
    assert (args.nnodes, args.node_rank, args.nproc_per_node) == ("2", 1, "8")
    rendezvous = getattr(args, "rdzv_endpoint", None) or f"{args.master_addr}:{args.master_port}"
    assert rendezvous == "10.0.0.1:29500"


CONFIGS = sorted(p.name for p in (REPO / "accelerate_configs").glob("*.yaml"))


@pytest.mark.parametrize("name", CONFIGS)
def test_accelerate_config_keys_are_accelerate_options(name):
    """Every key of every launch config is one Accelerate 1.16 knows."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import launch_command_parser

    path = REPO / "accelerate_configs" / name
    config = load_config_from_file(str(path))  # unknown top-level keys raise here
    options = {a.dest for a in launch_command_parser()._actions}
    nested = {**config.fsdp_config, **config.deepspeed_config, **config.parallelism_config}
    unknown = sorted(k for k in nested if k not in options)
    assert not unknown, f"{name}: keys Accelerate does not know: {unknown}"
    assert config.num_processes % config.num_machines == 0


@pytest.mark.parametrize("name", ["fsdp2.yaml", "fsdp2_hybrid.yaml"])
def test_fsdp2_configs_wrap_each_block_and_reduce_in_fp32(name, monkeypatch):
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    from fv_accel.build import configure_fsdp2
    from fv_accel.config import load_config
    from fv_accel.models import build_student

    env = launch_env(REPO / "accelerate_configs" / name, "--fsdp_activation_checkpointing", "true")
    assert env["FSDP_VERSION"] == "2" and env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    if name == "fsdp2_hybrid.yaml":
        assert (env["PARALLELISM_CONFIG_DP_REPLICATE_SIZE"], env["PARALLELISM_CONFIG_DP_SHARD_SIZE"]) == ("2", "8")
    for key, value in env.items():
        if key.startswith("FSDP_"):
            monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()
    plugin.set_mixed_precision("bf16")  # what AcceleratorState does under bf16
    for recipe in ("configs/tiny_finetune.yaml", "configs/tiny_dfsft.yaml"):
        for model_class in ("wan", "skyreels_v2"):
            cfg = load_config(REPO / recipe, {"models.student.model_class": model_class})
            student = build_student(cfg)
            policy = fsdp2_prepare_auto_wrap_policy(plugin, student.transformer)
            wrapped = [m for m in student.transformer.modules() if policy(m)]
            assert wrapped == list(student.transformer.blocks), (recipe, model_class)
            assert not student.transformer.gradient_checkpointing
            plugin.activation_checkpointing = True  # as the launch asked
            configure_fsdp2(plugin, "bf16", student)
            # One mechanism: diffusers' per-block checkpointing, not Accelerate's wrapper.
            assert student.transformer.gradient_checkpointing and not plugin.activation_checkpointing
    assert plugin.mixed_precision_policy.param_dtype == torch.bfloat16
    assert plugin.mixed_precision_policy.reduce_dtype == torch.float32
    # The student casts its inputs (latents, text) to bf16; FSDP casts nothing (timesteps stay fp32).
    assert plugin.mixed_precision_policy.cast_forward_inputs is False
    assert student.input_dtype == torch.bfloat16


@pytest.mark.parametrize(
    "name,stage,offload",
    [("deepspeed_zero2.yaml", 2, "none"), ("deepspeed_zero3.yaml", 3, "none"), ("deepspeed_zero3_offload.yaml", 3, "cpu")],
)
def test_deepspeed_configs_take_the_recipe_values(name, stage, offload, monkeypatch):
    """The DeepSpeed config Accelerate builds from each launch config, filled by fv_accel from the
    recipe, then completed by Accelerate's own `deepspeed_config_process` as in `prepare`."""
    from accelerate.utils import DeepSpeedPlugin

    from fv_accel.build import configure_deepspeed
    from fv_accel.config import load_config

    env = launch_env(REPO / "accelerate_configs" / name)
    for key, value in env.items():
        if key.startswith("ACCELERATE_"):
            monkeypatch.setenv(key, value)
    plugin = DeepSpeedPlugin()
    cfg = load_config(
        REPO / RECIPES["dfsft"],
        {
            "training.data.train_batch_size": 3,
            "training.loop.gradient_accumulation_steps": 4,
            "callbacks.grad_clip.max_grad_norm": 0.5,
        },
    )
    ds = configure_deepspeed(plugin.deepspeed_config, cfg)
    # Accelerate's later fill (defaults such as gradient_clipping=1.0 only replace "auto").
    plugin.deepspeed_config_process(
        must_match=False,
        gradient_clipping=1.0,
        train_micro_batch_size_per_gpu=3,
        train_batch_size=3 * 4 * 8,
        **{"zero_optimization.stage3_gather_16bit_weights_on_model_save": False},
    )
    assert ds["train_micro_batch_size_per_gpu"] == 3
    assert ds["gradient_accumulation_steps"] == 4
    assert ds["gradient_clipping"] == 0.5
    assert ds["train_batch_size"] == 96
    assert ds["zero_optimization"]["stage"] == stage
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == offload
    if stage == 3:
        assert ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True


def test_deepspeed_config_disagreeing_with_the_recipe_is_an_error():
    from fv_accel.build import configure_deepspeed
    from fv_accel.config import load_config

    cfg = load_config(REPO / RECIPES["finetune"], {"callbacks.grad_clip.max_grad_norm": 0.5})
    with pytest.raises(ValueError, match=r"gradient_clipping=1\.0.*callbacks\.grad_clip\.max_grad_norm"):
        configure_deepspeed({"gradient_clipping": 1.0, "zero_optimization": {"stage": 2}}, cfg)
    with pytest.raises(ValueError, match="'optimizer' section"):
        configure_deepspeed({"optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 2}}, cfg)
    # ZeRO-3 without a final save leaves the gather setting alone.
    cfg = load_config(REPO / RECIPES["finetune"], {"training.checkpoint.save_final": False})
    ds = configure_deepspeed({"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": False}}, cfg)
    assert ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is False


def test_launch_gradient_accumulation_must_match_the_recipe(monkeypatch, tmp_path):
    from fv_accel.build import build_accelerator
    from fv_accel.config import load_config

    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "4")
    cfg = load_config(REPO / RECIPES["finetune"], overrides(tmp_path / "out"))
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps is 1 but the launch configuration sets 4"):
        build_accelerator(cfg)


def test_fsdp_activation_offload_with_lora_is_refused():
    from accelerate.utils import FullyShardedDataParallelPlugin

    from fv_accel.build import configure_fsdp2
    from fv_accel.config import load_config
    from fv_accel.models import build_student

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, activation_checkpointing=True, activation_checkpointing_offload=True
    )
    full = build_student(load_config(REPO / RECIPES["finetune"], {"training.model.enable_gradient_checkpointing_type": "full"}))
    configure_fsdp2(plugin, "no", full)
    # Accelerate's offloading wrapper stays in charge, and diffusers' checkpointing steps aside.
    assert plugin.activation_checkpointing and not full.transformer.gradient_checkpointing
    lora = build_student(load_config(REPO / RECIPES["finetune"], {"models.student.lora.enable": True}))
    with pytest.raises(ValueError, match="fsdp_activation_checkpointing_offload.*lora"):
        configure_fsdp2(plugin, "no", lora)


def test_frozen_role_record_on_resume(tmp_path, caplog):
    """The checkpoint's record of a frozen role against the rebuilt role: the same weights pass; other
    weights are refused in one line, or with allow_recipe_change warned; a checkpoint without the
    record (an older one) resumes with a warning that the role is not verified."""
    from types import SimpleNamespace

    from fv_accel.build import describe_role_source
    from fv_accel.checkpoint import frozen_records, frozen_roles_problem
    from fv_accel.config import load_config

    cfg = load_config(REPO / DMD2_RECIPE, {"models.teacher.revision": "abc"})
    assert describe_role_source(cfg, "teacher") == (
        "models.teacher.init_from outputs/tiny_dmd2_teacher (revision abc, subfolder transformer, float32)"
    )
    source = "models.teacher.init_from teachers/wan (subfolder transformer, bfloat16)"
    teacher = SimpleNamespace(frozen_record={"source": source, "sha256": "ab" * 32})
    method = SimpleNamespace(role_models={"student": SimpleNamespace(), "teacher": teacher})
    assert frozen_records(method) == {"teacher": {"source": source, "sha256": "ab" * 32}}
    refuse, allow = (SimpleNamespace(training=SimpleNamespace(checkpoint=SimpleNamespace(allow_recipe_change=a)))
                     for a in (False, True))
    ckpt = tmp_path / "checkpoint-4"
    assert frozen_roles_problem({"frozen_roles": frozen_records(method)}, method, refuse, ckpt) is None
    saved = {"frozen_roles": {"teacher": {"source": "models.teacher.init_from old/wan (bfloat16)", "sha256": "cd" * 32}}}
    assert frozen_roles_problem(saved, method, refuse, ckpt) == (
        f"cannot resume from {ckpt}: models.teacher changed since it was saved: {source} has sha256 abababababababab... "
        "now, the run trained against models.teacher.init_from old/wan (bfloat16) with sha256 cdcdcdcdcdcdcdcd...; "
        "give models.teacher those weights again, or set training.checkpoint.allow_recipe_change: true to train on "
        "against these"
    )
    with caplog.at_level("WARNING", logger="fv_accel.checkpoint"):
        assert frozen_roles_problem(saved, method, allow, ckpt) is None
        assert frozen_roles_problem({}, method, refuse, ckpt) is None
    assert [r.getMessage() for r in caplog.records] == [
        f"resuming from {ckpt}: models.teacher changed since it was saved: {source} has sha256 abababababababab... now, "
        "the run trained against models.teacher.init_from old/wan (bfloat16) with sha256 cdcdcdcdcdcdcdcd...; training "
        "goes on against the new weights",
        f"{ckpt} records no checksum of models.teacher (saved by an older fv_accel): rebuilt from the recipe's source, "
        "not verified; any copy of its weights in the checkpoint is not read",
    ]


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["dmd2", "sf"])
def test_distillation_two_processes_equal_one_process(ddp_runs, tmp_path, name):
    """DMD2 and Self-Forcing on 2 processes x batch 1 ends where 1 process x batch 1 x 2 accumulation steps ends, for
    the student and the critic (per-sample generators: each sample draws the same numbers wherever
    it is trained; the DMD gradient's batch-wide denominator makes a batch of 2 in one forward
    another computation, as in FastVideo)."""
    root, records = ddp_runs
    ranks = records[f"{name}_2proc"]
    folder = root / "records" / f"{name}_2proc"
    driver = _driver()
    driver.reset_accelerate()
    recipe, make = (DMD2_RECIPE, dmd2_run) if name == "dmd2" else (SF_RECIPE, self_forcing_run)
    one = driver.run_one(
        {"name": f"{name}_accum2", "recipe": recipe, "engine": "launch",
         "overrides": make(tmp_path / f"{name}_accum2", **{"training.loop.gradient_accumulation_steps": 2})},
        tmp_path / "records",
    )
    assert one["world_size"] == 1
    for prefix in ("", "critic_"):
        w0, w1 = (load_file(str(folder / f"{prefix}rank{r}.safetensors")) for r in (0, 1))
        assert max_diff(w0, w1) == 0.0
        w_one = load_file(str(tmp_path / "records" / f"{name}_accum2" / f"{prefix}rank0.safetensors"))
        assert max_diff(w0, w_one) < WEIGHT_TOL, prefix
    assert max_diff(load_file(str(folder / "rank0.safetensors")), load_file(str(folder / "init.safetensors"))) > 1e-4
    for step in range(STEPS):
        mean_of_ranks = (ranks[0]["steps"][step]["local_loss"] + ranks[1]["steps"][step]["local_loss"]) / 2
        assert one["logged"][step]["loss"] == pytest.approx(mean_of_ranks, abs=1e-5)
    # The frozen teacher is never wrapped for gradient sync.
    assert all(rec["teacher_param_type"] == "Parameter" for rec in ranks)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["dmd2", "sf"])
def test_distillation_under_fsdp2_shards_all_roles_and_saves_student_and_critic(fsdp_runs, ddp_runs, name):
    """Under FSDP2 every role is sharded and the saved student and critic equal the DDP run's
    (Self-Forcing: every rank draws the same exit steps, so the sharded forwards line up)."""
    root, records = fsdp_runs
    ddp_root, _ = ddp_runs
    for rec in records[f"{name}_fsdp2"]:
        assert rec["is_fsdp2"] and rec["param_type"] == "DTensor" and rec["teacher_param_type"] == "DTensor"
        # After each teacher forward every teacher parameter is its shard again (FSDP2 alone
        # leaves the root's gathered: no backward follows).
        assert rec["teacher_param_types_after_forward"] == ["DTensor"]
    out = root / f"{name}_fsdp2"
    student = load_file(str(out / "transformer" / "diffusion_pytorch_model.safetensors"))
    critic = load_file(str(out / "critic" / "transformer" / "diffusion_pytorch_model.safetensors"))
    ddp = ddp_root / "records" / f"{name}_2proc"
    assert max_diff(student, load_file(str(ddp / "rank0.safetensors"))) < WEIGHT_TOL
    assert max_diff(critic, load_file(str(ddp / "critic_rank0.safetensors"))) < WEIGHT_TOL


@pytest.mark.multiproc
def test_fsdp2_distillation_checkpoint_holds_no_teacher_and_resumes(fsdp_runs):
    """Under FSDP2 a DMD2 checkpoint holds the student's and the critic's shards and optimizer
    state, and of the frozen teacher only its source and checksum; resumed from it (the teacher
    rebuilt from its source), and from a copy laid out as older checkpoints were (the teacher's
    shards in it, unread), the run ends where the straight run ends."""
    root, records = fsdp_runs
    ckpt = root / "dmd2_fsdp2" / "checkpoint-2"
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == [
        "optimizer_0", "optimizer_1", "pytorch_model_fsdp_0", "pytorch_model_fsdp_1"
    ]
    for part in ("pytorch_model_fsdp_0", "pytorch_model_fsdp_1"):
        assert sorted(p.name for p in (ckpt / part).glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    meta = json.loads((ckpt / "metadata.json").read_text())
    teacher = meta["frozen_roles"]["teacher"]
    assert list(meta["frozen_roles"]) == ["teacher"]
    assert teacher["source"] == "models.teacher.transformer_config (inline, seed 0, float32)"
    assert len(teacher["sha256"]) == 64 and int(teacher["sha256"], 16) > 0
    straight = records["dmd2_fsdp2"]
    out = root / "dmd2_fsdp2"
    for name in ("dmd2_fsdp2_resumed", "dmd2_fsdp2_older_resumed"):
        resumed = records[name]
        assert [rec["start_step"] for rec in resumed] == [2, 2]
        for r in (0, 1):
            assert [s["step"] for s in resumed[r]["steps"]] == [STEPS]
            assert resumed[r]["steps"][0]["local_loss"] == straight[r]["steps"][STEPS - 1]["local_loss"]
        for part in ("transformer", "critic/transformer"):
            final = load_file(str(out / part / "diffusion_pytorch_model.safetensors"))
            again = load_file(str(root / name / part / "diffusion_pytorch_model.safetensors"))
            assert max_diff(again, final) == 0.0, (name, part)
    # The older copy's teacher folder was there, and the resume did not need it.
    assert (root / "dmd2_older" / "checkpoint-2" / "pytorch_model_fsdp_2").is_dir()
    # A teacher whose weights changed is refused on every rank, in one line naming it, its source and both checksums.
    errors = [rec["error"] for rec in records["dmd2_fsdp2_changed_teacher"]]
    assert errors[0] == errors[1] and "\n" not in errors[0]
    assert errors[0].startswith(f"CheckpointError: cannot resume from {ckpt}: models.teacher changed since it was saved: ")
    assert "models.teacher.transformer_config (inline, seed 0, bfloat16) has sha256 " in errors[0]
    assert f"trained against {teacher['source']} with sha256 {teacher['sha256'][:16]}..." in errors[0]
    now = errors[0].split(" has sha256 ")[1][:16]
    assert len(now) == 16 and now != teacher["sha256"][:16]
