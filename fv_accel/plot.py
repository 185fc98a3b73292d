"""Plots of a run from its logs, for people who would rather look than read.

    python -m fv_accel.plot OUTPUT_DIR [--out DIR]

reads `OUTPUT_DIR/logs/metrics.jsonl` (written by the trainer) and writes PNG files into
`OUTPUT_DIR/plots/` (or `--out`):

- `loss.png`: the training loss (raw and smoothed), the learning rate and the gradient norm;
- `heldout_loss.png`: the held-out loss per sigma bucket (and per chunk pattern for DFSFT), with
  the mean over buckets in bold;
- `throughput.png`: samples/s and latent tokens/s, step time and data wait, and memory;
- `reward.png` (reward training): the held-out prompts' reward per reward, beside the reference's,
  over the training samples' reward, and the KL term to the reference: reward hacking shows as a
  reward that climbs while the KL runs away.

A figure whose data is absent (no held-out loss in the run, say) is not drawn.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Optional, Sequence

Series = dict[str, tuple[list[int], list[float]]]


def read_metrics(output_dir: str | Path) -> Series:
    """Each key's (steps, values) from metrics.jsonl; a step logged twice (a resumed run) keeps
    its last value."""
    path = Path(output_dir) / "logs" / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics log (is '{output_dir}' a run's output_dir?)")
    by_key: dict[str, dict[int, float]] = {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{path}: line {n} is not valid JSON") from None
        step = int(row.get("step", 0))
        for key, value in row.items():
            if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            by_key.setdefault(key, {})[step] = float(value)
    return {k: (sorted(v), [v[s] for s in sorted(v)]) for k, v in by_key.items()}


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving average over `window` points (NaNs ignored)."""
    out = []
    for i in range(len(values)):
        part = [v for v in values[max(0, i - window + 1) : i + 1] if not math.isnan(v)]
        out.append(sum(part) / len(part) if part else math.nan)
    return out


