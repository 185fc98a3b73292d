"""Read an offline W&B run file (`run-<id>.wandb`) back: its records, as protobufs.

wandb 0.31 ships no reader for it (the old `wandb.sdk.internal.datastore` is gone, `wandb sync`
has no `--view`); the file is LevelDB's log format, as that module read it: a 7-byte file header
(b":W&B", magic 0xBEE1, version 0), then 32 KiB blocks of chunks, each with a 7-byte header
(CRC32, length, type: 1 full, 2 first, 3 middle, 4 last). Each whole payload is a `Record`
(wandb.proto.wandb_internal_pb2).
"""

from __future__ import annotations

import struct
from pathlib import Path

BLOCK = 32768
HEADER = 7


def read_records(path: str | Path) -> list:
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:HEADER])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, magic, version)
    records, pos, pending = [], HEADER, b""
    while pos + HEADER <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < HEADER:  # a block's tail too short for a chunk header is padding
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == 0 and length == 0:  # zero padding at the end of the file
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def read_complete_records(path: str | Path, timeout_s: float = 60.0) -> list:
    """The records once the file holds the run's `exit` record (W&B writes it last, from its
    service process, which may still be writing when the run object has finished)."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            records = read_records(path)
            if any(r.WhichOneof("record_type") == "exit" for r in records):
                return records
        except Exception:  # noqa: BLE001 - a record still being written
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            raise AssertionError(f"{path}: no exit record after {timeout_s:.0f}s")
        time.sleep(0.5)


def history(records: list) -> list[dict]:
    """The logged rows (`run.log`): {key: value} with the values decoded from JSON."""
    import json

    rows = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            rows.append({(item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in r.history.item})
    return rows
