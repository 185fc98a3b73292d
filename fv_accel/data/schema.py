"""FastVideo's precomputed-latent Parquet schema (REFERENCE.md section 7), written with `datasets`
(read in place with pyarrow: fv_accel/data/parquet_rows.py).

A row holds the VAE latent [C, T, H, W] and the text embedding [L, D] as raw bytes with their shape
and dtype, plus the clip's metadata. Datasets preprocessed by FastVideo load unchanged. A text-only
dataset (prompts, for training that rolls the student out from noise) has the text columns alone.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import numpy as np
import torch

LATENT_COLUMNS = ("vae_latent_bytes", "vae_latent_shape", "vae_latent_dtype")
TEXT_EMBEDDING_COLUMNS = ("text_embedding_bytes", "text_embedding_shape", "text_embedding_dtype")
REQUIRED_COLUMNS = LATENT_COLUMNS + TEXT_EMBEDDING_COLUMNS
# FastVideo's `preprocessed_data_type` of a dataset of prompts alone: rows of text columns (and `id`,
# `caption`), no VAE latent. fv_dataset.json records it; FastVideo's own such datasets are known by
# their columns.
TEXT_ONLY = "text_only"
METADATA_COLUMNS = ("id", "file_name", "caption", "media_type", "width", "height", "num_frames", "duration_sec", "fps")
# FastVideo's image-to-video columns (each as <name>_bytes/_shape/_dtype): the normalised latent of
# [first frame, zero frames] [C, T, H, W], the CLIP image features [L, D] and the first frame, uint8
# [H, W, 3]. Optional: text-to-video rows lack them, and FastVideo writes empty bytes for a feature
# its model has none of (clip_feature of Wan 2.2).
CONDITIONING_COLUMNS = ("first_frame_latent", "clip_feature", "pil_image", "audio_latent", "audio_present")
# Text columns some families add beside `text_embedding` (each as <name>_bytes/_shape/_dtype): a
# pooled text embedding [D] (HunyuanVideo's CLIP) and a second text encoder's sequence [L2, D2].
TEXT_COLUMNS = ("pooled_text_embedding", "text_embedding_2", "audio_text_embedding")


def tensor_column_names() -> tuple[str, ...]:
    """Every tensor a row may hold (each stored as <name>_bytes/_shape/_dtype)."""
    return ("vae_latent", "text_embedding", *CONDITIONING_COLUMNS, *TEXT_COLUMNS)


_DTYPES = {
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": "bfloat16",
    "float64": np.float64,
    "uint8": np.uint8,
}


def tensor_to_bytes(t: torch.Tensor) -> tuple[bytes, list[int], str]:
    t = t.detach().cpu().contiguous()
    dtype = str(t.dtype).replace("torch.", "")
    if t.dtype == torch.bfloat16:
        raw = t.view(torch.int16).numpy().tobytes()
    else:
        raw = t.numpy().tobytes()
    return raw, list(t.shape), dtype


def dtype_itemsize(dtype: Any) -> Optional[int]:
    """Bytes per value of a stored dtype name ("float32", "torch.bfloat16", ...), None if unsupported."""
    key = str(dtype).replace("torch.", "")
    if key not in _DTYPES:
        return None
    return 2 if key == "bfloat16" else int(np.dtype(_DTYPES[key]).itemsize)


def stored_size_problem(num_bytes: int, shape: Sequence[int], dtype: Any) -> Optional[str]:
    """Why `num_bytes` of `dtype` cannot hold `shape`, or None when they fit."""
    itemsize = dtype_itemsize(dtype)
    if itemsize is None:
        return f"unsupported dtype {dtype!r}; expected one of {', '.join(_DTYPES)}"
    expected = int(np.prod([int(s) for s in shape])) * itemsize
    if num_bytes != expected:
        return f"{num_bytes} bytes stored for shape {[int(s) for s in shape]} of {dtype} ({expected} bytes expected)"
    return None


def bytes_to_tensor(raw: bytes, shape: Iterable[int], dtype: str, *, where: str = "") -> torch.Tensor:
    shape = [int(s) for s in shape]
    key = str(dtype).replace("torch.", "")
    problem = stored_size_problem(len(raw), shape, key)
    if problem:
        raise ValueError(f"{where}{problem}")
    if key == "bfloat16":
        arr = np.frombuffer(raw, dtype=np.int16)
        t = torch.from_numpy(arr.copy()).view(torch.bfloat16)
    else:
        arr = np.frombuffer(raw, dtype=_DTYPES[key])
        t = torch.from_numpy(arr.copy())
    return t.reshape(shape)


def tensor_columns(name: str, t: torch.Tensor) -> dict:
    """`<name>_bytes`, `<name>_shape`, `<name>_dtype` of a tensor, as FastVideo stores one."""
    raw, shape, dtype = tensor_to_bytes(t)
    return {f"{name}_bytes": raw, f"{name}_shape": shape, f"{name}_dtype": dtype}


def read_tensor_column(row: dict, name: str, *, where: str = "") -> Optional[torch.Tensor]:
    """The tensor stored under `name` in a row, or None when the row has no such column or empty bytes."""
    raw = row.get(f"{name}_bytes")
    if not raw:
        return None
    return bytes_to_tensor(raw, row.get(f"{name}_shape") or [], row.get(f"{name}_dtype") or "", where=f"{where}{name}: ")


def make_row(
    *,
    sample_id: str,
    latent: torch.Tensor,
    text_embedding: torch.Tensor,
    caption: str,
    file_name: str = "",
    media_type: str = "video",
    width: int = 0,
    height: int = 0,
    num_frames: int = 0,
    duration_sec: float = 0.0,
    fps: float = 0.0,
    **extra: Any,
) -> dict:
    lb, ls, ld = tensor_to_bytes(latent)
    tb, ts, td = tensor_to_bytes(text_embedding)
    row = {
        "id": sample_id,
        "vae_latent_bytes": lb,
        "vae_latent_shape": ls,
        "vae_latent_dtype": ld,
        "text_embedding_bytes": tb,
        "text_embedding_shape": ts,
        "text_embedding_dtype": td,
        "file_name": file_name,
        "caption": caption,
        "media_type": media_type,
        "width": int(width),
        "height": int(height),
        "num_frames": int(num_frames),
        "duration_sec": float(duration_sec),
        "fps": float(fps),
    }
    row.update(extra)
    return row


def make_text_row(*, sample_id: str, text_embedding: torch.Tensor, caption: str, file_name: str = "", **extra: Any) -> dict:
    """A row of a text-only dataset: the text embedding [L, D] (and the family's other text
    columns in `extra`), no VAE latent; `media_type` 'text', as FastVideo marks text rows."""
    row = {"id": sample_id, **tensor_columns("text_embedding", text_embedding), "file_name": file_name, "caption": caption, "media_type": "text"}
    row.update(extra)
    return row


# Row groups of at most this many bytes (or 1000 rows): the loader decodes a row's whole row group to
# read it, so at Wan 1.3B shapes (8.4 MB a row) each row is its own row group.
ROW_GROUP_BYTES = 16 * 10**6


def row_group_rows(rows: Sequence[dict]) -> int:
    """Rows per Parquet row group for these rows: ROW_GROUP_BYTES of their binary columns, 1 to 1000."""
    stored = sum(len(v) for row in rows for v in row.values() if isinstance(v, (bytes, bytearray)))
    per_row = max(1, stored // max(1, len(rows)))
    return max(1, min(1000, ROW_GROUP_BYTES // per_row))


def write_rows(rows: list[dict], path: str | Path) -> Path:
    """Write rows as one Parquet shard (through a temporary name, so a crash leaves no partial file),
    in row groups of `row_group_rows(rows)` rows."""
    import datasets

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name("." + path.name + ".tmp")
    # No progress bar per shard (preprocessing writes one small file per clip).
    was_disabled = datasets.utils.are_progress_bars_disabled()
    datasets.utils.disable_progress_bars()
    try:
        datasets.Dataset.from_list(rows).to_parquet(str(tmp), batch_size=row_group_rows(rows))
    finally:
        if not was_disabled:
            datasets.utils.enable_progress_bars()
    tmp.replace(path)
    return path


DATASET_INFO = "fv_dataset.json"


def write_dataset_info(folder: str | Path, *, model: str, latent_stats: Optional[tuple] = None, **extra: Any) -> Path:
    """Record which model encoded a dataset, with its latent statistics (per-channel mean, std, as
    the model family normalises), beside the shards."""
    import json

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    mean, std = latent_stats if latent_stats else (None, None)
    info = {
        "model": model,
        "latents_mean": [float(v) for v in mean] if mean else None,
        "latents_std": [float(v) for v in std] if std else None,
        **extra,
    }
    path = folder / DATASET_INFO
    tmp = path.with_name("." + path.name + ".tmp")  # never a half-written file under the real name
    tmp.write_text(json.dumps(info, indent=2) + "\n")
    tmp.replace(path)
    return path


def read_dataset_info(data_path: str | Path) -> dict:
    import json

    p = Path(local_dataset_path(data_path))
    path = (p if p.is_dir() else p.parent) / DATASET_INFO
    if not path.is_file():
        return {}
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({err}); rerun preprocessing to write it again") from None
    if not isinstance(info, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(info).__name__}")
    return info


def columns_are_text_only(column_names: Sequence[str]) -> bool:
    """Rows with the text embedding columns and none of the VAE latent's: a text-only dataset."""
    names = set(column_names)
    return not names & set(LATENT_COLUMNS) and set(TEXT_EMBEDDING_COLUMNS) <= names


