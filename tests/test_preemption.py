"""Issue 14 case 15, preemption under launchers: `python -m fv_accel.launch` (accelerate launch that
relays SIGTERM to the training processes) exits 0 after a clean checkpoint-and-stop, where plain
`accelerate launch` exits 143; the SLURM script asks for SIGUSR1 before the time limit, forwards
SIGTERM to the training step and requeues the job after a clean stop."""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fv_accel.checkpoint import latest_checkpoint, read_metadata
from fv_accel.config import default_recipe, load_config
from tests.launch_helpers import ANY_FREE_PORT, kill_tree, wait_or_diagnose
from tests.resume_helpers import small_overrides, write_latent_dataset

REPO = Path(__file__).resolve().parent.parent
SLURM_SCRIPT = REPO / "accelerate_configs" / "slurm_multinode.sh"


@pytest.fixture(scope="module")
def latent_data(tmp_path_factory):
    return write_latent_dataset(tmp_path_factory.mktemp("latents"), num_clips=6)


# ---- the launcher: SIGTERM to it, a checkpoint, and its exit status --------------------------------


def _wait_for_steps(launcher: subprocess.Popen, out: Path, steps: int, log_path: Path) -> None:
    metrics = out / "logs" / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and launcher.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= steps:
            return
        time.sleep(0.2)
    kill_tree(launcher)
    raise AssertionError(f"the run did not reach step {steps}:\n{log_path.read_text()[-3000:]}")


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "launcher,nproc,expected_rc",
    [("fv_accel.launch", 2, 0), ("accelerate.commands.launch", 2, 128 + signal.SIGTERM), ("fv_accel.launch", 1, 0)],
    ids=["fv_accel.launch", "accelerate_launch", "fv_accel.launch_one_process"],
)
def test_sigterm_to_the_launcher_checkpoints_and_exits_as_documented(tmp_path, latent_data, launcher, nproc, expected_rc):
    """SIGTERM reaches the launcher only (as `kill <launcher pid>`, a container stop or SLURM's
    signal to the task): every rank finishes the step and they save one checkpoint.
    fv_accel.launch then exits 0 and the trainer names the checkpoint in FV_ACCEL_STOPPED_FILE;
    plain accelerate launch exits 143 (its grace window raised by TORCH_ELASTIC_SHUTDOWN_TIMEOUT)."""
    out = tmp_path / "out"
    over = small_overrides(
        out, latent_data,
        **{"training.loop.max_train_steps": 1000, "training.loop.gradient_accumulation_steps": 1,
           "training.tracker.log_every": 1},
    )
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(load_config(default_recipe("finetune"), over).to_yaml())
    stopped_file = tmp_path / "stopped"
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1",
               FV_ACCEL_STOPPED_FILE=str(stopped_file), TORCH_ELASTIC_SHUTDOWN_TIMEOUT="600",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    multi = ["--multi_gpu"] if nproc > 1 else []
    cmd = [sys.executable, "-m", launcher, *multi, "--num_processes", str(nproc), "--num_machines", "1",
           *ANY_FREE_PORT, "--mixed_precision", "no", "--dynamo_backend", "no",
           "train_finetune.py", "--config", str(recipe)]
    log_path = tmp_path / "launch.log"
    with open(log_path, "w") as log:
        launcher = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    _wait_for_steps(launcher, out, 3, log_path)
    launcher.send_signal(signal.SIGTERM)
    rc = wait_or_diagnose(launcher, 300, log_path)
    text = log_path.read_text()
    assert rc == expected_rc, text[-3000:]
    m = re.search(r"stopped by SIGTERM after step (\d+): checkpoint saved in (\S+); continue with --resume_from_checkpoint latest", text)
    assert m, text[-3000:]
    step = int(m.group(1))
    ckpt = out / f"checkpoint-{step}"
    assert 3 <= step < 1000 and Path(m.group(2)) == ckpt == latest_checkpoint(out)
    meta = read_metadata(ckpt)
    assert meta["step"] == step and meta["world_size"] == nproc
    assert stopped_file.read_text() == f"{ckpt}\n"
    if launcher == "fv_accel.launch":
        assert f"fv_accel.launch: SIGTERM relayed to {nproc} training process(es)" in text
        assert "Traceback" not in text


# ---- the SLURM script, with srun / scancel / scontrol stubbed --------------------------------------


