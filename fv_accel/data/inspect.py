"""What a latent dataset holds, opened as training opens it (`LatentDataset`: footers and shape
columns, nothing copied); writes nothing.

    python -m fv_accel.data.inspect PATH [--batch_size B --num_processes P --grad_accum A] [--check]

Prints rows, files, row groups, bytes, dtypes, (T, H, W) buckets with their counts, whether the
latent statistics are recorded (fv_dataset.json), the rows no step can take at B x P x A samples a
step, and the open time. Exit status 2 with one `error: ...` line when the dataset cannot be opened.

`--check` then reads every row once, one at a time, and lists the rows whose stored tensors cannot
be decoded, have the wrong shape or dtype, or hold NaN/inf (file, row, id), and the files that
cannot be read or lack the columns of the dataset's type (a text-only dataset has no latents):
exit status 1 if any row is at fault, else 2 when the dataset cannot be opened (its `error: ...`
line is not repeated).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from typing import Any, Iterator, Optional

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
    channels = ", ".join(str(c) for c in sorted({s[0] for s in ds.latent_shapes})) or "none (text-only)"
    widths = sorted({s[-1] for s in ds.text_shapes})
    lines.append(f"latent channels: {channels}; text width: {', '.join(map(str, widths))}")
    buckets = Counter(ds.bucket_key(i) for i in range(len(ds)))
    if ds.text_only:
        lines.append(f"buckets: 1 (text-only: all {len(ds)} row(s); the rollout's shape is the recipe's)")
    else:
        lines.append(f"buckets (latent T, H, W{', audio length' if ds.audio_lengths else ''}): {len(buckets)}")
        lines += [f"  {key}: {n} row(s)" for key, n in sorted(buckets.items())]
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


# Bytes read from a file at a time by the row check: with pre-buffering off, pyarrow reads the
# pages of the row being decoded, not its whole row group.
ROW_READ_BUFFER = 2**20


def row_problems(row: dict) -> list[str]:
    """What is wrong with one stored row: its latent's and text embedding's shapes, dtypes and byte
    lengths (fv_accel.data.checks.row_problem), then every tensor column decoded and checked for
    NaN/inf (and an image-to-video column against its layout). Empty when nothing is."""
    import torch

    from fv_accel.data.checks import row_problem
    from fv_accel.data.loader import CONDITIONING_LAYOUTS, conditioning_tensor
    from fv_accel.data.schema import read_tensor_column, tensor_column_names

    def stored(name: str) -> tuple:
        raw = row.get(f"{name}_bytes")
        return row.get(f"{name}_shape"), row.get(f"{name}_dtype"), None if raw is None else len(raw)

    latent = stored("vae_latent") if "vae_latent_bytes" in row else None  # none in a text-only row
    problem = row_problem(latent, stored("text_embedding"))
    if problem:
        return [problem]
    found = []
    for name in tensor_column_names():
        try:
            value = read_tensor_column(row, name)
            if value is not None and name in CONDITIONING_LAYOUTS:
                value = conditioning_tensor(name, value, tuple(int(v) for v in row["vae_latent_shape"]), "")
        except ValueError as err:
            found.append(str(err))
            continue
        if value is not None and value.is_floating_point():
            bad = int((~torch.isfinite(value)).sum())
            if bad:
                found.append(f"{name}: {bad} of {value.numel()} value(s) are NaN/inf")
    return found


def _file_rows(pf: Any, columns: list[str]) -> Iterator[dict]:
    """The rows of a Parquet file, one at a time: binary values as pyarrow buffers."""
    import pyarrow as pa

    for batch in pf.iter_batches(batch_size=1, columns=columns):
        row = {}
        for name in batch.schema.names:
            value = batch.column(name)[0]
            binary = pa.types.is_binary(value.type) or pa.types.is_large_binary(value.type)
            row[name] = (value.as_buffer() if value.is_valid else None) if binary else value.as_py()
        yield row


def check_rows(path: str) -> tuple[int, list[str], list[tuple[str, str]]]:
    """Every row of the dataset read once, one row at a time (pyarrow holds the pages being decoded,
    a few rows at most, never a row group or a file): (rows read, one line per row with problems,
    naming its file, row and id, and (file, problem) for each file that cannot be read or lacks
    columns). The columns required are those of the dataset's type, as the loader decides it from
    the first file: a text-only dataset's rows have no VAE latent."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from fv_accel.data.parquet_rows import unreadable
    from fv_accel.data.schema import (
        REQUIRED_COLUMNS,
        TEXT_EMBEDDING_COLUMNS,
        columns_are_text_only,
        local_dataset_path,
        parquet_files,
        tensor_column_names,
    )

    read, problems, file_problems = 0, [], []
    required = None
    for file in parquet_files(local_dataset_path(path)):
        try:
            pf = pq.ParquetFile(file, pre_buffer=False, buffer_size=ROW_READ_BUFFER)
            names = set(pf.schema_arrow.names)
            if required is None:
                required = TEXT_EMBEDDING_COLUMNS if columns_are_text_only(names) else REQUIRED_COLUMNS
            missing = [c for c in required if c not in names]
            if missing:
                file_problems.append((str(file), f"missing column(s) {', '.join(missing)}"))
                continue
            stored = [f"{name}_{part}" for name in tensor_column_names() for part in ("bytes", "shape", "dtype")]
            columns = [c for c in ("id", *stored) if c in names]
            for r, row in enumerate(_file_rows(pf, columns)):
                read += 1
                found = row_problems(row)
                if found:
                    ident = f" (id {row['id']!r})" if row.get("id") else ""
                    problems.append(f"{file} row {r}{ident}: {'; '.join(found)}")
        except (OSError, pa.ArrowException) as err:
            file_problems.append((str(file), str(unreadable(file, err))[len(str(file)) + 2 :]))
    return read, problems, file_problems