def dataset_is_text_only(data_path: str | Path) -> bool:
    """Whether a dataset holds prompts without video latents: its fv_dataset.json records
    `preprocessed_data_type: text_only`, or (a dataset without one, such as FastVideo's) its first
    Parquet file has text embedding columns and no VAE latent columns. The built-in "tiny" dataset is
    of video latents; a path that does not exist is an error naming it."""
    import pyarrow.parquet as pq

    if str(data_path) == "tiny":
        return False
    recorded = read_dataset_info(data_path).get("preprocessed_data_type")
    if recorded is not None:
        return recorded == TEXT_ONLY
    first = parquet_files(data_path)[0]
    try:
        names = pq.read_schema(first).names
    except Exception as err:  # noqa: BLE001 - pyarrow raises ArrowInvalid/OSError for a bad footer
        detail = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(f"{first}: not a readable Parquet file ({detail}); remove it, or rerun preprocessing to write it again") from None
    return columns_are_text_only(names)


# Beside the shards: the text columns of the prompt the model's pipeline encodes for its
# unconditional (classifier-free guidance) branch, real tokens only, with the prompt in the file's
# metadata; caption dropout (`training.data.training_cfg_rate`) trains on them (fv_accel/data/loader.py).
UNCONDITIONAL_FILE = "unconditional_text.safetensors"