def _stub(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def _slurm_stubs(folder: Path) -> None:
    """srun runs its command as node 0 would (SLURM_NODEID=0); the training is a fake `python` that
    records its arguments and, on SIGTERM, behaves as $FAKE_STEP says: `stops` (writes the
    checkpoint into $FV_ACCEL_STOPPED_FILE and exits 0, as the trainer does), `finished` (exits 0),
    `fails` (exits 1). scancel sends the signal it is asked for to that fake; every call is logged."""
    _stub(folder, "srun", 'echo "srun $*" >> "$CALLS"\n[[ $1 == --kill-on-bad-exit=1 ]] && shift\nSLURM_NODEID=0 exec "$@"\n')
    _stub(folder, "scontrol", 'echo "scontrol $*" >> "$CALLS"\n[[ $1 == show ]] && printf "node-a\\nnode-b\\n"\nexit 0\n')
    _stub(folder, "scancel", 'echo "scancel $*" >> "$CALLS"\nsig=${1#--signal=}\nkill -s "$sig" "$(cat "$STUBS/python.pid")"\n')
    _stub(
        folder, "python",
        'echo "python $*" >> "$CALLS"\n'
        'on_term() {\n'
        '  echo "python got SIGTERM" >> "$CALLS"\n'
        '  case $FAKE_STEP in\n'
        '    stops) echo "$STUBS/out/checkpoint-7" > "$FV_ACCEL_STOPPED_FILE"; exit 0 ;;\n'
        '    finished) exit 0 ;;\n'
        '    *) exit 1 ;;\n'
        '  esac\n'
        '}\n'
        'trap on_term TERM\n'
        'echo $$ > "$STUBS/python.pid.tmp" && mv "$STUBS/python.pid.tmp" "$STUBS/python.pid"\n'
        'while true; do sleep 0.1; done\n',
    )


@pytest.mark.parametrize(
    "fake_step,signal_from,expected_rc,requeued",
    [("stops", "time_limit", 0, True), ("finished", "time_limit", 0, False), ("fails", "time_limit", 1, False),
     ("stops", "preemption", 0, False)],
)
def test_slurm_script_forwards_the_time_limit_signal_and_requeues_after_a_clean_stop(
    tmp_path, fake_step, signal_from, expected_rc, requeued
):
    """time_limit: SIGUSR1 to the batch script (`--signal=B:USR1@...`), which forwards SIGTERM to the
    step and requeues after a clean stop. preemption: SLURM's SIGTERM to the script and the step at
    once; the script waits for the step and leaves the requeue to SLURM."""
    text = SLURM_SCRIPT.read_text()
    m = re.search(r"^#SBATCH --signal=B:USR1@(\d+)$", text, re.M)
    assert m and int(m.group(1)) >= 300 and re.search(r"^#SBATCH --requeue$", text, re.M)
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    _slurm_stubs(stubs)
    calls = tmp_path / "calls.log"
    env = dict(os.environ, PATH=f"{stubs}{os.pathsep}{os.environ['PATH']}", CALLS=str(calls), STUBS=str(stubs),
               FAKE_STEP=fake_step, SLURM_NNODES="2", SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="node-[a-b]",
               SLURM_SUBMIT_DIR=str(tmp_path), PYTHON="python")
    env.pop("FV_ACCEL_STOPPED_FILE", None)
    job = subprocess.Popen(
        ["bash", str(SLURM_SCRIPT), "configs/tiny_dfsft.yaml", "train_dfsft.py", "--training.loop.max_train_steps", "50"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.time() + 60
        while not (stubs / "python.pid").is_file() and job.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert (stubs / "python.pid").is_file(), (job.poll(), job.communicate(timeout=10)[0], calls.read_text())
        if signal_from == "time_limit":
            job.send_signal(signal.SIGUSR1)  # what `--signal=B:USR1@...` does before the time limit
        else:
            job.send_signal(signal.SIGTERM)
            os.kill(int((stubs / "python.pid").read_text()), signal.SIGTERM)
        output, _ = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == expected_rc, output
    lines = calls.read_text().splitlines()
    assert lines[0] == "scontrol show hostnames node-[a-b]"
    assert lines[1].startswith("srun --kill-on-bad-exit=1 bash -c ")
    launch = next(line for line in lines if line.startswith("python "))
    assert launch == (
        "python -m fv_accel.launch --machine_rank 0 --config_file accelerate_configs/fsdp2.yaml --num_machines 2 "
        "--num_processes 16 --main_process_ip node-a --main_process_port 29500 train_dfsft.py "
        "--config configs/tiny_dfsft.yaml --resume_from_checkpoint latest --training.loop.max_train_steps 50"
    )
    assert ("scancel --signal=TERM 4242" in lines) == (signal_from == "time_limit") and "python got SIGTERM" in lines
    assert ("scontrol requeue 4242" in lines) == requeued
    if requeued:
        assert f"stopped for the time limit with a checkpoint in {stubs / 'out' / 'checkpoint-7'}; requeueing job 4242" in output
        assert lines[-1] == "scontrol requeue 4242"
    if signal_from == "preemption":
        assert f"stopped by a signal with a checkpoint in {stubs / 'out' / 'checkpoint-7'}; not requeued by this script" in output
    assert not (tmp_path / ".fv_accel_stopped_4242").exists()


def test_torch_elastic_shutdown_timeout_reaches_the_agent_through_accelerate_launch(monkeypatch):
    """The grace window of plain multi-process `accelerate launch` (docs/checkpoints-and-faults.md, "Preemption"): the
    elastic agent's shutdown timeout comes from TORCH_ELASTIC_SHUTDOWN_TIMEOUT (30 s without it)."""
    import torch.distributed.run as distrib_run
    from accelerate.commands.launch import _filter_args, launch_command_parser

    def agent_timeout() -> int:
        args = launch_command_parser().parse_args(["--multi_gpu", "--num_processes", "2", "train_finetune.py"])
        args.nproc_per_node, args.nnodes = "2", "1"  # as accelerate's multi-GPU launcher sets them
        args = _filter_args(args, distrib_run.get_args_parser(), ["--training_script", "train_finetune.py", "--training_script_args", "[]"])
        return distrib_run.config_from_args(args)[0].shutdown_timeout

    # config_from_args sets OMP_NUM_THREADS when it is unset: set here, undone after the test.
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    assert agent_timeout() == 30
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "600")
    assert agent_timeout() == 600
