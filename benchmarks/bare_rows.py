"""Does the bare loop's data change its step time? The bare LoRA loop of step_overhead.py (small size)
on one batch kept in memory against the same loop taking the benchmark dataset's 8 rows in turn (all
kept in memory), interleaved in one process; CPU time of the process per step.

    python benchmarks/bare_rows.py --rounds 10

Prints each round's mean step CPU time of both and their ratio (rows in turn / one batch), then the
median ratio. No file is written: the numbers go to the console.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
import torch  # noqa: E402


def main(argv: list[str] | None = None) -> list[float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=3, help="steps of each loop per round")
    p.add_argument("--full", action="store_true", help="full fine-tuning instead of LoRA")
    args = p.parse_args(argv)
    from fv_accel.config import load_config

    size = C.bench_size("small")
    data_path, _ = C.prepare_dataset(C.WORK_DIR, size, 8)
    overrides = {"training.data.data_path": data_path, "models.student.lora.enable": not args.full}
    cfg = load_config(size.recipe, overrides)
    batches = C.epoch_batches(data_path, cfg)
    loop = C.BareLoop(cfg, batches, torch.device("cpu"), "no", lora=not args.full)
    all_rows, one = loop.data, loop.data[:1]

    def mean_step(data: list) -> float:
        loop.data = data
        spent = []
        for _ in range(args.steps):
            t = time.process_time()
            loop.step()
            spent.append(time.process_time() - t)
        return sum(spent) / len(spent)

    mean_step(one), mean_step(all_rows)  # warm-up
    ratios = []
    for r in range(args.rounds):
        if r % 2:
            rows, single = mean_step(all_rows), mean_step(one)
        else:
            single, rows = mean_step(one), mean_step(all_rows)
        ratios.append(rows / single)
        print(f"round {r + 1}/{args.rounds}: one batch {single:.3f} s, rows in turn {rows:.3f} s, ratio {ratios[-1]:.3f}", flush=True)
    print(f"rows in turn / one batch, CPU time per step: median {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f}, mean {statistics.fmean(ratios):.3f}) over {len(ratios)} rounds")
    return ratios


if __name__ == "__main__":
    main()
