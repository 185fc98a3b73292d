"""Parquet files read in place, with pyarrow: opening reads the footers and the small columns asked
for; a row's other columns are read with its row group when the row is asked for, through a small
LRU cache of row groups. Files are memory-mapped; nothing is written anywhere.

Rows are numbered through the files in their order: row i is row i - file_starts[k] of file k.
"""

from __future__ import annotations

import bisect
import os
from collections import OrderedDict
from typing import Any, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

# Row groups kept decoded per process (a row group of 1.3B-shaped rows is about 100 MB as
# `datasets` writes them), and files kept open per process.
CACHED_ROW_GROUPS = 2
OPEN_FILES = 64


def unreadable(path: str, err: BaseException) -> ValueError:
    detail = str(err).splitlines()[0] if str(err) else type(err).__name__
    return ValueError(f"{path}: not a readable Parquet file ({detail}); remove it, or rerun preprocessing to write it again")


def _is_binary(t: pa.DataType) -> bool:
    return pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t)


def binary_value(column: pa.ChunkedArray, r: int) -> Optional[pa.Buffer]:
    """Value `r` of a binary, large binary or fixed-size binary column as a zero-copy slice of the
    column's data buffer (None where null). `column[r]` would copy the value into a new scalar:
    8 MB for a Wan text embedding."""
    for chunk in column.chunks:
        if r >= len(chunk):
            r -= len(chunk)
            continue
        i = chunk.offset + r
        validity, *rest = chunk.buffers()
        if validity is not None and chunk.null_count and not (validity[i // 8] >> (i % 8)) & 1:
            return None
        if pa.types.is_fixed_size_binary(chunk.type):
            width = chunk.type.byte_width
            return rest[0].slice(i * width, width)
        offsets = np.frombuffer(rest[0], dtype=np.int64 if pa.types.is_large_binary(chunk.type) else np.int32)
        start, end = int(offsets[i]), int(offsets[i + 1])
        return rest[1].slice(start, end - start) if rest[1] is not None else pa.py_buffer(b"")
    raise IndexError(f"row {r} of a column of {len(column)} rows")


class ParquetRows:
    """The rows of `files`; `small_columns` (those present) are read whole at open into `columns`.

    `length_columns`: binary columns whose value lengths are read at open into `lengths` (name ->
    one length per row, None where null) as long as those columns hold at most `length_limit`
    bytes in all (uncompressed, from the footers); above it they are not read and `lengths` is None:
    Parquet keeps no value lengths outside the data pages."""

    def __init__(
        self,
        files: Sequence[str],
        small_columns: Sequence[str] = (),
        *,
        length_columns: Sequence[str] = (),
        length_limit: int = 0,
        cached_row_groups: int = CACHED_ROW_GROUPS,
    ):
        self.files = [str(f) for f in files]
        self.cached_row_groups = max(1, int(cached_row_groups))
        self.file_starts = [0]
        self.row_group_starts: list[list[int]] = []  # per file: first row of each row group, then its row count
        # Uncompressed bytes per column over all files (the footers' column-chunk sizes).
        self.column_bytes: dict[str, int] = {}
        self.column_names: list[str] = []
        self.column_types: dict[str, pa.DataType] = {}
        first_names: Optional[list[str]] = None
        wanted: list[str] = []
        per_file: list[dict[str, list]] = []
        measured: list[str] = []
        for path in self.files:
            try:
                pf = pq.ParquetFile(path, memory_map=True)
                meta = pf.metadata
                schema = pf.schema_arrow
            except Exception as err:  # noqa: BLE001 - pyarrow raises ArrowInvalid/OSError for a bad footer
                raise unreadable(path, err) from None
            names = list(schema.names)
            if first_names is None:
                first_names = names
                self.column_names = names
                self.column_types = {n: schema.field(n).type for n in names}
                wanted = [c for c in small_columns if c in names]
                measured = [c for c in length_columns if c in names]
            elif set(names) != set(first_names):
                extra = sorted(set(names) - set(first_names))
                lacks = sorted(set(first_names) - set(names))
                what = "; ".join(
                    part for part in (f"has {', '.join(extra)}" if extra else "", f"lacks {', '.join(lacks)}" if lacks else "") if part
                )
                raise ValueError(
                    f"{path}: its columns differ from those of {self.files[0]} ({what}); the files of one dataset "
                    "must share one schema (preprocess them with the same model, or give them as separate datasets)"
                )
            starts = [0]
            for g in range(meta.num_row_groups):
                rg = meta.row_group(g)
                starts.append(starts[-1] + rg.num_rows)
                for c in range(rg.num_columns):
                    col = rg.column(c)
                    name = col.path_in_schema.split(".")[0]
                    self.column_bytes[name] = self.column_bytes.get(name, 0) + int(col.total_uncompressed_size)
            if starts[-1] != meta.num_rows:
                raise unreadable(path, ValueError(f"row groups hold {starts[-1]} rows, the footer says {meta.num_rows}"))
            self.row_group_starts.append(starts)
            self.file_starts.append(self.file_starts[-1] + int(meta.num_rows))
            # Value lengths only while the columns measured so far stay within the limit (a dataset
            # over it reads at most `length_limit` bytes for nothing).
            if measured and sum(self.column_bytes.get(c, 0) for c in measured) > length_limit:
                measured = []
                for part in per_file:
                    for c in length_columns:
                        part.pop(c, None)
            if wanted or measured:
                try:
                    table = pf.read(columns=wanted + measured)
                except Exception as err:  # noqa: BLE001
                    raise unreadable(path, err) from None
                part = {n: table.column(n).to_pylist() for n in wanted}
                part.update({n: pc.binary_length(table.column(n)).to_pylist() for n in measured})
                per_file.append(part)
        # The small columns, whole: name -> one value per row.
        self.columns: dict[str, list] = {n: [v for part in per_file for v in part[n]] for n in wanted}
        self.lengths: Optional[dict[str, list]] = (
            {n: [v for part in per_file for v in part[n]] for n in measured} if length_columns and measured else None
        )
        self._reset()

    def __len__(self) -> int:
        return self.file_starts[-1]

    def locate(self, index: int) -> tuple[int, int]:
        """(file number, row in that file) of row `index`."""
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} of {len(self)}")
        k = bisect.bisect_right(self.file_starts, index) - 1
        return k, index - self.file_starts[k]

    # ---- per-process state: open files and decoded row groups (never pickled, reset in a new process)
    def _reset(self) -> None:
        self._pid = os.getpid()
        self._files: OrderedDict[int, pq.ParquetFile] = OrderedDict()
        self._groups: OrderedDict[tuple[int, int], pa.Table] = OrderedDict()

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for key in ("_files", "_groups", "_pid"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._reset()

    def _file(self, k: int) -> pq.ParquetFile:
        pf = self._files.get(k)
        if pf is None:
            try:
                pf = pq.ParquetFile(self.files[k], memory_map=True)
            except Exception as err:  # noqa: BLE001
                raise unreadable(self.files[k], err) from None
            self._files[k] = pf
            while len(self._files) > OPEN_FILES:
                self._files.popitem(last=False)
        else:
            self._files.move_to_end(k)
        return pf

    def _row_group(self, k: int, g: int) -> pa.Table:
        if self._pid != os.getpid():  # a forked DataLoader worker: its own files and cache
            self._reset()
        table = self._groups.get((k, g))
        if table is None:
            try:
                # On this thread alone: the read runs behind the training step (prefetch thread or
                # loader worker), where Arrow's thread pool would only take cores from the step.
                table = self._file(k).read_row_group(g, use_threads=False)
            except Exception as err:  # noqa: BLE001
                raise unreadable(self.files[k], err) from None
            self._groups[(k, g)] = table
            while len(self._groups) > self.cached_row_groups:
                self._groups.popitem(last=False)
        else:
            self._groups.move_to_end((k, g))
        return table

    def row(self, index: int) -> dict[str, Any]:
        """All columns of row `index`: binary values as zero-copy `pyarrow.Buffer`s (None where null),
        the others as Python values."""
        k, local = self.locate(index)
        starts = self.row_group_starts[k]
        g = bisect.bisect_right(starts, local) - 1
        table = self._row_group(k, g)
        r = local - starts[g]
        out: dict[str, Any] = {}
        for name in table.column_names:
            column = table.column(name)
            if _is_binary(column.type):
                out[name] = binary_value(column, r)
            else:
                out[name] = column[r].as_py()
        return out
