"""CPU threads: the launcher's default of one thread replaced by the machine's cores, a user's value kept,
and the warning for one thread where the user chose it."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fv_accel import cpu_threads

ACC1 = SimpleNamespace(device=torch.device("cpu"), num_processes=1, is_main_process=True)


def fake_parent(tmp_path: Path, monkeypatch, argv: list[str], environ: list[str]) -> Path:
    """A /proc tree whose entry for this process's parent holds `argv` and `environ`."""
    parent = tmp_path / str(os.getppid())
    parent.mkdir()
    (parent / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (parent / "environ").write_bytes(b"\0".join(e.encode() for e in environ) + b"\0")
    return tmp_path


@pytest.mark.parametrize(
    "argv, environ, expected",
    [
        (["/venv/bin/python", "/venv/bin/accelerate", "launch", "train_dmd2.py"], ["PATH=/bin"], True),
        (["/venv/bin/python", "-m", "fv_accel.launch", "train_dmd2.py"], ["PATH=/bin"], True),
        (["/venv/bin/accelerate", "launch", "--num_cpu_threads_per_process", "1", "t.py"], ["PATH=/bin"], False),
        (["/venv/bin/accelerate", "launch", "--num_cpu_threads_per_process=1", "t.py"], ["PATH=/bin"], False),
        (["/venv/bin/accelerate", "launch", "t.py"], ["PATH=/bin", "OMP_NUM_THREADS=1"], False),
        (["/bin/bash", "-c", "python t.py"], ["PATH=/bin"], False),
    ],
)
def test_the_launchers_default_is_told_from_a_users_choice(tmp_path, monkeypatch, argv, environ, expected):
    proc = fake_parent(tmp_path, monkeypatch, argv, environ)
    assert cpu_threads.launcher_set_default(proc) is expected


def test_unreadable_parent_keeps_the_value(tmp_path):
    assert cpu_threads.launcher_set_default(tmp_path) is False


def test_launcher_default_takes_cores_per_process_and_says_so(monkeypatch, caplog):
    set_to: list[int] = []
    monkeypatch.setattr(cpu_threads, "machine_cores", lambda: 8)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with caplog.at_level(logging.INFO, logger="fv_accel.cpu_threads"):
        cpu_threads.use_cpu_cores(ACC1, launcher_default=True)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        cpu_threads.use_cpu_cores(SimpleNamespace(device=torch.device("cpu"), num_processes=4, is_main_process=False),
                                  launcher_default=True)
    assert set_to == [8, 4]
    # Only the main process logs, once.
    assert [r.getMessage() for r in caplog.records] == [
        f"accelerate launch set OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')} (no thread option given): "
        "each process computes on 8 threads (8 cores / 1 processes); OMP_NUM_THREADS or "
        "--num_cpu_threads_per_process sets another number"
    ]


def test_a_users_single_thread_is_kept_and_reported(monkeypatch, caplog):
    set_to: list[int] = []
    monkeypatch.setattr(cpu_threads, "machine_cores", lambda: 4)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    with caplog.at_level(logging.WARNING, logger="fv_accel.cpu_threads"):
        cpu_threads.use_cpu_cores(ACC1, launcher_default=False)
    assert set_to == []
    assert [r.getMessage() for r in caplog.records] == [
        "torch computes on 1 CPU thread (OMP_NUM_THREADS=1) on a machine with 4 cores: "
        "`accelerate launch --num_cpu_threads_per_process 4 ...` or OMP_NUM_THREADS=4 uses them all"
    ]
    caplog.clear()
    # Several processes share the cores; a process with more threads, or a one-core machine: silent.
    for acc, threads, cores in ((SimpleNamespace(device=torch.device("cpu"), num_processes=2), 1, 4), (ACC1, 2, 4), (ACC1, 1, 1)):
        monkeypatch.setattr(torch, "get_num_threads", lambda t=threads: t)
        monkeypatch.setattr(cpu_threads, "machine_cores", lambda c=cores: c)
        cpu_threads.use_cpu_cores(acc, launcher_default=False)
    assert caplog.records == [] and set_to == []


def test_accelerate_launch_without_a_thread_option_computes_on_every_core(tmp_path):
    """The real launcher, no thread option: the process starts on its one-thread default and computes on
    the machine's cores after use_cpu_cores."""
    script = tmp_path / "threads.py"
    script.write_text(textwrap.dedent(
        """
        import os, types, torch
        from fv_accel import cpu_threads
        before = torch.get_num_threads()
        cpu_threads.use_cpu_cores(types.SimpleNamespace(device=torch.device("cpu"), num_processes=1, is_main_process=True))
        print("THREADS", os.environ.get("OMP_NUM_THREADS"), before, torch.get_num_threads(), cpu_threads.machine_cores())
        """
    ))
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    accelerate = Path(sys.executable).with_name("accelerate")
    out = subprocess.run(
        [str(accelerate), "launch", "--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no",
         "--dynamo_backend", "no", str(script)],
        env=env, capture_output=True, text=True, timeout=120, check=True,
    ).stdout
    line = next(l for l in out.splitlines() if l.startswith("THREADS"))
    _, omp, before, after, cores = line.split()
    assert (omp, before) == ("1", "1")
    assert int(after) == int(cores)
