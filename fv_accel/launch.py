"""`python -m fv_accel.launch [accelerate launch options] SCRIPT [script options]`: `accelerate launch`
for preemptible jobs. It takes the same arguments and runs Accelerate's launcher in this process,
with one difference: SIGTERM (a preemption notice, SLURM's signal, `kill`) is relayed to the
training processes instead of ending the launch.

Under plain `accelerate launch` a SIGTERM to the launcher ends the launch: the multi-process
launcher (torch's elastic agent) relays it to the training processes, kills them
TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds later (30 by default) and exits 143 (128 + SIGTERM) even when
they saved a checkpoint and exited 0; the single-process launcher exits 143 and kills its child 5 s
after relaying. Here the launcher's SIGTERM handler is this module's: it sends SIGTERM to the
launcher's child processes (the training processes: they finish the step, save a checkpoint and
exit 0; see fv_accel.trainer) and the launcher goes on waiting for them as usual, so the launch
exits with their status: 0 after a clean stop. The handlers Accelerate's and torch's launchers
install for SIGTERM are not installed (they would end the launch); their other signals (Ctrl-C
included) keep their usual effect.

A training process that fails ends the launch with its exit status (2 for an input error, 1 for a
stop, 3 for a failed push), after its one `error:` line and nothing more: plain `accelerate launch`
adds its own traceback (a CalledProcessError that repeats the line, for one process; torch's
ChildFailedError and its failure table, for several), which is left out here. A process killed by
a signal gets one line naming its rank and the signal. FV_ACCEL_TRACEBACK=1 keeps the launcher's
traceback.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any, Optional

RELAYED = signal.SIGTERM


def relay_to_children(signum: int, frame: Any = None) -> None:
    """Send `signum` to this process's children (the launcher's training processes)."""
    import psutil

    sent = 0
    for child in psutil.Process().children():
        try:
            child.send_signal(signum)
            sent += 1
        except psutil.NoSuchProcess:
            pass
    name = signal.Signals(signum).name
    os.write(2, f"fv_accel.launch: {name} relayed to {sent} training process(es)\n".encode())


def keep_relay_for_sigterm() -> None:
    """Install the relay for SIGTERM and keep it: a later `signal.signal(SIGTERM, ...)` in this
    process (Accelerate's single-process launcher, torch's elastic agent) leaves it in place and
    gets it back as the handler in effect."""
    real_signal = signal.signal
    real_signal(RELAYED, relay_to_children)

    def install(signum: int, handler: Any) -> Any:
        if signum == RELAYED:
            return relay_to_children
        return real_signal(signum, handler)

    signal.signal = install


# Exit statuses of the entry scripts whose reason they have already said in their `error:` line.
EXPLAINED_EXIT_CODES = (1, 2, 3)


def training_exit_status(err: BaseException) -> Optional[int]:
    """The exit status of the failed training process behind a launcher's exception (the first to
    fail), or None for another exception. A process ended by a signal is named in one line."""
    import subprocess

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if isinstance(err, subprocess.CalledProcessError):
        code = err.returncode
        rank = 0
    elif isinstance(err, ChildFailedError):
        rank, failure = err.get_first_failure()
        code = failure.exitcode
    else:
        return None
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        os.write(2, f"fv_accel.launch: training process of rank {rank} was ended by {name}\n".encode())
        return 128 - code
    if code not in EXPLAINED_EXIT_CODES:
        os.write(2, f"fv_accel.launch: training process of rank {rank} exited with status {code}\n".encode())
    return code


class _DropExplainedFailure:
    """A logging filter for torch's elastic agent: its `failed (exitcode: N)` line for a process
    that has said why it failed."""

    def filter(self, record) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (str(record.msg).startswith("failed (exitcode") and args and args[0] in EXPLAINED_EXIT_CODES)


def main(argv: Optional[list[str]] = None) -> None:
    import logging

    from accelerate.commands.launch import launch_command, launch_command_parser

    from fv_accel.process import traceback_wanted

    args = launch_command_parser().parse_args(sys.argv[1:] if argv is None else argv)
    keep_relay_for_sigterm()
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_DropExplainedFailure())
    try:
        launch_command(args)
    except Exception as err:
        code = None if traceback_wanted() else training_exit_status(err)
        if code is None:
            raise
        sys.exit(code)


if __name__ == "__main__":
    main()
