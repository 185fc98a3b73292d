"""DeepSpeed from the entry scripts on CPU: real two-process ZeRO-2 and ZeRO-3 runs of
train_finetune.py under `accelerate launch` (DeepSpeed's CPU accelerator, gloo), each compared with
one process and gradient accumulation 2, and a launch that would run another engine refused.

Nothing is compiled: fv_accel skips DeepSpeed's CPU shared-memory extension (only its inference
all-reduce uses it; fv_accel.build.skip_deepspeed_shm_comm), which would otherwise take minutes of
C++ on a fresh machine. The runs get an empty TORCH_EXTENSIONS_DIR and check that it stays so.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.launch_helpers import ANY_FREE_PORT, wait_or_diagnose

REPO = Path(__file__).resolve().parent.parent
ACCELERATE = Path(sys.executable).parent / "accelerate"
WEIGHTS = "transformer/diffusion_pytorch_model.safetensors"
# The command, with sample videos and trackers off to keep it short.
ARGS = [
    "--max_train_steps", "3",
    "--training.data.train_batch_size", "1",
    "--training.loop.noise_rng", "sample",
    "--callbacks.validation.enable", "false",
    "--training.tracker.trackers", "[none]",
]
ENGINE_LINE = re.compile(
    r"engine (?P<name>[^(]+) \(distributed_type (?P<type>\w+), backend (?P<backend>\w+)\) \| (?P<world>\d+) processes "
    r"\| process 0 holds (?P<local>\d+) of (?P<full>\d+) parameter elements"
)


def launch_env(extensions: Path, **extra: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO), **extra)
    env["TORCH_EXTENSIONS_DIR"] = str(extensions)
    for key in ("ACCELERATE_USE_CPU", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "WORLD_SIZE", "LOCAL_RANK"):
        if key not in extra:
            env.pop(key, None)
    return env


def launch(config: str, out: Path, *args: str, timeout: float = 900, **env: str) -> tuple[int, str]:
    """`accelerate launch --config_file <config> --num_processes 2 train_finetune.py ARGS --output_dir out`;
    returns the exit status and the log. Torch extensions would be built in `<out>.extensions`."""
    log_path = out.parent / f"{out.name}.log"
    cmd = [str(ACCELERATE), "launch", "--config_file", str(REPO / config), "--num_processes", "2",
           *ANY_FREE_PORT, str(REPO / "train_finetune.py"), *ARGS, *args,
           "--output_dir", str(out)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=launch_env(out.parent / f"{out.name}.extensions", **env), stdout=log, stderr=subprocess.STDOUT)
    code = wait_or_diagnose(proc, timeout, log_path)
    return code, log_path.read_text(errors="replace")


def engine_line(log: str) -> dict:
    found = ENGINE_LINE.search(log)
    assert found, log[-4000:]
    return found.groupdict()


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]


def max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, tiny_data_path):
    """The same recipe in one process with gradient accumulation 2, through the entry script's body."""
    from fv_accel.cli import main
    from tests.dist_driver import reset_accelerate

    out = tmp_path_factory.mktemp("ds_ref") / "one"
    reset_accelerate()
    assert main("finetune", [*ARGS, "--training.loop.gradient_accumulation_steps", "2", "--output_dir", str(out)]) == 0
    reset_accelerate()
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_on_two_cpu_processes_equals_one_process_with_accumulation(stage, one_process, tmp_path, tiny_data_path, capsys):
    out = tmp_path / f"zero{stage}"
    extra = ("--callbacks.ema.enable", "false") if stage == 3 else ()  # the EMA is refused under ZeRO-3
    if stage == 2:  # a checkpoint at the last step, for the resume below
        extra = ("--training.checkpoint.training_state_checkpointing_steps", "3")
    code, log = launch(f"accelerate_configs/deepspeed_zero{stage}.yaml", out, *extra)
    assert code == 0, log[-6000:]
    assert not (tmp_path / f"zero{stage}.extensions").exists() and "built successfully" not in log  # nothing compiled
    engine = engine_line(log)
    assert engine["name"] == f"DeepSpeed ZeRO-{stage}" and engine["type"] == "DEEPSPEED"
    assert engine["backend"] == "gloo" and engine["world"] == "2"
    local, full = int(engine["local"]), int(engine["full"])
    if stage == 3:
        # Each rank holds its partition of every parameter (padded to the rank count): half of them.
        assert full / 2 <= local < full / 2 + 1000, engine
    else:
        assert local == full, engine
    # fp32 on CPU whatever the launch config's bf16 (training.loop.mixed_precision auto).
    assert "| 2 processes | mixed precision no" in log
    ds_metrics, ref_metrics = metrics(out), metrics(one_process)
    # The LR schedule runs under DeepSpeed (warmup: 1e-4, 2e-4, 3e-4), and the losses are the same.
    assert [m["lr"] for m in ds_metrics] == pytest.approx([1e-4, 2e-4, 3e-4])
    assert [m["lr"] for m in ds_metrics] == pytest.approx([m["lr"] for m in ref_metrics])
    assert [m["loss"] for m in ds_metrics] == pytest.approx([m["loss"] for m in ref_metrics], abs=1e-5)
    final, ref = load_file(str(out / WEIGHTS)), load_file(str(one_process / WEIGHTS))
    assert {str(v.dtype) for v in final.values()} == {"torch.float32"}
    assert max_diff(final, ref) < 1e-5
    if stage == 2:
        # Issue 31: its checkpoint resumed without DeepSpeed (was: "pytorch_model.bin missing ... no
        # complete checkpoint", as if damaged) is one line naming both engines.
        from fv_accel.cli import main
        from tests.dist_driver import reset_accelerate

        ckpt = out / "checkpoint-3"
        reset_accelerate()
        capsys.readouterr()
        code = main("finetune", [*ARGS, "--output_dir", str(tmp_path / "resumed"), "--resume_from_checkpoint", str(ckpt),
                                 "--max_train_steps", "4"])
        assert code == 2 and not (tmp_path / "resumed").exists()
        assert capsys.readouterr().err.strip().splitlines() == [
            f"error: {ckpt}: checkpoint written by DeepSpeed ZeRO-2, this launch is one process: it cannot be converted "
            "(each engine stores the model and optimizer state in its own layout); resume it under DeepSpeed ZeRO-2 (the "
            "launch configuration that wrote it), or start a new run from its weights with a fresh optimizer: "
            f"`python -m deepspeed.utils.zero_to_fp32 {ckpt} <folder> --tag pytorch_model --safe_serialization` gathers "
            "them into safetensors files"
        ]


