"""Helpers for tests that start real `accelerate launch` runs: a free port, and on a hang
the evidence (each process's signal state and Python stacks, the log) before the tree is killed."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path


# Accelerate (1.16) takes port 0 as "pick a free one" and picks it just before it starts the
# processes: each launch gets its own rendezvous store, so a run left over from an earlier test,
# another test run or another job on the machine holding the default 29500 cannot collide with it.
ANY_FREE_PORT = ("--main_process_port", "0")


def _signal_state(pid: int) -> str:
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
        wchan = Path(f"/proc/{pid}/wchan").read_text()
    except OSError as err:
        return f"(no /proc state: {err})"
    keep = ("State", "Threads", "SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")
    return " ".join(line.replace("\t", "") for line in lines if line.startswith(keep)) + f" wchan:{wchan}"


def thread_signal_masks(pid: int) -> list[tuple[int, str, int]]:
    """(thread id, thread name, blocked-signal mask) of every thread of a process (Linux /proc);
    the main thread's id is the pid."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            status = (task / "status").read_text().splitlines()
        except OSError:  # the thread ended meanwhile
            continue
        mask = next(line.split()[1] for line in status if line.startswith("SigBlk:"))
        out.append((int(task.name), name, int(mask, 16)))
    return out


def wait_or_diagnose(launcher: subprocess.Popen, timeout: float, log_path: Path) -> int:
    """`launcher.wait(timeout)`; on a timeout, ask every descendant for its stacks (the trainer
    dumps them on SIGUSR1), kill the whole tree and fail with what was seen."""
    import psutil
    import pytest

    try:
        return launcher.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    procs = psutil.Process(launcher.pid).children(recursive=True)
    states = [f"pid {p.pid} {' '.join(p.cmdline())[:120]}: {_signal_state(p.pid)}" for p in procs]
    for p in procs:
        try:
            p.send_signal(signal.SIGUSR1)
        except psutil.NoSuchProcess:
            pass
    time.sleep(2)
    kill_tree(launcher)
    pytest.fail(
        f"the launched run did not exit within {timeout:.0f} s; processes:\n" + "\n".join(states)
        + f"\nlog tail ({log_path}):\n" + log_path.read_text(errors="replace")[-8000:]
    )


def kill_tree(launcher: subprocess.Popen) -> None:
    import psutil

    try:
        procs = [psutil.Process(launcher.pid), *psutil.Process(launcher.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)
