"""The training loader: precomputed latents, (T, H, W) buckets, per-epoch reshuffle, resumable position.

Batching is arranged so that the result does not depend on how the work is split: each optimizer
step consumes one *group* of `batch * world_size * grad_accum` samples from one bucket; micro-batch
`j` of rank `r` takes slice `j * world_size + r` of the group. One process with batch 2, two with
batch 1, and one with batch 1 and two accumulation steps all see the same samples per step.
"""

from __future__ import annotations

import bisect
import logging
import math
import os
import sys
import threading
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import torch
from torch.utils.data import DataLoader, Dataset

from fv_accel.data.schema import (
    CONDITIONING_COLUMNS,
    TEXT_COLUMNS,
    DATASET_INFO,
    REQUIRED_COLUMNS,
    TEXT_EMBEDDING_COLUMNS,
    TEXT_ONLY,
    UNCONDITIONAL_FILE,
    bytes_to_tensor,
    columns_are_text_only,
    dataset_is_text_only,
    local_dataset_path,
    parquet_files,
    read_dataset_info,
    read_tensor_column,
    read_unconditional_text,
)
from fv_accel.seeding import sample_generator_seed

logger = logging.getLogger(__name__)

TEXT_MAX_LENGTH = 512
# An item's text columns other than the main text embedding and its mask (a family's second encoder,
# pooled text, LTX-2's audio text), which a caption dropout replaces too.
EXTRA_TEXT_KEYS = ("pooled_text_embedding", "text_embedding_2", "text_attention_mask_2", "audio_text_embedding")
# Columns read whole when a dataset is opened (the rest is read by row group when a row is asked for).
SMALL_COLUMNS = (
    "id", "vae_latent_shape", "vae_latent_dtype", "text_embedding_shape", "text_embedding_dtype", "audio_latent_shape",
)