@pytest.mark.multiproc
def test_deepspeed_config_under_accelerate_use_cpu_is_refused(tmp_path, tiny_data_path):
    """ACCELERATE_USE_CPU=1 makes Accelerate train DDP under a DeepSpeed config: refused, one line
    (once for the launch's two processes) naming both engines and the variable, nothing written."""
    out = tmp_path / "refused"
    code, log = launch("accelerate_configs/deepspeed_zero2.yaml", out, timeout=300, ACCELERATE_USE_CPU="1")
    assert code != 0
    errors = [line for line in log.splitlines() if line.startswith("error: ")]
    assert errors == [
        "error: the launch configuration names DeepSpeed (distributed_type DEEPSPEED) but DDP (MULTI_CPU) would run "
        "with 2 process(es): ACCELERATE_USE_CPU=1 makes Accelerate skip DeepSpeed; unset it (DeepSpeed runs on CPU "
        "over gloo without it)"
    ], log[-4000:]
    assert not out.exists()


# ---- the launch's engine against the Accelerator's (in-process) ------------------------------------


def _acc(kind: str, processes: int):
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    return SimpleNamespace(distributed_type=DistributedType[kind], num_processes=processes)


@pytest.mark.parametrize(
    "env,kind,processes,message",
    [
        ({"ACCELERATE_USE_DEEPSPEED": "true", "WORLD_SIZE": "2"}, "DEEPSPEED", 2, None),
        ({"WORLD_SIZE": "2"}, "MULTI_CPU", 2, None),
        ({"ACCELERATE_USE_FSDP": "true", "WORLD_SIZE": "2"}, "FSDP", 2, None),
        ({"ACCELERATE_USE_FSDP": "true", "WORLD_SIZE": "1"}, "FSDP", 1, None),
        ({}, "NO", 1, None),
        (
            {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_USE_CPU": "1", "WORLD_SIZE": "2"}, "MULTI_CPU", 2,
            "the launch configuration names DeepSpeed (distributed_type DEEPSPEED) but DDP (MULTI_CPU) would run with "
            "2 process(es): ACCELERATE_USE_CPU=1 makes Accelerate skip DeepSpeed; unset it (DeepSpeed runs on CPU over "
            "gloo without it)",
        ),
        (
            {"WORLD_SIZE": "2"}, "NO", 1,
            "the launch configuration names DDP (distributed_type MULTI_GPU/MULTI_CPU) but a single process (NO) would "
            "run with 1 process(es): 2 processes were launched (WORLD_SIZE) but this one sees 1: they did not connect",
        ),
        (
            {"ACCELERATE_USE_FSDP": "true", "WORLD_SIZE": "2"}, "MULTI_GPU", 2,
            "the launch configuration names FSDP (distributed_type FSDP) but DDP (MULTI_GPU) would run with 2 "
            "process(es): Accelerate chose distributed_type MULTI_GPU on this machine",
        ),
    ],
)
def test_a_launch_runs_the_engine_its_config_names_or_nothing(env, kind, processes, message, monkeypatch):
    from fv_accel.build import check_engine_matches_launch

    for key in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "ACCELERATE_USE_CPU", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if message is None:
        check_engine_matches_launch(_acc(kind, processes))
    else:
        with pytest.raises(ValueError) as err:
            check_engine_matches_launch(_acc(kind, processes))
        assert str(err.value) == message


def test_launched_processes_without_an_accelerator_connect_over_gloo(monkeypatch):
    """DeepSpeed keeps its engine (no `cpu`), the others run as MULTI_CPU; all over gloo. Not
    launched (no LOCAL_RANK): nothing to connect."""
    from fv_accel.build import cpu_process_group

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert cpu_process_group("DEEPSPEED") == (False, [])
    monkeypatch.setenv("LOCAL_RANK", "0")
    for engine, cpu in (("DEEPSPEED", False), ("FSDP", True), ("DDP", True)):
        got_cpu, (kwargs,) = cpu_process_group(engine)
        assert (got_cpu, kwargs.backend) == (cpu, "gloo")
