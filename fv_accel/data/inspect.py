"""What a latent dataset holds, opened as training opens it (`LatentDataset`: footers and shape
columns, nothing copied); writes nothing.

    python -m fv_accel.data.inspect PATH [--batch_size B --num_processes P --grad_accum A]

Prints rows, files, row groups, bytes, dtypes, (T, H, W) buckets with their counts, whether the
latent statistics are recorded (fv_dataset.json), the rows no step can take at B x P x A samples a
step, and the open time. Exit status 2 with one `error: ...` line when the dataset cannot be opened.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from typing import Optional

_STARTED = time.perf_counter()


def _process_age() -> Optional[float]:
    """Seconds since this process started (Linux), imports included; None elsewhere."""
    try:
        import os

        start_ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
        uptime = float(open("/proc/uptime").read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def report(path: str, *, batch_size: int = 1, num_processes: int = 1, grad_accum: int = 1) -> list[str]:
    from pathlib import Path

    import fv_accel.data.parquet_rows  # noqa: F401  (imported here so that the open time is the open's)
    from fv_accel.data.checks import BYTE_CHECK_LIMIT, byte_lengths_checked_at_open
    from fv_accel.data.loader import LatentDataset
    from fv_accel.data.schema import read_dataset_info

    t0 = time.perf_counter()
    ds = LatentDataset(path)
    opened = time.perf_counter() - t0
    rows = ds.rows
    lines = [f"dataset: {path}"]
    groups = sum(len(s) - 1 for s in rows.row_group_starts)
    lines.append(f"rows: {len(ds)} in {len(ds.files)} Parquet file(s), {groups} row group(s)")
    on_disk = sum(Path(f).stat().st_size for f in ds.files)
    latent_bytes = rows.column_bytes.get("vae_latent_bytes", 0)
    text_bytes = rows.column_bytes.get("text_embedding_bytes", 0)
    lines.append(
        f"bytes: {_size(on_disk)} in the files; {_size(latent_bytes)} of latents and {_size(text_bytes)} of text "
        "embeddings (uncompressed, from the footers)"
    )
    lines.append(
        "byte lengths: checked at open" if byte_lengths_checked_at_open(ds)
        else f"byte lengths: checked when each row is read (the dataset is over {_size(BYTE_CHECK_LIMIT)})"
    )
    tensors = [c[: -len("_bytes")] for c in rows.column_names if c.endswith("_bytes")]
    lines.append(f"tensor columns: {', '.join(tensors)}")
    if ds.text_only:
        lines.append("text-only dataset (preprocessed_data_type text_only): prompts without video latents")
    lines.append("dtypes:")
    for name in ("text_embedding",) if ds.text_only else ("vae_latent", "text_embedding"):
        counts = Counter(rows.columns[f"{name}_dtype"])
        lines.append(f"  {name}: " + ", ".join(f"{d} x {n}" for d, n in counts.most_common()))
    channels = sorted({s[0] for s in ds.latent_shapes})
    widths = sorted({s[-1] for s in ds.text_shapes})
    lines.append(f"latent channels: {', '.join(map(str, channels))}; text width: {', '.join(map(str, widths))}")
    buckets = Counter(ds.bucket_key(i) for i in range(len(ds)))
    lines.append(f"buckets (latent T, H, W): {len(buckets)}")
    for key, n in sorted(buckets.items()):
        lines.append(f"  {key}: {n} row(s)")
    info = read_dataset_info(path)
    mean = info.get("latents_mean")
    if mean and info.get("latents_std"):
        lines.append(f"latent statistics: found in fv_dataset.json ({len(mean)} channels)")
    else:
        why = "no fv_dataset.json" if not info else "fv_dataset.json records none"
        lines.append(
            f"latent statistics: missing ({why}; set models.student.latents_mean / latents_std, or "
            "models.student.init_from a model whose VAE has them)"
        )
    group = batch_size * num_processes * grad_accum
    small = {k: n for k, n in buckets.items() if n < group}
    listed = f" (bucket(s) {', '.join(str(k) for k in sorted(small))})" if small else ""
    lines.append(
        f"rows no step can take at batch {batch_size} x {num_processes} processes x {grad_accum} accumulation "
        f"({group} a step): {sum(small.values())}{listed}"
    )
    lines.append(f"rows left out each epoch (bucket remainders): {sum(n % group for n in buckets.values() if n >= group)}")
    lines.append(f"steps per epoch: {sum(n // group for n in buckets.values())}")
    age = _process_age()
    since = age if age is not None else time.perf_counter() - _STARTED
    lines.append(f"open time: {opened:.3f} s ({since:.2f} s since the command started, imports included)")
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    from fv_accel.process import DefaultsHelpFormatter

    p = argparse.ArgumentParser(
        prog="python -m fv_accel.data.inspect", description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter
    )
    p.add_argument("path", help="a dataset folder or one Parquet file")
    p.add_argument("--batch_size", type=int, default=1, help="training.data.train_batch_size")
    p.add_argument("--num_processes", type=int, default=1, help="training processes (GPUs)")
    p.add_argument("--grad_accum", type=int, default=1, help="training.loop.gradient_accumulation_steps")
    args = p.parse_args(argv)
    for name in ("batch_size", "num_processes", "grad_accum"):
        if getattr(args, name) < 1:
            print(f"error: --{name}: expected an integer >= 1, got {getattr(args, name)}", file=sys.stderr)
            return 2
    try:
        lines = report(args.path, batch_size=args.batch_size, num_processes=args.num_processes, grad_accum=args.grad_accum)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