class LatentDataset(Dataset):
    """Rows of FastVideo-schema Parquet files; items are addressed by (index, epoch, position).

    Opening reads the files' footers and the small columns (id, shapes, dtypes) with pyarrow, in
    place: nothing is copied or written. A row's tensors are read with its row group when the row is
    asked for (fv_accel/data/parquet_rows.py).

    A text-only dataset (rows without the VAE latent columns, `preprocessed_data_type` 'text_only')
    loads too: its items have the text columns and no `vae_latent`, and its rows are one bucket."""

    def __init__(
        self,
        data_path: str,
        *,
        text_max_length: int = TEXT_MAX_LENGTH,
        cfg_rate: float = 0.0,
        seed: int = 0,
        cache: Optional["ItemCache"] = None,
    ):
        from fv_accel.data import checks
        from fv_accel.data.parquet_rows import ParquetRows

        # hf://<repo> and a repository's cache folder become the local snapshot folder.
        self.data_path = local_dataset_path(data_path)
        self.files = parquet_files(self.data_path)
        self.rows = ParquetRows(
            self.files, SMALL_COLUMNS, length_columns=checks.LENGTH_COLUMNS, length_limit=checks.BYTE_CHECK_LIMIT
        )
        # Row i of the dataset is row i - file_starts[k] of file k.
        self.file_starts = self.rows.file_starts
        if len(self.rows) == 0:
            raise ValueError(f"{self.data_path}: the dataset is empty (0 rows in {len(self.files)} Parquet file(s))")
        # No VAE latent columns at all: prompts for a rollout from noise (the text columns are required).
        self.text_only = columns_are_text_only(self.rows.column_names)
        required = TEXT_EMBEDDING_COLUMNS if self.text_only else REQUIRED_COLUMNS
        missing = [c for c in required if c not in self.rows.column_names]
        if missing:
            raise ValueError(
                f"{self.data_path}: missing column(s) {', '.join(missing)}; expected FastVideo's schema "
                f"({', '.join(required)})"
            )
        recorded = read_dataset_info(self.data_path).get("num_rows") if Path(self.data_path).is_dir() else None
        if recorded is not None and int(recorded) != len(self.rows):
            raise ValueError(
                f"{self.data_path}: {DATASET_INFO} records {recorded} rows but its Parquet files hold "
                f"{len(self.rows)}: shards were added, removed or cut short since preprocessing finished; rerun "
                "the same preprocess command to rebuild it"
            )
        self.ids = self.rows.columns.get("id")
        checks.check_stored_rows(self)
        latent_shapes = [] if self.text_only else self.rows.columns["vae_latent_shape"]
        self.latent_shapes = [tuple(int(v) for v in s) for s in latent_shapes]
        self.text_shapes = [tuple(int(v) for v in s) for s in self.rows.columns["text_embedding_shape"]]
        # LTX-2's audio latent length L of [C, L, M] per row: clips at other frame rates have other
        # lengths for the same picture, and a batch holds one (empty for a dataset without sound).
        audio_shapes = self.rows.columns.get("audio_latent_shape") or []
        self.audio_lengths = [int(s[-2]) if s else 0 for s in audio_shapes]
        # Image-to-video columns this dataset has (read into the batch where a row holds them).
        self.conditioning_columns = [c for c in CONDITIONING_COLUMNS if f"{c}_bytes" in self.rows.column_names]
        self.text_columns = [c for c in TEXT_COLUMNS if f"{c}_bytes" in self.rows.column_names]
        self.text_max_length = text_max_length
        self.cfg_rate = float(cfg_rate)
        self.seed = seed
        # What a dropped caption becomes: the pipeline's unconditional text, stored by preprocessing.
        self.unconditional = self._unconditional_text() if self.cfg_rate > 0 else None
        # Index of this dataset's first row in a mix, so mixed datasets draw different dropouts.
        self.global_offset = 0
        # Decoded rows kept in memory (ItemCache); None reads every row from its file each time.
        self.cache = cache

    def _unconditional_text(self) -> dict[str, torch.Tensor]:
        """The dataset's unconditional text columns (schema.UNCONDITIONAL_FILE), one for each text
        column its rows hold; caption dropout needs them."""
        columns = read_unconditional_text(self.data_path)
        if columns is None:
            raise ValueError(
                f"{self.data_path}: training.data.training_cfg_rate is {self.cfg_rate} but the dataset has no "
                f"{UNCONDITIONAL_FILE} (the encoding of the prompt the pipeline's unconditional branch uses, which "
                "caption dropout trains on): rerun the preprocess command that made it (it reuses the encoded clips "
                "and adds the file), or set training.data.training_cfg_rate: 0"
            )
        missing = [name for name in ("text_embedding", *self.text_columns) if name not in columns]
        if missing:
            raise ValueError(
                f"{self.data_path}/{UNCONDITIONAL_FILE} lacks {', '.join(missing)}, which the dataset's rows hold: "
                "rerun the preprocess command that made the dataset"
            )
        return columns

    @property
    def preprocessed_data_type(self) -> str:
        """FastVideo's name of what the rows hold: 'text_only' (prompts), 'i2v' (clips with the
        first-frame columns) or 't2v' (clips)."""
        if self.text_only:
            return TEXT_ONLY
        return "i2v" if "first_frame_latent" in self.conditioning_columns else "t2v"

    def row_location(self, index: int) -> dict:
        """Where row `index` lives: {"file", "row" (in the file), "id" (None without an id column)}."""
        k = bisect.bisect_right(self.file_starts, int(index)) - 1
        ident = self.ids[int(index)] if self.ids is not None else None
        return {"file": self.files[k], "row": int(index) - self.file_starts[k], "id": ident}

    def describe(self, index: int) -> str:
        """Where row `index` lives, for messages: '<file> row <row in file> (id <id>)'."""
        where = self.row_location(index)
        return f"{where['file']} row {where['row']}" + (f" (id {where['id']!r})" if where["id"] else "")

    def __len__(self) -> int:
        return len(self.rows)

    def bucket_key(self, i: int) -> tuple[int, ...]:
        # (T, H, W), and the audio latent length for rows with sound; the rows of a text-only dataset
        # share one bucket (the rollout's shape is the recipe's).
        if self.text_only:
            return ()
        return self.latent_shapes[i][1:] + ((self.audio_lengths[i],) if self.audio_lengths else ())

    def __getitem__(self, key: Any) -> dict:
        index, epoch, position = key if isinstance(key, tuple) else (key, 0, 0)
        index = int(index)
        decoded = self.cache.get((self.data_path, index)) if self.cache is not None else None
        if decoded is None:
            decoded = self._decode(index)
            if self.cache is not None:
                self.cache.put((self.data_path, index), decoded)
        item = dict(decoded)  # the kept dict stays as decoded: dropout and the position go on a copy
        if self.cfg_rate > 0:
            # CFG dropout keyed by (seed, epoch, index): reproducible and independent of the split.
            # Every text column of the row becomes the unconditional text's, with its mask.
            g = torch.Generator().manual_seed(sample_generator_seed(self.seed + 7919, epoch, index + self.global_offset))
            if torch.rand((), generator=g).item() < self.cfg_rate:
                texts = {k: item[k] for k in EXTRA_TEXT_KEYS if k in item}
                item["text_embedding"], item["text_attention_mask"], dropped = self._dropped_text(texts)
                item.update(dropped)
        item["epoch"] = int(epoch)
        item["position"] = int(position)
        return item

    def _decode(self, index: int) -> dict:
        """Row `index` read from its file and decoded: the item's tensors (float32, the text padded to
        `text_max_length`), caption, source and non-finite flag, before caption dropout."""
        row = self.rows.row(index)
        source = self.describe(index)
        where = f"{source}: "
        latent = None if self.text_only else _stored_tensor(row, "vae_latent", where).float()
        text = _stored_tensor(row, "text_embedding", where).float()
        if text.ndim == 3 and text.shape[0] == 1:
            text = text[0]
        padded, mask = pad_text(text, self.text_max_length)
        # The family's other text columns (HunyuanVideo's pooled CLIP, a second encoder's sequence).
        texts = {}
        if "pooled_text_embedding" in self.text_columns:
            texts["pooled_text_embedding"] = read_tensor_column(row, "pooled_text_embedding", where=where)
        if "text_embedding_2" in self.text_columns:
            second = read_tensor_column(row, "text_embedding_2", where=where)
            shape = [int(v) for v in row.get("text_embedding_2_shape") or []]
            if second is None and len(shape) == 2 and shape[0] == 0:
                # A caption with none of the second encoder's tokens (stored [0, D2], no bytes).
                second = torch.zeros(shape, dtype=torch.float32)
            if second is not None:
                texts["text_embedding_2"], texts["text_attention_mask_2"] = pad_text(second.float(), self.text_max_length)
        if "audio_text_embedding" in self.text_columns:  # LTX-2's audio-branch text, padded as the video's
            audio_text = read_tensor_column(row, "audio_text_embedding", where=where)
            texts["audio_text_embedding"] = pad_text(audio_text.float(), self.text_max_length)[0]
        texts = {k: v.float() if k != "text_attention_mask_2" else v for k, v in texts.items() if v is not None}
        item = {
            "text_embedding": padded,
            "text_attention_mask": mask,
            "caption": row.get("caption", "") or "",
            "sample_index": index,
            # Named in the trainer's warning when a step is skipped for a non-finite loss. A sum is
            # non-finite when any value is NaN or infinite, and costs one pass over the tensor. The
            # row's own data is checked (a caption dropout does not hide it).
            "source": source,
            "nonfinite": not all(bool(torch.isfinite(t.sum())) for t in (latent, text, *texts.values()) if t is not None),
        }
        if latent is not None:
            item["vae_latent"] = latent
        item.update(texts)
        for name in self.conditioning_columns if latent is not None else ():
            value = read_tensor_column(row, name, where=where)
            if value is not None:
                item[name] = conditioning_tensor(name, value, tuple(latent.shape), where)
        return item

    def _dropped_text(self, texts: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(text, mask, the other text columns) of a dropped caption: the unconditional text's,
        padded as a caption's."""
        u = self.unconditional
        padded, mask = pad_text(u["text_embedding"].clone(), self.text_max_length)
        out = dict(texts)
        if "pooled_text_embedding" in texts:
            out["pooled_text_embedding"] = u["pooled_text_embedding"].clone()
        if "text_embedding_2" in texts:
            out["text_embedding_2"], out["text_attention_mask_2"] = pad_text(u["text_embedding_2"].clone(), self.text_max_length)
        if "audio_text_embedding" in texts:
            out["audio_text_embedding"] = pad_text(u["audio_text_embedding"].clone(), self.text_max_length)[0]
        return padded, mask, out


def _stored_tensor(row: dict, name: str, where: str) -> torch.Tensor:
    """A required tensor column of a row; its byte length is checked against its shape here (the
    open checks it only for small datasets, fv_accel/data/checks.py)."""
    raw = row[f"{name}_bytes"]
    if raw is None:
        raise ValueError(f"{where}{name}_bytes is missing (null)")
    return bytes_to_tensor(raw, row[f"{name}_shape"], row[f"{name}_dtype"], where=f"{where}{name}_bytes: ")


class ItemCache:
    """Decoded rows kept in memory (`training.data.cache_gb`), so that a row read once is not read and
    decoded again in later epochs: a small dataset trained for many epochs then reads each row once.

    Rows are kept as they come until their tensors fill `max_bytes`; later rows are read from their
    files each time (no eviction: with shuffled epochs an LRU would evict every row before its next
    use). A kept row's tensors are handed out as they are, not copied. A consumer that changes one in
    place (its version counter moves) gets the row read again from its file, so an item always holds
    the file's values; that is logged once. Only the process that made the cache uses it (a
    DataLoader worker reads its rows from the files)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max(0, int(max_bytes))
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.changed = 0  # kept rows found changed in place, and read again
        self.full = False
        self._items: dict[Any, tuple[dict, list[tuple[torch.Tensor, int]], int]] = {}
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.update(_items={}, _lock=None, bytes=0, full=False)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def _usable(self) -> bool:
        return self.max_bytes > 0 and os.getpid() == self._pid

    def get(self, key: Any) -> Optional[dict]:
        """The kept item of `key`, or None; the caller copies the dict before changing it."""
        if not self._usable():
            return None
        with self._lock:
            entry = self._items.get(key)
            if entry is None:
                self.misses += 1
                return None
            item, versions, size = entry
            if any(t._version != v for t, v in versions):
                del self._items[key]
                self.bytes -= size
                self.changed += 1
                if self.changed == 1:
                    logger.warning(
                        "training data: a batch tensor of row %s was changed in place after its step; the data cache "
                        "reads such rows from their files again (an in-place op on batch tensors costs that read)",
                        key[-1] if isinstance(key, tuple) else key,
                    )
                return None
            self.hits += 1
            return item

    def put(self, key: Any, item: dict) -> bool:
        """Keep `item` (the dict and its tensors as they are: the caller does not change it afterwards)
        while the budget allows; True when kept."""
        if not self._usable():
            return False
        tensors = [v for v in item.values() if isinstance(v, torch.Tensor)]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        size = sum(storages.values())
        with self._lock:
            if key in self._items:
                return True
            if self.bytes + size > self.max_bytes:
                if not self.full:
                    self.full = True
                    logger.info(
                        "training data: the data cache is full at %d rows (%.2f GiB, training.data.cache_gb %.3g); "
                        "the other rows are read from their files each time they are drawn",
                        len(self._items), self.bytes / 2**30, self.max_bytes / 2**30,
                    )
                return False
            self._items[key] = (item, [(t, t._version) for t in tensors], size)
            self.bytes += size
            return True

    def stats(self) -> dict:
        """Rows kept, their bytes, hits and misses so far, rows found changed in place."""
        return {"rows": len(self._items), "bytes": self.bytes, "hits": self.hits, "misses": self.misses, "changed": self.changed}


# Batch keys read on the host (sampler position, per-sample generator seeds): never moved.
HOST_KEYS = ("sample_index", "epoch")


class BatchPrefetcher:
    """The batches of `batches`, in their order, read and moved to `device` by a background thread
    while the training thread computes: when the step asks for its batch, it is ready.

    The thread pulls from `iter(batches)` (the loader's decoding of Parquet rows, bucketing and
    collate run there, or in the loader's workers) and moves each batch's tensors to `device` (on
    CUDA a non-blocking copy from pinned memory; on the CPU device the very tensors, no copy); the
    host keys (HOST_KEYS) stay on the host. At most `depth` finished batches wait in the queue, and
    one more is being made. A batch drawn ahead is not consumed: the position a checkpoint keeps is
    the trainer's (`TrainLoader.mark_step_done`), and `close` drops what was drawn ahead. An error
    the loader raises (a row it cannot read) is raised by `next` at that batch's turn, as it is."""

    _END = object()
    # Intra-op threads of the prefetch thread's torch calls (dtype casts, the finite check). One, as
    # in DataLoader's worker processes. With more, this thread starts an OpenMP team of its own; libgomp
    # then manages more threads than there are cores and cuts every team's spin-wait short, so the
    # training step's threads go to sleep and are woken between ops (on 2 cores: ~2,000 voluntary
    # context switches a step instead of ~40 at the small benchmark size).
    threads: int = 1
    # Added to the thread's nice value (Linux): where the step's threads use every core (training on
    # the CPU), the scheduler runs the reading in their gaps rather than in the middle of their ops.
    # Small benchmark, LoRA, 2 cores: the forward 19 ms longer than a bare loop's at nice 0, 7 ms at
    # 19, and the batch still ready (median wait 0.04 ms; SCHED_IDLE left it late, 7.5 ms).
    nice: int = 19

    def __init__(self, batches: Any, device: torch.device, *, depth: int = 1):
        import queue

        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self.device = device
        self._queue: Any = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._ended = False
        source = iter(batches)  # on the calling thread: a loader notes its start position here
        self._thread = threading.Thread(target=self._fill, args=(source,), name="fv_accel-prefetch", daemon=True)
        self._thread.start()

    def _move(self, batch: dict) -> dict:
        if self.device.type == "cpu":
            return batch
        return {
            k: v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) and k not in HOST_KEYS else v
            for k, v in batch.items()
        }

    def _put(self, item: Any) -> bool:
        """Queue `item`, waiting for room; False when `close` asked the thread to stop."""
        import queue

        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _fill(self, source: Iterator[dict]) -> None:
        torch.set_num_threads(self.threads)  # per calling thread under OpenMP: this one only
        if self.nice and sys.platform.startswith("linux"):
            # Linux keeps a nice value per thread (elsewhere the id could name another process).
            try:
                own = os.getpriority(os.PRIO_PROCESS, 0)
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(19, own + self.nice))
            except OSError:
                pass
        try:
            for batch in source:
                if not self._put(self._move(batch)):
                    return
            self._put(self._END)
        except BaseException as err:  # noqa: BLE001 - handed to the training thread, raised there
            self._put(err)
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                close()  # the loader's own clean-up (its DataLoader workers), on this thread

    def __iter__(self) -> "BatchPrefetcher":
        return self

    def __next__(self) -> dict:
        if self._ended:
            raise StopIteration
        item = self._queue.get()
        if item is self._END:
            self._ended = True
            raise StopIteration
        if isinstance(item, BaseException):
            self._ended = True
            raise item
        return item

    def close(self) -> None:
        """Stop the thread (the batches drawn ahead are dropped) and wait for it."""
        import queue

        self._stop.set()
        self._ended = True
        while self._thread.is_alive():
            try:
                self._queue.get(timeout=0.05)
            except queue.Empty:
                pass
        self._thread.join()


