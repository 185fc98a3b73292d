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


def main(argv: Optional[list[str]] = None) -> None:
    from accelerate.commands.launch import launch_command, launch_command_parser

    args = launch_command_parser().parse_args(sys.argv[1:] if argv is None else argv)
    keep_relay_for_sigterm()
    launch_command(args)


if __name__ == "__main__":
    main()
