"""The warning for a lone CPU process computing on one thread (accelerate launch's default)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from fv_accel import build


def test_one_thread_on_a_multicore_cpu_is_reported_once_per_run(monkeypatch, caplog):
    acc = SimpleNamespace(device=torch.device("cpu"), num_processes=1)
    monkeypatch.setattr(build.os, "cpu_count", lambda: 4)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    with caplog.at_level(logging.WARNING, logger="fv_accel.build"):
        build.warn_single_cpu_thread(acc)
    assert [r.getMessage() for r in caplog.records] == [
        "torch computes on 1 CPU thread (OMP_NUM_THREADS=1) on a machine with 4 cores: "
        "`accelerate launch --num_cpu_threads_per_process 4 ...` or OMP_NUM_THREADS=4 uses them all"
    ]
    caplog.clear()
    # Several processes share the cores; a process with more threads, or a one-core machine: silent.
    for acc2, threads, cores in ((SimpleNamespace(device=torch.device("cpu"), num_processes=2), 1, 4), (acc, 2, 4), (acc, 1, 1)):
        monkeypatch.setattr(torch, "get_num_threads", lambda t=threads: t)
        monkeypatch.setattr(build.os, "cpu_count", lambda c=cores: c)
        build.warn_single_cpu_thread(acc2)
    assert caplog.records == []
