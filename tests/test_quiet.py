"""Quiet by default, and launches that survive a busy machine:
- importing the package writes nothing to stderr and imports no optional library;
- every command's `--help` writes its usage to stdout and nothing to stderr;
- the libraries' unasked lines (bitsandbytes' kernel notice, DeepSpeed's accelerator detection,
  transformers' torchvision fallback, Accelerate's per-file checkpoint lines) are dropped; progress
  in a log file is plain lines;
- FSDP2's wrapped modules (each Wan block, the transformer) return tensors of their own, not views;
- a 2-process FSDP2 run launched while another process listens on port 29500 (Accelerate's
  default) passes, and its redirected log holds none of the lines above, no carriage return and
  no escape code."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.launch_helpers import ANY_FREE_PORT

REPO = Path(__file__).resolve().parents[1]
OPTIONAL = ("bitsandbytes", "prodigyopt", "wandb", "deepspeed")


def quiet_env() -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("PYTHONWARNINGS", None)
    return env


def test_importing_the_package_writes_nothing_and_imports_no_optional_library():
    code = (
        "import json, sys\n"
        "import fv_accel, fv_accel.build, fv_accel.trainer\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {OPTIONAL!r})))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=quiet_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert json.loads(done.stdout) == []


QUIETING = ("_common", "fv_accel.models", "fv_accel.process")  # the modules that quiet the libraries
LOUD = ("diffusers", "peft", "transformers", "bitsandbytes")


def quieted_before_loud(path: Path) -> bool:
    """Whether a script, read in source order (function bodies included), imports one of QUIETING
    before its first import of a LOUD library (or imports none of them)."""
    import ast

    imports = sorted(
        (node.lineno, name)
        for node in ast.walk(ast.parse(path.read_text()))
        for name in ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
    )
    for _, name in imports:
        if name in QUIETING:
            return True
        if name.split(".")[0] in LOUD:
            return False
    return True


@pytest.mark.slow
def test_the_benchmarks_start_quietly():
    """Every benchmark quiets the libraries before it imports them; `_common` (what they import) then
    diffusers' Wan transformer and peft, as a benchmark's first step imports them: nothing on stderr
    (no bitsandbytes 4-bit kernel notice)."""
    scripts = sorted(p for p in (REPO / "benchmarks").glob("*.py") if p.name != "_common.py")
    assert {p.name: quieted_before_loud(p) for p in scripts} == {p.name: True for p in scripts}
    code = "import sys\nsys.path.insert(0, 'benchmarks')\nimport _common\nfrom diffusers import WanTransformer3DModel\nimport peft\n"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=quiet_env(), capture_output=True, text=True, timeout=300)
    assert (done.returncode, done.stderr) == (0, "")


HELP_COMMANDS = [
    ["train_finetune.py"],
    ["train_dfsft.py"],
    ["-m", "fv_accel.preprocess"],
    ["-m", "fv_accel.export"],
    ["-m", "fv_accel.plot"],
    ["-m", "fv_accel.tiny_model"],
    ["-m", "fv_accel.data.inspect"],
    ["-m", "fv_accel.launch"],
]


@pytest.mark.slow
def test_every_command_help_is_quiet():
    """Usage on stdout, exit status 0, nothing on stderr (the commands run side by side)."""
    procs = [
        (cmd, subprocess.Popen([sys.executable, *cmd, "--help"], cwd=REPO, env=quiet_env(), text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        for cmd in HELP_COMMANDS
    ]
    for cmd, proc in procs:
        out, err = proc.communicate(timeout=300)
        assert (proc.returncode, err) == (0, ""), (cmd, err)
        assert "usage:" in out, (cmd, out)


def test_the_libraries_unasked_lines_are_dropped(caplog):
    from fv_accel.process import quiet_libraries

    quiet_libraries()
    with caplog.at_level(logging.INFO):
        logging.getLogger("bitsandbytes.backends.cpu.ops").warning("Failed to load CPU gemm_4bit_forward from kernels-community")
        logging.getLogger("DeepSpeed").warning("Setting accelerator to CPU. If you have GPU or other accelerator, ...")
        logging.getLogger("DeepSpeed").info("Setting ds_accelerator to cuda (auto detect)")
        logging.getLogger("transformers.utils.import_utils").warning("`CLIPImageProcessor` requires torchvision (not installed); ...")
        logging.getLogger("accelerate.checkpointing").info("Model weights saved in out/checkpoint-2/model.safetensors")
        # Everything else on those loggers still shows.
        logging.getLogger("DeepSpeed").warning("ZeRO stage 3 is on")
        logging.getLogger("bitsandbytes.backends.cpu.ops").error("a real error")
        logging.getLogger("accelerate.checkpointing").warning("a real warning")
    assert [r.getMessage() for r in caplog.records] == ["ZeRO stage 3 is on", "a real error", "a real warning"]


def test_progress_is_a_bar_on_a_terminal_and_plain_lines_in_a_log(monkeypatch):
    from tqdm import tqdm

    from fv_accel import process

    monkeypatch.setattr(process, "stderr_is_terminal", lambda: True)
    bar = process.progress_bar(5, "train", unit="step")
    assert isinstance(bar, tqdm) and not bar.disable
    bar.close()
    monkeypatch.setattr(process, "stderr_is_terminal", lambda: False)
    assert isinstance(process.progress_bar(5, "train", unit="step"), process.LineProgress)
    assert process.progress_bar(5, "train", show=False).disable  # another process's share: nothing

    stream = io.StringIO()
    lines = process.LineProgress(25, "train", unit="step", initial=5, stream=stream)
    for step in range(6, 26):
        lines.set_postfix(loss=f"{1 / step:.4f}")
        lines.update(1)
    lines.close()
    written = stream.getvalue().splitlines()
    # A line at each 3 steps more (a tenth of 25, rounded up), the last at the end, none twice.
    assert [line.split(" step ")[0] for line in written] == [f"train: {n}/25" for n in (8, 11, 14, 17, 20, 23, 25)]
    assert written[-1].startswith("train: 25/25 step (100%), ") and written[-1].endswith("loss=0.0400")


def _student(recipe: str):
    from fv_accel.config import load_config
    from fv_accel.models.wan import WanStudent

    torch.manual_seed(0)
    cfg = load_config(REPO / recipe)
    student = WanStudent(cfg)
    student.init_preprocessors(cfg.training)
    return student, cfg.models.student.transformer_config


@pytest.mark.parametrize("per_frame", [True, False], ids=["per-frame-timesteps", "per-sample-timesteps"])
def test_fsdp2_wrapped_modules_return_tensors_of_their_own(per_frame):
    """FSDP2 wraps each Wan block and the transformer, and hooks their outputs for its backward;
    an output that is a view draws its "returned a view tensor ... wrong gradients" warning."""
    from fv_accel.build import output_of_its_own
    from fv_accel.models.base import TrainingBatch

    student, tc = _student("configs/tiny_dfsft.yaml")
    B, T, H, W = 2, 3, 4, 4
    x = torch.randn(B, 16, T, H, W)
    t = torch.rand(B, T) * 1000 if per_frame else torch.tensor([10.0, 900.0])
    tb = TrainingBatch(encoder_hidden_states=torch.randn(B, 5, tc["text_dim"]))
    views = {}

    def record(name):
        def hook(module, args, output):
            views[name] = output._base is not None if isinstance(output, torch.Tensor) else output[0]._base is not None
        return hook

    transformer = student.transformer
    for i, block in enumerate(transformer.blocks):
        block.register_forward_hook(record(f"block {i}"))
    transformer.register_forward_hook(record("transformer (diffusers' own output)"))
    transformer.register_forward_hook(output_of_its_own)  # what configure_fsdp2 registers
    transformer.register_forward_hook(record("transformer"))  # what FSDP2's own hook, registered after, sees
    student.predict_noise(x, t, tb).pow(2).mean().backward()
    assert views.pop("transformer (diffusers' own output)")  # diffusers' unpatchify: a reshape
    assert views == {"block 0": False, "block 1": False, "block 2": False, "block 3": False, "transformer": False}


@contextlib.contextmanager
def port_29500_taken():
    """A socket listening on 29500 (or, when another process already holds it, that process's)."""
    from accelerate.utils.other import is_port_in_use

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        with contextlib.suppress(OSError):
            sock.bind(("", 29500))
            sock.listen()
        assert is_port_in_use(29500)
        yield
    finally:
        sock.close()


def test_the_multinode_launch_config_is_read_with_port_29500_taken():
    """The first machine's launcher of a several-machine config refuses a port in use: the tests
    read such a config with a free port."""
    from tests.test_distributed import launch_env

    with port_29500_taken():
        _, args, _ = launch_env(REPO / "accelerate_configs" / "fsdp2_hybrid.yaml", with_args=True)
    assert args.main_process_port not in (0, 29500)  # the free port Accelerate picked


# Lines a run must not write: the libraries' notices, FSDP2's view warning, diffusers' fp32 note,
# Accelerate's defaults notice, any Python warning, terminal control (carriage return, escape codes).
NOISE = ("gemm_4bit", "Setting accelerator", "ds_accelerator", "requires torchvision", "view tensor",
         "kept in float32", "had defaults used instead", "Warning:", "\r", "\x1b")


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_two_process_run_with_port_29500_taken_passes_with_a_plain_log(tmp_path, tiny_data_path):
    """FSDP2 over gloo on two CPU processes (the entry script switches Accelerate's CPU DDP over to
    the launch's FSDP plugin), SFT for 2 steps with held-out loss and sample videos at the start
    and the end, stdout and stderr into one file."""
    log = tmp_path / "log"
    env = dict(quiet_env(), OMP_NUM_THREADS="1")
    env.pop("ACCELERATE_USE_CPU", None)
    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", str(REPO / "accelerate_configs" / "fsdp2.yaml"),
           "--num_processes", "2", *ANY_FREE_PORT, "--mixed_precision", "no",
           str(REPO / "train_finetune.py"), "--output_dir", str(tmp_path / "out"), "--max_train_steps", "2",
           "--training.data.data_path", tiny_data_path, "--training.tracker.trackers", "[none]",
           "--training.tracker.write_plots", "false", "--training.checkpoint.training_state_checkpointing_steps", "0",
           "--callbacks.ema.enable", "false", "--callbacks.validation.every_steps", "2",
           "--callbacks.validation.sampling_steps", "2"]
    with port_29500_taken(), log.open("w") as fh:
        done = subprocess.run(cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=600)
    text = log.read_text()
    assert done.returncode == 0, text[-6000:]
    assert "engine FSDP2 (distributed_type FSDP, backend gloo) | 2 processes" in text
    assert sorted(p.name for p in (tmp_path / "out" / "samples").glob("step-*")) == ["step-0", "step-2"]
    assert "train: 2/2 step (100%)" in text  # the progress, as a plain line
    found = [(noise, line) for line in text.split("\n") for noise in NOISE if noise in line]
    assert not found, found
