"""How many CPU threads a training process computes on.

`accelerate launch` sets OMP_NUM_THREADS for the processes it starts: to the value the user gave
(`--num_cpu_threads_per_process`, or OMP_NUM_THREADS in the launching shell), and otherwise to 1
(with `--cpu` it computes a value itself). A CPU run launched with no thread option then computes
on one thread whatever the machine has. Where the launcher set that default, the process uses
cores / local processes threads instead and says so once; a value the user set is kept (one thread
on a machine with more cores gets a warning that names the option).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Optional

import torch

logger = logging.getLogger(__name__)

THREAD_OPTION = "--num_cpu_threads_per_process"


def machine_cores() -> int:
    """The cores this process may run on (its affinity where the platform says, else the count)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _read_nul_list(path: Path) -> Optional[list[str]]:
    try:
        return [part.decode(errors="replace") for part in path.read_bytes().split(b"\0") if part]
    except OSError:
        return None


def _is_accelerate_launch(argv: list[str]) -> bool:
    """`accelerate launch ...`, `python -m accelerate.commands.launch ...` or `python -m fv_accel.launch ...`
    (which runs Accelerate's launcher in its own process)."""
    names = [Path(a).name for a in argv[:4]]
    if "accelerate" in names and "launch" in names:
        return True
    return any(a in ("accelerate.commands.launch", "fv_accel.launch") for a in argv[:3])


def launcher_set_default(proc: Path = Path("/proc")) -> bool:
    """True where this process's parent is `accelerate launch`, started with neither
    `--num_cpu_threads_per_process` nor OMP_NUM_THREADS: the OMP_NUM_THREADS this process has is
    then the launcher's default, not the user's. Read from the parent's command line and starting
    environment (/proc); where those cannot be read, False (the value is kept)."""
    parent = proc / str(os.getppid())
    argv = _read_nul_list(parent / "cmdline")
    environ = _read_nul_list(parent / "environ")
    if not argv or environ is None:
        return False
    if not _is_accelerate_launch(argv):
        return False
    if any(a == THREAD_OPTION or a.startswith(THREAD_OPTION + "=") for a in argv):
        return False
    return not any(e.startswith("OMP_NUM_THREADS=") for e in environ)


def local_processes(acc: Any) -> int:
    """The training processes sharing this machine's cores."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local and local.isdigit() and int(local) > 0:
        return int(local)
    return max(1, int(getattr(acc, "num_processes", 1)))


def use_cpu_cores(acc: Any, *, launcher_default: Optional[bool] = None) -> None:
    """Give a CPU process cores / local processes threads where the launcher's default of one thread
    is in effect (logged once, by the main process); a value the user set is kept, and one thread on a
    multi-core machine with one process is reported with the option that changes it."""
    if acc.device.type != "cpu":
        return
    cores, processes = machine_cores(), local_processes(acc)
    threads = max(1, cores // processes)
    if launcher_default is None:
        launcher_default = launcher_set_default()
    if launcher_default and torch.get_num_threads() < threads:
        torch.set_num_threads(threads)
        if getattr(acc, "is_main_process", True):
            logger.info(
                "accelerate launch set OMP_NUM_THREADS=%s (no thread option given): each process computes on %d "
                "threads (%d cores / %d processes); OMP_NUM_THREADS or %s sets another number",
                os.environ.get("OMP_NUM_THREADS", "unset"), threads, cores, processes, THREAD_OPTION,
            )
        return
    if acc.num_processes == 1 and torch.get_num_threads() == 1 and cores > 1:
        logger.warning(
            "torch computes on 1 CPU thread (OMP_NUM_THREADS=%s) on a machine with %d cores: "
            "`accelerate launch %s %d ...` or OMP_NUM_THREADS=%d uses them all",
            os.environ.get("OMP_NUM_THREADS", "unset"), cores, THREAD_OPTION, cores, cores,
        )
