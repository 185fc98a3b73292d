"""A cheap fingerprint of a latent dataset, kept in checkpoints so that a resume notices data that
changed under the same path.

Per dataset (the training data and each `training.data.mix` entry): its row count; per Parquet
file, its size, row count and the sha256 of its footer (the file's schema and row-group
statistics: a few KB, read from the end of the file); and the sha256 of the files preprocessing
writes beside the shards (fv_dataset.json, skipped.jsonl). The shards' bytes are not hashed: a
dataset of hundreds of GB is fingerprinted in milliseconds. The path itself is not part of it (a
moved dataset is the same data; a new path is a recipe change, warned as such).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Optional

from fv_accel.data.schema import DATASET_INFO

# Files beside the shards whose contents are hashed (small: written by preprocessing).
REPORT_FILES = (DATASET_INFO, "skipped.jsonl")
# A Parquet file ends with its footer, the footer's length (4 bytes, little-endian) and b"PAR1".
PARQUET_TAIL = 8


def parquet_footer_sha256(path: str | Path) -> str:
    with open(path, "rb") as fh:
        fh.seek(0, os.SEEK_END)
        size = fh.tell()
        if size < PARQUET_TAIL:
            return hashlib.sha256(b"").hexdigest()
        fh.seek(size - PARQUET_TAIL)
        length = int.from_bytes(fh.read(4), "little")
        start = max(0, size - PARQUET_TAIL - length)
        fh.seek(start)
        return hashlib.sha256(fh.read(size - start)).hexdigest()


def _part_fingerprint(part: Any) -> dict:
    root = Path(part.data_path)
    folder = root if root.is_dir() else root.parent
    starts = list(part.file_starts) + [len(part)]
    shards = {}
    for i, f in enumerate(part.files):
        name = os.path.relpath(f, folder)
        shards[name] = {"bytes": os.path.getsize(f), "rows": starts[i + 1] - starts[i], "footer_sha256": parquet_footer_sha256(f)}
    files = {}
    for name in REPORT_FILES:
        path = folder / name
        if path.is_file():
            files[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    return {"rows": len(part), "shards": shards, "files": files}


def dataset_fingerprint(dataset: Any) -> list[dict]:
    """One entry per dataset of a LatentDataset or a mix of them (ConcatLatentDataset)."""
    parts = getattr(dataset, "parts", None) or [dataset]
    return [_part_fingerprint(part) for part in parts]


def _part_change(i: int, old: dict, new: dict) -> list[str]:
    where = "training.data.data_path" if i == 0 else f"training.data.mix[{i - 1}]"
    out = []
    if old.get("rows") != new.get("rows"):
        out.append(f"{where}: {new.get('rows')} rows, {old.get('rows')} in the checkpoint")
    old_shards, new_shards = old.get("shards") or {}, new.get("shards") or {}
    gone, added = sorted(set(old_shards) - set(new_shards)), sorted(set(new_shards) - set(old_shards))
    if gone:
        out.append(f"{where}: {', '.join(gone[:3])}{' ...' if len(gone) > 3 else ''} gone")
    if added:
        out.append(f"{where}: {', '.join(added[:3])}{' ...' if len(added) > 3 else ''} new")
    for name in sorted(set(old_shards) & set(new_shards)):
        a, b = old_shards[name], new_shards[name]
        if a.get("bytes") != b.get("bytes"):
            out.append(f"{where}: {name} is {b.get('bytes')} bytes, {a.get('bytes')} in the checkpoint")
        elif a != b:
            out.append(f"{where}: {name} has another Parquet footer (its rows were rewritten)")
    old_files, new_files = old.get("files") or {}, new.get("files") or {}
    for name in sorted(set(old_files) | set(new_files)):
        if old_files.get(name) != new_files.get(name):
            state = "missing now" if name not in new_files else "new" if name not in old_files else "changed"
            out.append(f"{where}: {name} {state}")
    return out


def describe_fingerprint_change(old: list[dict], new: list[dict]) -> Optional[str]:
    """What differs between two fingerprints, in a few words (the first three differences), or None."""
    if old == new:
        return None
    lines: list[str] = []
    if len(old) != len(new):
        lines.append(f"{len(new)} dataset(s), {len(old)} in the checkpoint")
    for i, (a, b) in enumerate(zip(old, new)):
        lines += _part_change(i, a, b)
    lines = lines or ["its fingerprint differs"]
    return "; ".join(lines[:3]) + (f"; and {len(lines) - 3} more" if len(lines) > 3 else "")


def summarize_fingerprint(fingerprint: list[dict]) -> str:
    """'<rows> rows in <files> file(s)' per dataset, for the record of a resume's changes."""
    return "; ".join(f"{f.get('rows')} rows in {len(f.get('shards') or {})} file(s)" for f in fingerprint)