def _check(path: str, open_error: Optional[str]) -> int:
    """`--check`: the row check's lines. Exit status 1 for any problem when the dataset opened; when
    it did not (`open_error`, printed already), the files' problems that line said already are not
    repeated, and the status is 1 only for a row at fault, else 2."""
    try:
        read, row_lines, file_problems = check_rows(path)
    except (ValueError, FileNotFoundError) as err:
        if open_error is None:
            print(f"error: {err}", file=sys.stderr)
        return 2
    if open_error is not None:
        # The open's line names the unreadable file it stopped at, or the dataset for missing columns.
        said = [(f, what) for f, what in file_problems if what in open_error and (f in open_error or what.startswith("missing"))]
        file_problems = [p for p in file_problems if p not in said]
    lines = [f"{f}: {what}" for f, what in file_problems] + row_lines
    if not lines:
        if open_error is None:
            print(f"check: {read} row(s) read, no problems")
        elif read:
            print(f"check: {read} row(s) of the other file(s) read, no problem beyond the error above")
        return 0 if open_error is None else 2
    print(f"check: {read} row(s) read; {len(lines)} problem(s):")
    print("\n".join(f"  {line}" for line in lines))
    return 1 if open_error is None or row_lines else 2


def main(argv: Optional[list[str]] = None) -> int:
    from fv_accel.process import DefaultsHelpFormatter

    p = argparse.ArgumentParser(
        prog="python -m fv_accel.data.inspect", description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter
    )
    p.add_argument("path", help="a dataset folder or one Parquet file")
    p.add_argument("--batch_size", type=int, default=1, help="training.data.train_batch_size")
    p.add_argument("--num_processes", type=int, default=1, help="training processes (GPUs)")
    p.add_argument("--grad_accum", type=int, default=1, help="training.loop.gradient_accumulation_steps")
    p.add_argument("--check", action="store_true",
                   help="read every row and list those that cannot be decoded, have wrong shapes or dtypes, or hold NaN/inf")
    args = p.parse_args(argv)
    for name in ("batch_size", "num_processes", "grad_accum"):
        if getattr(args, name) < 1:
            print(f"error: --{name}: expected an integer >= 1, got {getattr(args, name)}", file=sys.stderr)
            return 2
    try:
        lines = report(args.path, batch_size=args.batch_size, num_processes=args.num_processes, grad_accum=args.grad_accum)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return _check(args.path, open_error=str(err)) if args.check else 2
    print("\n".join(lines))
    return _check(args.path, open_error=None) if args.check else 0


if __name__ == "__main__":
    sys.exit(main())