def write_unconditional_text(folder: str | Path, columns: dict[str, torch.Tensor], *, prompt: str, fingerprint: str = "") -> Path:
    """Write the unconditional text columns ([L, D] sequences, [D] pooled) beside a dataset's shards,
    through a temporary name (never a half-written file under the real one)."""
    from safetensors.torch import save_file

    path = Path(folder) / UNCONDITIONAL_FILE
    tmp = path.with_name("." + path.name + ".tmp")
    tensors = {name: value.detach().to(torch.float32).cpu().contiguous() for name, value in columns.items()}
    save_file(tensors, str(tmp), metadata={"prompt": prompt, "fingerprint": fingerprint})
    tmp.replace(path)
    return path


def unconditional_text_metadata(data_path: str | Path) -> Optional[dict]:
    """The metadata (prompt, fingerprint) of a dataset's unconditional text file, None without one."""
    from safetensors import safe_open

    path = _dataset_folder(data_path) / UNCONDITIONAL_FILE
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except Exception:  # noqa: BLE001 - not a safetensors file: written again by preprocessing
        return None


def read_unconditional_text(data_path: str | Path) -> Optional[dict[str, torch.Tensor]]:
    """The unconditional text columns of a dataset (fp32), None when it has no such file; a file that
    is not safetensors is an error naming it."""
    from safetensors.torch import load_file

    path = _dataset_folder(data_path) / UNCONDITIONAL_FILE
    if not path.is_file():
        return None
    try:
        return {name: value.float() for name, value in load_file(str(path)).items()}
    except Exception as err:  # noqa: BLE001 - safetensors raises its own error types for a bad header
        detail = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(
            f"{path}: not a readable safetensors file ({detail}); rerun the preprocess command that made the dataset"
        ) from None


def _dataset_folder(data_path: str | Path) -> Path:
    p = Path(local_dataset_path(data_path))
    return p if p.is_dir() else p.parent


# Preprocessing's own names (fv_accel/preprocess.py): its shards, and its folder of rows in progress.
SHARD_RE = re.compile(r"^data-(\d{5})-of-(\d{5})\.parquet$")
PENDING_DIR = ".fv_pending"
# The command that started preprocessing, kept in PENDING_DIR until it finishes (to say how to resume).
PENDING_COMMAND = "command.txt"


class IncompleteDatasetError(ValueError):
    """A dataset folder that preprocessing has not finished (or of which shards are missing)."""


HF_PREFIX = "hf://"


