"""Is the data ever the bottleneck? Samples/s of the training loader (fv_accel.data.loader,
build_train_loader) on a preprocessed dataset in FastVideo's Parquet schema, against the rate at
which the model consumes samples (our SFT step through the real Trainer).

    python benchmarks/data_throughput.py             # small size
    python benchmarks/data_throughput.py --quick     # tiny size, a few batches (smoke test)
    python benchmarks/data_throughput.py --num-workers 2

Interleaved rounds: a burst of `--batches` loader batches, then `--steps` training steps, so that a
slow spell of a shared machine hits both. Per round: loader samples/s over model samples/s. The
Trainer's own `data_wait` (time a step waited for its batch) is reported beside it.
Target: the loader is at least 20x faster than the model consumes.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

TARGET = 20.0


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    from fv_accel.process import DefaultsHelpFormatter

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    p.add_argument("--size", default="small", choices=sorted(C.SIZE_RECIPES))
    p.add_argument("--rows", type=int, default=32, help="rows of the generated dataset")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--batches", type=int, default=32, help="loader batches per round")
    p.add_argument("--steps", type=int, default=2, help="training steps per round")
    p.add_argument("--num-workers", type=int, default=None, help="loader worker processes (default: the recipe's)")
    p.add_argument("--no-model", action="store_true", help="loader only (e.g. the wan_1_3b shape on a CPU machine)")
    p.add_argument("--quick", action="store_true", help="tiny size, 2 short rounds: a smoke test")
    p.add_argument("--out", type=Path, default=C.RESULTS_DIR)
    p.add_argument("--name", default="data_throughput", help="base name of the result files")
    p.add_argument("--work-dir", type=Path, default=C.WORK_DIR)
    args = p.parse_args(argv)
    if args.quick:
        args.size, args.rows, args.rounds, args.batches, args.steps = "tiny", 8, 2, 8, 2
    return args


def main(argv: Optional[list[str]] = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    from fv_accel.config import load_config
    from fv_accel.data.loader import build_train_loader

    machine = C.machine_info()
    size = C.bench_size(args.size)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    data_path, data_kind = C.prepare_dataset(args.work_dir, size, args.rows)
    extra = {} if args.num_workers is None else {"training.data.dataloader_num_workers": args.num_workers}
    # The rate of reading rows from the files: no row comes from the in-memory data cache.
    extra["training.data.cache_gb"] = 0
    loader_rates, model_rates, ratios = [], [], []
    with tempfile.TemporaryDirectory(dir=args.work_dir, prefix="data_throughput-") as scratch:
        overrides = C.bench_overrides(Path(scratch) / "sft", data_path, "finetune", **extra)
        ours = None if args.no_model else C.OursRunner(size.recipe, overrides)
        cfg = load_config(size.recipe, overrides) if ours is None else ours.run.config
        loader = build_train_loader(cfg, world_size=1, rank=0, data_path=data_path)
        batches = iter(loader)
        next(batches)  # warm-up: worker start, first file read
        if ours is not None:
            ours.steps(1)
        for r in range(args.rounds):
            t0 = time.perf_counter()
            samples = 0
            for _ in range(args.batches):
                samples += next(batches)["vae_latent"].shape[0]
            loader_rate = samples / (time.perf_counter() - t0)
            loader_rates.append(loader_rate)
            if ours is None:
                print(f"[data] round {r + 1}/{args.rounds}: loader {loader_rate:.1f} samples/s", flush=True)
                continue
            step_times = ours.steps(args.steps)
            model_rate = size.batch_size * len(step_times) / sum(t.wall for t in step_times)
            model_rates.append(model_rate)
            ratios.append(loader_rate / model_rate)
            print(
                f"[data] round {r + 1}/{args.rounds}: loader {loader_rate:.1f} samples/s, model {model_rate:.3f} "
                f"samples/s, ratio {ratios[-1]:.1f}",
                flush=True,
            )
        history = ours.history[1:] if ours is not None else []
        waits = [h["data_wait"] for h in history]
        wait_share = [h["data_wait"] / h["step_time"] for h in history]
        num_workers = cfg.training.data.dataloader_num_workers
        del ours, loader, batches
    C.reset_accelerate_state()
    sample_mb = (4 * (size.latent_shape[0] * size.latent_shape[1] * size.latent_shape[2] * size.latent_shape[3])
                 + 4 * size.text_shape[0] * size.text_shape[1]) / 2**20
    payload = {
        "benchmark": "data_throughput",
        "command": C.command_line("data_throughput.py", argv),
        "machine": machine,
        "size": size.name,
        "latent_shape": list(size.latent_shape),
        "text_shape": list(size.text_shape),
        "stored_dtype": "float32",
        "sample_mb": sample_mb,
        "batch_size": size.batch_size,
        "num_workers": num_workers,
        "data": data_kind,
        "rows": args.rows,
        "loader_samples_per_s": C.summarize(loader_rates),
        "model_samples_per_s": C.summarize(model_rates),
        "ratio_loader_over_model": C.summarize(ratios),
        "trainer_data_wait_s": C.summarize(waits),
        "trainer_data_wait_share_of_step": C.summarize(wait_share),
        "target_ratio": TARGET,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    C.publish_results(args.out, args.name, payload, to_markdown(payload))
    return payload


def to_markdown(p: dict) -> str:
    ratio = p["ratio_loader_over_model"]
    verdict = "met" if ratio["median"] >= p["target_ratio"] else "MISSED"
    if ratio["n"] == 0:
        verdict = "not measured (--no-model)"
    rows = [[
        f"{p['size']} ({'x'.join(map(str, p['latent_shape']))} latent + {p['text_shape'][0]}x{p['text_shape'][1]} text, "
        f"{p['sample_mb']:.1f} MB/sample fp32)",
        p["num_workers"],
        C.fmt_mmm(p["loader_samples_per_s"], 1),
        C.fmt_mmm(p["model_samples_per_s"], 3) if ratio["n"] else "-",
        C.fmt_mmm(ratio, 1) if ratio["n"] else "-",
        f"{p['trainer_data_wait_share_of_step']['median'] * 100:.2f}%" if ratio["n"] else "-",
    ]]
    header = ["dataset", "workers", "loader samples/s", "model samples/s", "loader / model", "step time waiting for data"]
    return "\n".join([
        "# Data throughput: training loader vs model",
        "",
        f"Machine: {C.machine_line(p['machine'])}.",
        f"Command: `{p['command']}`",
        "",
        "Median (min-max) over the interleaved rounds.",
        "",
        C.markdown_table(header, rows),
        "",
        f"- loader / model = {ratio['median']:.1f} (target >= {p['target_ratio']:.0f}): {verdict}"
        if ratio["n"] else f"- loader / model: {verdict}",
    ])


if __name__ == "__main__":
    main()