def pad_text(text: torch.Tensor, max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[L, D] -> ([max_length, D] zero-padded (cut at max_length), [max_length] long mask of the real
    tokens). A text already of full length is returned as it is (no copy)."""
    length = min(text.shape[0], max_length)
    if text.shape[0] == max_length:
        # Preprocessing stores text already padded to the full length, and `text` is our own copy:
        # no second copy (8 MB for umT5's 512 x 4096 in fp32, a third of the item's time).
        padded = text
    else:
        padded = torch.zeros(max_length, text.shape[-1], dtype=torch.float32)
        padded[:length] = text[:length]
    mask = torch.zeros(max_length, dtype=torch.long)
    mask[:length] = 1
    return padded, mask


# name -> (dimensions, layout) of the image-to-video columns in an item.
CONDITIONING_LAYOUTS = {
    "first_frame_latent": (4, "[C, T, H, W]"),
    "clip_feature": (2, "[L, D]"),
    "pil_image": (3, "[H, W, 3]"),
    # LTX-2's raw audio latent (zeros for a clip kept without sound) and whether the clip has sound.
    "audio_latent": (3, "[C, L, M]"),
    "audio_present": (0, "[]"),
}


def conditioning_tensor(name: str, value: torch.Tensor, latent_shape: tuple, where: str) -> torch.Tensor:
    """An image-to-video column checked against its layout (a leading batch dimension of 1, as
    FastVideo's batched writer may leave, is dropped): float32, or uint8 for `pil_image`."""
    ndim, layout = CONDITIONING_LAYOUTS[name]
    if value.ndim == ndim + 1 and value.shape[0] == 1:
        value = value[0]
    if value.ndim != ndim:
        raise ValueError(f"{where}{name}: expected {layout}, stored shape {list(value.shape)}")
    if name == "first_frame_latent" and tuple(value.shape) != latent_shape:
        raise ValueError(
            f"{where}first_frame_latent: shape {list(value.shape)} differs from vae_latent's {list(latent_shape)}"
        )
    if name == "pil_image":
        if value.dtype != torch.uint8 or value.shape[-1] != 3:
            raise ValueError(f"{where}pil_image: expected uint8 [H, W, 3], stored {str(value.dtype).replace('torch.', '')} {list(value.shape)}")
        return value
    return value.float()


def _stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """torch.stack, without its copy for a batch of one (the item's tensor with a batch dimension:
    the item is not used again)."""
    return tensors[0].unsqueeze(0) if len(tensors) == 1 else torch.stack(tensors)


def collate(items: list[dict]) -> dict:
    """One batch of items: a text-only dataset's have no `vae_latent` (nor has their batch)."""
    shapes = {tuple(it["vae_latent"].shape) if "vae_latent" in it else None for it in items}
    if len(shapes) != 1:
        raise RuntimeError(f"a batch mixes latent shapes {sorted(shapes, key=str)} (bucketing bug)")
    batch = {
        "text_embedding": _stack([it["text_embedding"] for it in items]),
        "text_attention_mask": _stack([it["text_attention_mask"] for it in items]),
        "caption": [it["caption"] for it in items],
        "sample_index": torch.tensor([it["sample_index"] for it in items], dtype=torch.long),
        "epoch": torch.tensor([it["epoch"] for it in items], dtype=torch.long),
        "position": items[0]["position"],
        "source": [it.get("source", "") for it in items],
        "nonfinite": [bool(it.get("nonfinite", False)) for it in items],
    }
    if shapes != {None}:
        batch["vae_latent"] = _stack([it["vae_latent"] for it in items])
    for name in (*CONDITIONING_LAYOUTS, *EXTRA_TEXT_KEYS):
        holders = [it["sample_index"] for it in items if name in it]
        if len(holders) == len(items):
            batch[name] = torch.stack([it[name] for it in items])
        elif holders:
            lacking = [it["sample_index"] for it in items if name not in it]
            raise RuntimeError(
                f"a batch mixes samples with {name} (samples {holders}) and without it (samples {lacking}): "
                "datasets preprocessed for different models (image- and text-to-video, or other families) cannot be mixed"
            )
    return batch


NONFINITE_MARK = "[NaN/inf in its data]"
SET_ASIDE_TEXT = "set aside for the rest of the run"


def describe_samples(batches: Sequence[dict]) -> str:
    """The samples of a step's micro-batches, those holding NaN or infinite values marked (for the
    trainer's warning about a step with a non-finite loss, which sets those rows aside:
    `TrainLoader.set_aside`)."""
    names, flagged = [], []
    for batch in batches:
        for source, bad in zip(batch.get("source") or [], batch.get("nonfinite") or []):
            names.append(source)
            if bad:
                flagged.append(f"{source} {NONFINITE_MARK}")
    if not names:
        return ""
    return "samples: " + ("; ".join(flagged) + f", {SET_ASIDE_TEXT}" if flagged else "; ".join(names))


def flagged_rows(batches: Sequence[dict]) -> list[int]:
    """The rows of a step's micro-batches whose own data holds NaN or infinite values (flagged when
    read, `LatentDataset.__getitem__`)."""
    rows = []
    for batch in batches:
        indices = batch.get("sample_index")
        indices = indices.tolist() if isinstance(indices, torch.Tensor) else list(indices or [])
        rows += [int(i) for i, bad in zip(indices, batch.get("nonfinite") or []) if bad]
    return rows


@dataclass
class LoaderPosition:
    epoch: int = 0
    step_in_epoch: int = 0  # optimizer steps (groups) consumed in this epoch


class BucketBatchSampler:
    """Yields this rank's micro-batches, as lists of (index, epoch, position) keys, forever.

    Per epoch: indices of each bucket are shuffled with a generator seeded by (seed, epoch), cut
    into groups of `batch_size * world_size * grad_accum`, and the groups of all buckets are
    shuffled together. A bucket's incomplete last group is dropped and reported once per epoch.
    """

    def __init__(
        self,
        bucket_keys: Sequence[tuple],
        *,
        batch_size: int,
        world_size: int = 1,
        rank: int = 0,
        grad_accum: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        weights: Optional[Sequence[float]] = None,
        exclude_indices: Optional[Sequence[int]] = None,
    ):
        self.bucket_keys = list(bucket_keys)
        self.batch_size = batch_size
        self.world_size = world_size
        self.rank = rank
        self.grad_accum = grad_accum
        self.seed = seed
        self.shuffle = shuffle
        self.weights = list(weights) if weights is not None else None
        # Rows never yielded (a held-out split carved out of the training data, fv_accel/validation.py).
        self.exclude_indices = frozenset(int(i) for i in exclude_indices or ())
        # Rows set aside during the run for NaN/inf in their own data (TrainLoader.set_aside): index ->
        # the epoch of the step that drew it. From the next epoch on such a row is left out before
        # the shuffle, so the other rows' order is the one a dataset without it would have; in its
        # own epoch, whose order was fixed when the epoch began, a later group holding it (possible
        # only with mixing's draws with replacement) is skipped whole.
        self.set_aside: dict[int, int] = {}
        self.group_size = batch_size * world_size * grad_accum
        self.position = LoaderPosition()
        self.dropped_per_epoch = 0
        if self.weights is not None and len(self.weights) != len(self.bucket_keys):
            raise ValueError(f"weights: {len(self.weights)} values for {len(self.bucket_keys)} samples")
        if not self.epoch_groups(0):
            largest = max(self._buckets().values(), key=len)
            raise ValueError(
                f"no bucket holds enough samples for one step: {self.group_size} needed "
                f"(batch {batch_size} x {world_size} processes x {grad_accum} accumulation), "
                f"largest bucket has {len(largest)}"
            )
        if rank == 0 and self.weights is None:
            self._warn_untrainable()

    def _warn_untrainable(self) -> None:
        """Samples in a bucket smaller than one step are in no step of any epoch: say so once."""
        small = {key: len(idx) for key, idx in self._buckets().items() if len(idx) < self.group_size}
        if small:
            axes = {3: "latent (T, H, W)", 4: "latent (T, H, W) and audio length"}  # audio: clips with sound (LTX-2)
            shapes = ", ".join(f"{n} of {axes.get(len(key), 'bucket')} {key}" for key, n in sorted(small.items()))
            logger.warning(
                "%d sample(s) will never be trained: their bucket holds fewer samples than one step takes "
                "(%d = batch %d x %d processes x %d accumulation): %s; lower training.data.train_batch_size "
                "or preprocess them to a shape that has more samples",
                sum(small.values()),
                self.group_size,
                self.batch_size,
                self.world_size,
                self.grad_accum,
                shapes,
            )

    def _left_out(self, epoch: Optional[int]) -> frozenset:
        """Rows no group of `epoch` holds: the excluded ones and those set aside in an earlier epoch
        (None: the excluded ones only)."""
        if epoch is None or not self.set_aside:
            return self.exclude_indices
        return self.exclude_indices | {i for i, found in self.set_aside.items() if found < epoch}

    def _buckets(self, epoch: Optional[int] = None) -> dict[tuple, list[int]]:
        left_out = self._left_out(epoch)
        buckets: dict[tuple, list[int]] = defaultdict(list)
        for i, key in enumerate(self.bucket_keys):
            if i not in left_out:
                buckets[key].append(i)
        return buckets

    def trains_in(self, epoch: int) -> bool:
        """Whether epoch `epoch` can hold a step, given the rows left out before it."""
        buckets = self._buckets(epoch)
        if self.weights is not None:
            return any(buckets.values())  # drawn with replacement: one row can fill a step
        return any(len(idx) >= self.group_size for idx in buckets.values())

    def epoch_groups(self, epoch: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        groups: list[list[int]] = []
        dropped = 0
        buckets = self._buckets(epoch) if self.weights is None else self._weighted_buckets(g, epoch)
        for key in sorted(buckets):
            idx = buckets[key]
            if self.shuffle:
                idx = [idx[j] for j in torch.randperm(len(idx), generator=g).tolist()]
            full = len(idx) // self.group_size
            dropped += len(idx) - full * self.group_size
            groups += [idx[k * self.group_size : (k + 1) * self.group_size] for k in range(full)]
        if self.shuffle:
            groups = [groups[j] for j in torch.randperm(len(groups), generator=g).tolist()]
        self.dropped_per_epoch = dropped
        return groups

    def _weighted_buckets(self, g: torch.Generator, epoch: int) -> dict[tuple, list[int]]:
        """Multi-dataset mixing: an epoch is as many draws (with replacement) as there are samples,
        each sample drawn with probability proportional to its weight, then bucketed. Drawing over
        the whole dataset, not per bucket, keeps the datasets' shares right when they differ in shape."""
        w = torch.tensor(self.weights, dtype=torch.float64)
        left_out = self._left_out(epoch)
        if left_out:
            w[sorted(left_out)] = 0.0
        draws = torch.multinomial(w, num_samples=len(self.bucket_keys), replacement=True, generator=g)
        buckets: dict[tuple, list[int]] = defaultdict(list)
        for i in draws.tolist():
            buckets[self.bucket_keys[i]].append(i)
        return buckets

    def steps_per_epoch(self) -> int:
        return len(self.epoch_groups(self.position.epoch))

    def state_dict(self) -> dict:
        return {"epoch": self.position.epoch, "step_in_epoch": self.position.step_in_epoch, "group_size": self.group_size}

    def load_state_dict(self, state: dict) -> None:
        if int(state.get("group_size", self.group_size)) != self.group_size:
            logger.warning(
                "resuming with %d samples per step instead of %s: the data order continues from the "
                "same epoch but not sample for sample",
                self.group_size,
                state.get("group_size"),
            )
        self.position = LoaderPosition(int(state["epoch"]), int(state["step_in_epoch"]))

    def __iter__(self) -> Iterator[list[tuple[int, int, int]]]:
        epoch, start = self.position.epoch, self.position.step_in_epoch
        while True:
            if not self.trains_in(epoch):
                return  # the rows set aside leave no step: the end of the data (TrainLoader.no_step_message)
            groups = self.epoch_groups(epoch)
            if self.dropped_per_epoch and start == 0:
                logger.info(
                    "epoch %d: %d sample(s) left out this epoch (bucket remainders smaller than %d per step)",
                    epoch,
                    self.dropped_per_epoch,
                    self.group_size,
                )
            for step in range(start, len(groups)):
                group = groups[step]
                if self.set_aside and not self.set_aside.keys().isdisjoint(group):
                    continue
                for micro in range(self.grad_accum):
                    part = micro * self.world_size + self.rank
                    chunk = group[part * self.batch_size : (part + 1) * self.batch_size]
                    yield [(i, epoch, step) for i in chunk]
            epoch, start = epoch + 1, 0


WORKER_ERROR = "Caught ValueError in DataLoader worker"


def _worker_error(err: ValueError) -> ValueError:
    """The message a DataLoader worker's ValueError had (the last `ValueError: ...` of the traceback
    torch puts in the message), or `err` itself when it did not come from a worker."""
    text = str(err)
    mark = "\nValueError: "
    if not text.startswith(WORKER_ERROR) or mark not in text:
        return err
    return ValueError(text[text.rindex(mark) + len(mark) :].strip())


class TrainLoader:
    """A DataLoader over the bucket sampler that knows its position for checkpoints."""

    def __init__(self, dataset: LatentDataset, sampler: BucketBatchSampler, num_workers: int = 0):
        self.dataset = dataset
        self.sampler = sampler
        self.num_workers = num_workers
        # Page-locked batches on CUDA machines, so `BatchPrefetcher` copies them without blocking.
        self.pin_memory = torch.cuda.is_available()
        # Rows left out because their shape is not the one training.data.num_* ask for.
        self.off_shape_indices: list[int] = []
        # Latent tokens of one sample of a text-only dataset's rollout (set by build_train_loader).
        self.rollout_tokens = 0
        # Rows set aside for NaN/inf in their own data: index -> {"epoch", "step"} of the step that
        # drew it (`set_aside`); kept in checkpoints.
        self.set_aside_rows: dict[int, dict] = {}
        self._consumed = LoaderPosition(sampler.position.epoch, sampler.position.step_in_epoch)

    @property
    def preprocessed_data_type(self) -> str:
        """The dataset's: 'text_only' (prompts), 't2v' or 'i2v' (LatentDataset.preprocessed_data_type)."""
        return self.dataset.preprocessed_data_type

    def batch_tokens(self, batch: dict) -> int:
        """Latent tokens of a batch (for throughput figures): of its `vae_latent`, or for a text-only
        batch of the recipe's rollout shape (`rollout_tokens`, 0 where the recipe gives none)."""
        latent = batch.get("vae_latent")
        if latent is None:
            return len(batch["sample_index"]) * self.rollout_tokens
        return latent.shape[0] * latent_tokens(latent.shape[1:])

    def num_training_rows(self) -> int:
        """Rows training draws from: the dataset's, less the held-out, off-shape and set-aside ones."""
        return len(self.dataset) - len(self.sampler.exclude_indices | self.set_aside_rows.keys())

    def set_aside(self, rows: Sequence[int], *, epoch: int, step: int) -> list[int]:
        """Leave `rows` (whose own data holds NaN/inf, drawn by optimizer step `step` of epoch `epoch`)
        out of training for the rest of the run; every rank calls this with the same rows after the
        same step. Returns the rows new to the set. A pass already started (its prefetched batches)
        still holds what it drew: the caller starts a new one (`iter`), which continues after the last
        finished step. When no later epoch can take a step without them, the data ends after this
        epoch (`no_step_message` says why)."""
        new = sorted({int(i) for i in rows} - self.set_aside_rows.keys())
        # New dicts, not updates in place: a pass still reading ahead on another thread iterates the old.
        self.set_aside_rows = {**self.set_aside_rows, **{i: {"epoch": int(epoch), "step": int(step)} for i in new}}
        self.sampler.set_aside = {**self.sampler.set_aside, **dict.fromkeys(new, int(epoch))}
        return new

    def no_step_message(self) -> str:
        """Why the data ended: the rows set aside leave no bucket a step's worth of samples."""
        names = "; ".join(self.dataset.describe(i) for i in sorted(self.set_aside_rows))
        return (
            f"no step can be taken once the row(s) whose data holds NaN/inf are set aside ({names}): no bucket "
            f"holds the {self.sampler.group_size} samples a step takes; find such rows with `python -m "
            "fv_accel.data.inspect DATA --check` and preprocess those clips again"
        )

    def skipped_samples(self) -> list[dict]:
        """The rows set aside, in the order they were found: file, row (in the file), id and the step
        that drew each."""
        found = sorted(self.set_aside_rows.items(), key=lambda item: (item[1]["step"], item[0]))
        return [{**self.dataset.row_location(i), "step": record["step"]} for i, record in found]

    def __iter__(self) -> Iterator[dict]:
        # A new pass starts after the last finished step (prefetched batches are not "consumed"),
        # set here on the calling thread (the batches may then be read on another: BatchPrefetcher).
        self.sampler.position = LoaderPosition(self._consumed.epoch, self._consumed.step_in_epoch)
        return self._batches()

    def _batches(self) -> Iterator[dict]:
        loader = DataLoader(
            self.dataset,
            batch_sampler=self.sampler,
            collate_fn=collate,
            num_workers=self.num_workers,
            persistent_workers=False,
            pin_memory=self.pin_memory,
        )
        try:
            for batch in loader:
                yield batch
        except ValueError as err:
            # A row a worker could not read: torch wraps the message in the worker's traceback;
            # raise the row's own one-line message, as without workers.
            own = _worker_error(err)
            if own is err:
                raise
            raise own from None

    def mark_step_done(self, batch: dict) -> None:
        """Record that the optimizer step that used `batch` is finished (for the checkpoint)."""
        self._consumed = LoaderPosition(int(batch["epoch"][0]), int(batch["position"]) + 1)

    def state_dict(self) -> dict:
        return {
            "epoch": self._consumed.epoch,
            "step_in_epoch": self._consumed.step_in_epoch,
            "group_size": self.sampler.group_size,
            "set_aside": [{"index": i, **record} for i, record in sorted(self.set_aside_rows.items())],
        }

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)
        self._consumed = LoaderPosition(self.sampler.position.epoch, self.sampler.position.step_in_epoch)
        self.set_aside_rows = {}
        self.sampler.set_aside = {}
        for record in state.get("set_aside") or []:
            index = int(record["index"])
            if not 0 <= index < len(self.dataset):
                raise ValueError(f"set-aside row {index} is not a row of {self.dataset.data_path} ({len(self.dataset)} rows)")
            self.set_aside_rows[index] = {"epoch": int(record["epoch"]), "step": int(record["step"])}
            self.sampler.set_aside[index] = int(record["epoch"])

    @property
    def epoch(self) -> int:
        return self._consumed.epoch


def build_train_loader(
    cfg, *, world_size: int, rank: int, data_path: Optional[str] = None, exclude_indices: Optional[Sequence[int]] = None
) -> TrainLoader:
    """`exclude_indices`: rows of the (first) dataset the loader must never yield (a held-out split)."""
    data = cfg.training.data
    path = data_path or data.data_path
    # One budget for the run's datasets (a mix's parts share it).
    cache = ItemCache(int(data.cache_gb * 2**30)) if data.cache_gb > 0 else None
    dataset = LatentDataset(
        path, text_max_length=data.text_max_length, cfg_rate=data.training_cfg_rate, seed=data.seed, cache=cache
    )
    weights = None
    if data.mix:
        dataset, weights = _mix_datasets(dataset, data, cache)
    off_shape = shape_filter_exclusions(dataset, data, log=rank == 0)
    if off_shape:
        exclude_indices = sorted(set(exclude_indices or ()) | set(off_shape))
    sampler = BucketBatchSampler(
        [dataset.bucket_key(i) for i in range(len(dataset))],
        batch_size=data.train_batch_size,
        world_size=world_size,
        rank=rank,
        grad_accum=cfg.training.loop.gradient_accumulation_steps,
        seed=data.seed,
        weights=weights,
        exclude_indices=exclude_indices,
    )
    loader = TrainLoader(dataset, sampler, num_workers=data.dataloader_num_workers)
    loader.off_shape_indices = list(off_shape)
    rollout_keys = (data.num_latent_t or data.num_frames, data.num_height, data.num_width)
    if dataset.text_only and None not in rollout_keys:
        loader.rollout_tokens = latent_tokens(rollout_latent_shape(cfg, 1, path))
    return loader


# Wan's VAE: 4x in time (T = (frames - 1) / 4 + 1) and 8x in space.
# The Wan 2.1 VAE's compression: what a dataset without a recorded one was made with.
VAE_TEMPORAL, VAE_SPATIAL = 4, 8


def vae_factors(data_path: Any) -> tuple[int, int]:
    """(temporal, spatial) compression of the VAE that encoded a dataset, as preprocessing recorded it
    in fv_dataset.json (Wan 2.1's 4 and 8 where it did not)."""
    info = read_dataset_info(data_path) if data_path and Path(local_dataset_path(data_path)).exists() else {}
    return int(info.get("scale_factor_temporal") or VAE_TEMPORAL), int(info.get("scale_factor_spatial") or VAE_SPATIAL)


def wanted_latent_shape(data, temporal: int = VAE_TEMPORAL, spatial: int = VAE_SPATIAL) -> dict[str, tuple[str, int]]:
    """The latent sizes the recipe's `training.data.num_latent_t / num_frames / num_height /
    num_width` ask for, for a VAE of this compression: axis of (C, T, H, W) -> (the key, the latent size)."""
    wanted: dict[str, tuple[str, int]] = {}
    if data.num_latent_t is not None:
        wanted["T"] = ("num_latent_t", int(data.num_latent_t))
        if data.num_frames is not None and (int(data.num_frames) - 1) // temporal + 1 != int(data.num_latent_t):
            raise ValueError(
                f"training.data.num_latent_t {data.num_latent_t} contradicts training.data.num_frames "
                f"{data.num_frames}: this data's VAE makes (frames - 1) / {temporal} + 1 = "
                f"{(int(data.num_frames) - 1) // temporal + 1} latent frames; set one of them, or both to agree"
            )
    elif data.num_frames is not None:
        wanted["T"] = ("num_frames", (int(data.num_frames) - 1) // temporal + 1)
    if data.num_height is not None:
        wanted["H"] = ("num_height", int(data.num_height) // spatial)
    if data.num_width is not None:
        wanted["W"] = ("num_width", int(data.num_width) // spatial)
    return wanted


def _shape_text(shape: Sequence[int], temporal: int = VAE_TEMPORAL, spatial: int = VAE_SPATIAL) -> str:
    c, t, h, w = shape
    return f"[{c}, {t}, {h}, {w}] ({(t - 1) * temporal + 1} frames, {h * spatial}x{w * spatial})"


def shape_filter_exclusions(dataset, data, *, log: bool = True) -> list[int]:
    """Rows whose latent shape differs from what `training.data.num_latent_t / num_frames /
    num_height / num_width` ask for (FastVideo recipes carry them): they are left out of training,
    with a warning counting them by shape; none left is an error naming the keys and the shapes found."""
    if getattr(dataset, "text_only", False):
        return []  # no latents: the keys give the rollout's shape (rollout_latent_shape)
    temporal, spatial = vae_factors(getattr(dataset, "data_path", None))
    wanted = wanted_latent_shape(data, temporal, spatial)
    if not wanted:
        return []
    axis = {"T": 1, "H": 2, "W": 3}
    shapes = [dataset_shape for part in (getattr(dataset, "parts", None) or [dataset]) for dataset_shape in part.latent_shapes]
    off = [i for i, shape in enumerate(shapes) if any(shape[axis[a]] != size for a, (_, size) in wanted.items())]
    if not off:
        return []
    asked = ", ".join(f"training.data.{key} {getattr(data, key)}" for key, _ in wanted.values())
    asked += " asks" if len(wanted) == 1 else " ask"
    found = Counter(shapes[i] for i in off)
    listing = ", ".join(f"{n} x {_shape_text(shape, temporal, spatial)}" for shape, n in found.most_common(4))
    more = f" and {len(found) - 4} other shape(s)" if len(found) > 4 else ""
    if len(off) == len(shapes):
        raise ValueError(
            f"{dataset.data_path}: no row has the shape that {asked} for: its latents are {listing}{more}; "
            f"set these keys to the data's sizes, or to null to train on every shape"
        )
    if log:
        logger.warning(
            "%d of %d row(s) left out of training: %s for other sizes than theirs (%s%s); set these keys "
            "to null to train on every shape",
            len(off),
            len(shapes),
            asked,
            listing,
            more,
        )
    return off


class ConcatLatentDataset(Dataset):
    def __init__(self, parts: list[LatentDataset]):
        self.parts = parts
        self.offsets = [0]
        for p in parts:
            p.global_offset = self.offsets[-1]
            self.offsets.append(self.offsets[-1] + len(p))
        self.data_path = "+".join(p.data_path for p in parts)
        kinds = {p.data_path: p.text_only for p in parts}
        if len(set(kinds.values())) > 1:
            text = [path for path, only in kinds.items() if only]
            raise ValueError(
                f"training.data.mix: {', '.join(text)} {'is a text-only dataset' if len(text) == 1 else 'are text-only datasets'} "
                "(prompts without video latents) and the others hold video latents: a run trains on one kind; "
                "mix datasets of one kind"
            )
        self.text_only = parts[0].text_only
        self.preprocessed_data_type = parts[0].preprocessed_data_type

    def __len__(self) -> int:
        return self.offsets[-1]

    def _locate(self, i: int) -> tuple[LatentDataset, int]:
        for k, part in enumerate(self.parts):
            if i < self.offsets[k + 1]:
                return part, i - self.offsets[k]
        raise IndexError(i)

    def bucket_key(self, i: int) -> tuple:
        part, j = self._locate(i)
        return part.bucket_key(j)

    def row_location(self, i: int) -> dict:
        part, j = self._locate(i)
        return part.row_location(j)

    def describe(self, i: int) -> str:
        part, j = self._locate(i)
        return part.describe(j)

    def __getitem__(self, key: Any) -> dict:
        index, epoch, position = key if isinstance(key, tuple) else (key, 0, 0)
        part, j = self._locate(int(index))
        item = part[(j, epoch, position)]
        item["sample_index"] = int(index)
        return item


def _mix_datasets(first: LatentDataset, data, cache: Optional[ItemCache] = None) -> tuple[ConcatLatentDataset, list[float]]:
    parts = [first] + [
        LatentDataset(
            m["data_path"], text_max_length=data.text_max_length, cfg_rate=data.training_cfg_rate, seed=data.seed, cache=cache
        )
        for m in data.mix
    ]
    # A dataset's weight is its share of the draws, spread over its samples.
    shares = [1.0] + [float(m.get("weight", 1.0)) for m in data.mix]
    weights: list[float] = []
    for part, share in zip(parts, shares):
        weights += [share / len(part)] * len(part)
    return ConcatLatentDataset(parts), weights


def latent_tokens(shape: Sequence[int], patch: Sequence[int] = (1, 2, 2)) -> int:
    """Transformer tokens of one latent [C, T, H, W] (for throughput figures)."""
    return math.prod(s // p for s, p in zip(shape[-3:], patch))


ROLLOUT_SHAPE_KEYS = "training.data.num_latent_t (or num_frames), num_height and num_width"


def rollout_latent_shape(cfg, channels: int, data_path: Optional[str] = None) -> list[int]:
    """The latent shape [C, T, H, W] of a student's rollout from noise on a text-only dataset
    (which holds no latent to take it from): `channels` (the student's latent channels,
    ModelBase.in_channels) and the frames, height and width of `training.data.num_latent_t` (or
    `num_frames`), `num_height` and `num_width`, by the compression of the VAE recorded with the
    dataset (`data_path`, default training.data.data_path; Wan 2.1's 4 and 8 where none is). Keys
    left unset, or sides the VAE does not divide, are a ConfigError naming the keys."""
    from fv_accel.config import ConfigError

    data = cfg.training.data
    path = data_path or data.data_path
    temporal, spatial = vae_factors(path if path != "tiny" else None)
    try:
        wanted = wanted_latent_shape(data, temporal, spatial)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    missing = [name for axis, name in (("T", "num_latent_t (or num_frames)"), ("H", "num_height"), ("W", "num_width")) if axis not in wanted]
    if missing:
        raise ConfigError(
            f"training.data.{', '.join(missing)} not set: a rollout from noise on the text-only dataset '{path}' "
            f"takes its latent shape from {ROLLOUT_SHAPE_KEYS} (e.g. num_frames 81, num_height 480, num_width 832)"
        )
    for key in ("num_height", "num_width"):
        if int(getattr(data, key)) % spatial:
            raise ConfigError(
                f"training.data.{key} {getattr(data, key)}: not a multiple of {spatial}, the spatial compression of the "
                f"VAE that encoded '{path}' (its latent would not decode to that size)"
            )
    return [int(channels), wanted["T"][1], wanted["H"][1], wanted["W"][1]]


ROLLOUT_MODES_NEEDING_LATENTS = ("data_latent",)


def check_rollout_data(rollout_mode: str, data: Any) -> None:
    """Refuse a rollout mode that needs video latents (`data_latent`: the student is rolled out from
    the noised data latents) on a text-only dataset, in one line (a ConfigError). `data`: the
    dataset's path (training.data.data_path), or a LatentDataset / ConcatLatentDataset / TrainLoader."""
    from fv_accel.config import ConfigError

    if rollout_mode not in ROLLOUT_MODES_NEEDING_LATENTS:
        return
    if isinstance(data, (str, Path)):
        text_only, path = dataset_is_text_only(data), str(data)
    else:
        dataset = getattr(data, "dataset", data)
        text_only, path = dataset.text_only, dataset.data_path
    if text_only:
        raise ConfigError(
            f"training.data.data_path '{path}' is a text-only dataset (prompts without video latents): "
            f"method.rollout_mode {rollout_mode} needs video latents; use rollout_mode simulate or a dataset "
            "preprocessed from videos"
        )