def _figure(rows: int):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(rows, 1, figsize=(8, 2.8 * rows), sharex=True, squeeze=False)
    return plt, fig, [a[0] for a in axes]


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_loss(series: Series, out: Path) -> Optional[Path]:
    if "loss" not in series:
        return None
    panels = [k for k in ("lr", "grad_norm") if k in series]
    plt, fig, axes = _figure(1 + len(panels))
    steps, values = series["loss"]
    window = max(1, len(values) // 20)
    axes[0].plot(steps, values, color="tab:blue", alpha=0.3, linewidth=0.8, label="loss")
    axes[0].plot(steps, smooth(values, window), color="tab:blue", linewidth=1.8, label=f"loss (mean of {window})")
    if "heldout/loss" in series:
        axes[0].plot(*series["heldout/loss"], "o-", color="tab:red", linewidth=1.5, label="held-out loss")
    axes[0].set_ylabel("loss")
    axes[0].legend(loc="upper right", fontsize=8)
    axes[0].grid(alpha=0.3)
    for ax, key in zip(axes[1:], panels):
        ax.plot(*series[key], color="tab:gray", linewidth=1.0)
        ax.set_ylabel(key.replace("_", " "))
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    return _save(plt, fig, out / "loss.png")


def plot_heldout(series: Series, out: Path) -> Optional[Path]:
    buckets = sorted(k for k in series if k.startswith("heldout/sigma_"))
    patterns = sorted(k for k in series if k.startswith("heldout/chunks_"))
    if not buckets:
        return None
    plt, fig, axes = _figure(2 if patterns else 1)
    cmap = plt.get_cmap("viridis")
    for i, key in enumerate(buckets):
        color = cmap(i / max(1, len(buckets) - 1))
        axes[0].plot(*series[key], "o-", color=color, markersize=3, label="sigma " + key.rsplit("_", 1)[1])
    if "heldout/loss" in series:
        axes[0].plot(*series["heldout/loss"], "o-", color="black", linewidth=2.2, label="mean over buckets")
    if "heldout/dense_loss" in series:  # VSA runs: the dense view of the same weights
        axes[0].plot(*series["heldout/dense_loss"], "s--", color="tab:red", linewidth=1.5, label="mean, dense view (VSA)")
    axes[0].set_ylabel("held-out loss")
    axes[0].set_yscale("log")
    axes[0].legend(loc="upper right", fontsize=7, ncol=2)
    axes[0].grid(alpha=0.3, which="both")
    if patterns:
        for key in patterns:
            axes[1].plot(*series[key], "o-", markersize=3, label=key.split("/", 1)[1].replace("chunks_", ""))
        axes[1].set_ylabel("held-out loss\nper chunk pattern")
        axes[1].legend(loc="upper right", fontsize=7)
        axes[1].grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    return _save(plt, fig, out / "heldout_loss.png")


def plot_throughput(series: Series, out: Path) -> Optional[Path]:
    """samples/s, latent tokens/s (each on its own axis: at a fixed clip size one is a multiple of
    the other, and a shared or twin axis draws them over each other), step time and data wait,
    and memory."""
    if "samples_per_s" not in series:
        return None
    memory = [k for k in ("peak_mem_gb", "peak_reserved_gb", "cpu_rss_gb") if k in series]
    tokens = "latent_tokens_per_s" in series
    plt, fig, axes = _figure(2 + int(tokens) + int(bool(memory)))
    ax = axes[0]
    ax.plot(*series["samples_per_s"], color="tab:green", linewidth=1.0, label="samples/s")
    ax.set_ylabel("samples/s")
    ax.grid(alpha=0.3)
    if "mfu" in series:
        steps, values = series["mfu"]
        ax.set_title(f"estimated MFU: median {sorted(values)[len(values) // 2] * 100:.1f}%", fontsize=9)
    row = 1
    if tokens:
        axes[row].plot(*series["latent_tokens_per_s"], color="tab:purple", linewidth=1.0)
        axes[row].set_ylabel("latent tokens/s")
        axes[row].grid(alpha=0.3)
        row += 1
    for key, color in (("step_time", "tab:orange"), ("data_wait", "tab:brown")):
        if key in series:
            axes[row].plot(*series[key], color=color, linewidth=1.0, label=key.replace("_", " ") + " (s)")
    axes[row].set_ylabel("seconds")
    axes[row].legend(loc="upper right", fontsize=8)
    axes[row].grid(alpha=0.3)
    if memory:
        for key in memory:
            axes[row + 1].plot(*series[key], linewidth=1.0, label=key.replace("_gb", "").replace("_", " "))
        axes[row + 1].set_ylabel("GiB")
        axes[row + 1].legend(loc="upper right", fontsize=8)
        axes[row + 1].grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    return _save(plt, fig, out / "throughput.png")


def plot_reward(series: Series, out: Path) -> Optional[Path]:
    held = sorted(k for k in series if k.startswith("validation/reward/") and not k.endswith("_std"))
    trained = sorted(k for k in series if k.startswith("reward/") and not k.endswith("_std") and k != "reward/dropped")
    if len(held) == 2:  # one reward: its weighted sum `avg` is the same curve
        held = [k for k in held if not k.endswith("/avg")]
    if len(trained) == 2:
        trained = [k for k in trained if not k.endswith("/avg")]
    if not held and not trained:
        return None
    plt, fig, axes = _figure(2)
    for key in trained:
        steps, values = series[key]
        axes[0].plot(steps, values, color="0.6", linewidth=0.8, label=f"training samples' {key.split('/', 1)[1]}")
    for key in held:
        axes[0].plot(*series[key], "o-", markersize=3, label="held-out " + key.split("/", 2)[2])
        ref = key.replace("validation/reward/", "validation/reference/reward/")
        if ref in series:
            axes[0].axhline(series[ref][1][-1], linestyle="--", color="black", linewidth=1.0,
                            label="reference's held-out " + key.split("/", 2)[2])
    axes[0].set_ylabel("reward")
    axes[0].legend(loc="lower right", fontsize=7)
    axes[0].grid(alpha=0.3)
    if "kl_div_loss" in series:
        axes[1].plot(*series["kl_div_loss"], color="tab:red", linewidth=1.0, label="KL term to the reference")
        axes[1].set_yscale("log")
        axes[1].legend(loc="upper left", fontsize=8)
    axes[1].set_ylabel("||v - v_ref||^2")
    axes[1].grid(alpha=0.3, which="both")
    axes[-1].set_xlabel("step")
    return _save(plt, fig, out / "reward.png")


def write_plots(output_dir: str | Path, out_dir: Optional[str | Path] = None) -> list[Path]:
    """Draw every figure the logs allow; returns the PNG paths written."""
    series = read_metrics(output_dir)
    out = Path(out_dir) if out_dir is not None else Path(output_dir) / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written = [plot(series, out) for plot in (plot_loss, plot_heldout, plot_throughput, plot_reward)]
    return [p for p in written if p is not None]


def log_png_images(accelerator, images: dict[str, Path], step: int) -> None:
    """PNG files to the run's trackers as images, by name: W&B as wandb.Image, TensorBoard as an
    image summary of the file's pixels."""
    for tracker in getattr(accelerator, "trackers", []):
        if tracker.name == "wandb":
            import wandb

            tracker.run.log({name: wandb.Image(str(path)) for name, path in images.items()}, step=step)
        elif tracker.name == "tensorboard":
            import numpy as np
            from PIL import Image

            for name, path in images.items():
                with Image.open(path) as image:
                    pixels = np.asarray(image.convert("RGB"))
                tracker.writer.add_image(name, pixels, step, dataformats="HWC")
            tracker.writer.flush()


def main(argv: Optional[list[str]] = None) -> int:
    from fv_accel.process import DefaultsHelpFormatter

    parser = argparse.ArgumentParser(
        prog="python -m fv_accel.plot", description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter
    )
    parser.add_argument("output_dir", help="a run's output_dir (holding logs/metrics.jsonl)")
    parser.add_argument("--out", default=None, help="folder for the PNGs (default: OUTPUT_DIR/plots)")
    args = parser.parse_args(argv)
    try:
        written = write_plots(args.output_dir, args.out)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not written:
        print(f"error: {args.output_dir}: the metrics log holds nothing to plot", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