def local_dataset_path(data_path: str | Path) -> str:
    """A dataset path as a local folder: `hf://<owner>/<name>[/<subfolder>]` is that dataset
    repository's snapshot in the local Hugging Face cache (never downloaded: offline), and a repository's
    cache folder (`.../datasets--<owner>--<name>`) is its snapshot of `refs/main`. Other paths are
    returned as they are."""
    text = str(data_path)
    if text.startswith(HF_PREFIX):
        parts = [p for p in text[len(HF_PREFIX) :].split("/") if p]
        if len(parts) < 2:
            raise FileNotFoundError(f"training.data.data_path: '{text}': expected hf://<owner>/<name>[/<subfolder>]")
        repo_id, sub = "/".join(parts[:2]), parts[2:]
        from huggingface_hub import snapshot_download

        try:
            folder = Path(snapshot_download(repo_id, repo_type="dataset", local_files_only=True))
        except Exception:  # noqa: BLE001 - LocalEntryNotFoundError and kin: not in the cache
            from huggingface_hub import constants

            raise FileNotFoundError(
                f"training.data.data_path: '{text}': the dataset repository {repo_id} is not in the local Hugging Face "
                f"cache ({constants.HF_HUB_CACHE}); download it first: hf download --repo-type dataset {repo_id}"
            ) from None
        return str(folder.joinpath(*sub))
    p = Path(text)
    ref = p / "refs" / "main"
    if p.name.startswith("datasets--") and (p / "snapshots").is_dir() and ref.is_file():
        return str(p / "snapshots" / ref.read_text(encoding="utf-8").strip())
    return text


def parquet_files(data_path: str | Path) -> list[str]:
    p = Path(local_dataset_path(data_path))
    if p.is_file():
        return [str(p)]
    if p.is_dir():
        # Hidden files and folders (temporary files, preprocessing's pending rows) are not data.
        files = sorted(
            str(f) for f in p.rglob("*.parquet") if not any(part.startswith(".") for part in f.relative_to(p).parts)
        )
        if files:
            check_dataset_complete(p, files)
            return files
        raise FileNotFoundError(f"training.data.data_path: no .parquet files under '{p}'")
    raise FileNotFoundError(f"training.data.data_path: '{p}' does not exist")


def _resume_hint(folder: Path) -> str:
    marker = folder / PENDING_DIR / PENDING_COMMAND
    command = marker.read_text(encoding="utf-8").strip() if marker.is_file() else ""
    if command:
        return f"finish it by rerunning the same command (it resumes where it stopped): {command}"
    return (
        "finish it by rerunning the same `python -m fv_accel.preprocess ... --output "
        f"{folder}` command (it resumes where it stopped)"
    )


def check_dataset_complete(folder: Path, files: Sequence[str]) -> None:
    """Refuse a folder that preprocessing left unfinished: its pending-rows folder is still there,
    or (without the fv_dataset.json that preprocessing writes last) its `-of-N` shard set has gaps.
    A finished dataset may lack shard numbers: a shard whose clips were all skipped is not written."""
    folder = Path(folder)
    pending = folder / PENDING_DIR
    if pending.is_dir():
        rows = sum(1 for f in pending.glob("*.parquet"))
        raise IncompleteDatasetError(
            f"{folder}: the dataset is incomplete: preprocessing has not finished ({PENDING_DIR}/ is still "
            f"there, {rows} encoded clip(s) not yet in a shard, and {DATASET_INFO} is missing); {_resume_hint(folder)}"
        )
    if (folder / DATASET_INFO).is_file():
        return
    shards: dict[int, set[int]] = {}
    for f in files:
        m = SHARD_RE.match(Path(f).name)
        if m and Path(f).parent == folder:
            shards.setdefault(int(m.group(2)), set()).add(int(m.group(1)))
    for total, present in sorted(shards.items()):
        missing = [i for i in range(total) if i not in present]
        if missing or len(shards) > 1:
            what = (
                f"shard(s) {', '.join(f'{i:05d}' for i in missing[:8])}{' ...' if len(missing) > 8 else ''} "
                f"of data-*-of-{total:05d} are missing"
                if missing
                else f"shard sets of {' and '.join(str(n) for n in sorted(shards))} files are mixed"
            )
            raise IncompleteDatasetError(
                f"{folder}: the dataset is incomplete: {what} ({len(present)} of {total} present) and "
                f"{DATASET_INFO}, which preprocessing writes last, is missing; {_resume_hint(folder)}"
            )


def parquet_row_counts(files: Sequence[str]) -> list[int]:
    """Rows of each Parquet file, from its footer (nothing is loaded); a file that is not Parquet
    (0 bytes, garbage, cut short) is an error naming it."""
    import pyarrow.parquet as pq

    counts = []
    for f in files:
        try:
            counts.append(int(pq.ParquetFile(f).metadata.num_rows))
        except Exception as err:  # noqa: BLE001 - pyarrow raises ArrowInvalid/OSError for a bad footer
            detail = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise ValueError(
                f"{f}: not a readable Parquet file ({detail}); remove it, or rerun preprocessing to write it again"
            ) from None
    return counts
