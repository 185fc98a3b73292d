"""Checks of a latent dataset made before training starts, each failing in one line that names the
file, the row and the value: rows whose stored bytes cannot be what their shape says, empty text
embeddings, and (given the transformer's numbers) latents or text the model cannot take.

Only the shape and dtype columns are read at open; the byte lengths too on a small dataset
(BYTE_CHECK_LIMIT), since Parquet keeps no per-value lengths outside the data pages. On a larger
dataset a row's byte lengths are checked when it is read, with the same message.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional, Sequence

from fv_accel.data.schema import stored_size_problem


def _first_problem(rows: Iterator[tuple[int, Optional[str]]], describe: Callable[[int], str]) -> None:
    """Raise for the first row with a problem, counting the rows with any."""
    first: Optional[tuple[int, str]] = None
    count = 0
    for i, problem in rows:
        if problem:
            count += 1
            if first is None:
                first = (i, problem)
    if first is not None:
        more = f" ({count - 1} more row(s) with problems)" if count > 1 else ""
        raise ValueError(f"{describe(first[0])}: {first[1]}{more}")


def _shape_problem(shape: Any, column: str, expected: str, ndims: Sequence[int]) -> Optional[str]:
    if shape is None or len(shape) not in ndims or any(s is None or int(s) < 0 for s in shape):
        return f"{column} {shape}; expected {expected}"
    return None


# A byte length not read at open (checked when the row is read).
UNCHECKED = -1


def row_problem(latent: Optional[tuple], text: tuple) -> Optional[str]:
    """What is wrong with a row's latent and text embedding as stored, or None. latent / text:
    (shape, dtype, number of bytes, or UNCHECKED) of one row; latent None for a row of a text-only
    dataset."""
    problem = None
    if latent is not None:
        problem = _shape_problem(latent[0], "vae_latent_shape", "[C, T, H, W]", (4,))
        if problem is None and min(int(s) for s in latent[0]) < 1:
            problem = f"vae_latent_shape {list(latent[0])}: the latent is empty"
    if problem is None:
        problem = _shape_problem(text[0], "text_embedding_shape", "[L, D] (or [1, L, D])", (2, 3))
    if problem is None and len(text[0]) == 3 and int(text[0][0]) != 1:
        problem = f"text_embedding_shape {list(text[0])}; expected [L, D] (or [1, L, D])"
    if problem is None and min(int(s) for s in text[0][-2:]) < 1:
        problem = (
            f"text_embedding_shape {list(text[0])}: the text embedding is empty (it would train on zeros); "
            "encode the caption again (rerun preprocessing)"
        )
    for column, stored in (("vae_latent_bytes", latent), ("text_embedding_bytes", text)):
        if problem is None and stored is not None:
            shape, dtype, nbytes = stored
            if nbytes is None:
                problem = f"{column} is missing (null)"
            elif nbytes == UNCHECKED:
                problem = _dtype_problem(dtype, column)
            else:
                size = stored_size_problem(int(nbytes), shape, dtype)
                problem = f"{column}: {size}" if size else None
    return problem


# Up to this many bytes of latents and text embeddings (uncompressed, from the footers), an open
# reads every row's byte lengths to check them (LatentDataset passes it to ParquetRows); above it
# each row's are checked when it is read.
BYTE_CHECK_LIMIT = 64 * 2**20
LENGTH_COLUMNS = ("vae_latent_bytes", "text_embedding_bytes")


def byte_lengths_checked_at_open(dataset: Any) -> bool:
    """Whether opening `dataset` (a LatentDataset) checked every row's byte lengths (small datasets)."""
    return dataset.rows.lengths is not None


def _dtype_problem(dtype: Any, column: str) -> Optional[str]:
    # A shape of no values needs 0 bytes: only the dtype can be wrong.
    problem = stored_size_problem(0, [0], dtype)
    return f"{column}: {problem}" if problem else None


def check_stored_rows(dataset: Any) -> None:
    """Every row's latent (none in a text-only dataset) and text embedding must have a shape and
    dtype it can be read as, and (on a dataset of at most BYTE_CHECK_LIMIT bytes) the bytes that
    shape and dtype take.

    `dataset`: a `LatentDataset` (its `rows`, `describe`, `text_only`)."""
    rows = dataset.rows

    def columns(prefix: str) -> list[tuple]:
        shapes = rows.columns[f"{prefix}_shape"]
        dtypes = rows.columns[f"{prefix}_dtype"]
        nbytes = rows.lengths[f"{prefix}_bytes"] if rows.lengths is not None else [UNCHECKED] * len(shapes)
        return list(zip(shapes, dtypes, nbytes))

    # Rows of a dataset share few (shape, dtype, length) combinations: each is judged once.
    judged: dict[tuple, Optional[str]] = {}

    def problem(lat: Optional[tuple], txt: tuple) -> Optional[str]:
        key = tuple(tuple(v) if isinstance(v, list) else v for v in (*(lat or ()), *txt))
        if key not in judged:
            judged[key] = row_problem(lat, txt)
        return judged[key]

    texts = columns("text_embedding")
    latents = [None] * len(texts) if dataset.text_only else columns("vae_latent")
    _first_problem(((i, problem(lat, txt)) for i, (lat, txt) in enumerate(zip(latents, texts))), dataset.describe)


def check_fits_model(
    dataset: Any,
    *,
    in_channels: Optional[int] = None,
    text_dim: Optional[int] = None,
    patch_size: Optional[Sequence[int]] = None,
    chunk_size: Optional[int] = None,
) -> None:
    """What the transformer can take: latent channels (`in_channels`), text width (`text_dim`),
    latent frames/height/width divisible by its patch (`patch_size`), and a DFSFT chunk no longer
    than the clip. `dataset`: a LatentDataset, or a ConcatLatentDataset of several (`parts`). The
    rows of a text-only dataset have no latent: their text width alone is checked."""
    from fv_accel.config import ConfigError

    parts = getattr(dataset, "parts", None) or [dataset]
    for part in parts:
        text_shapes = getattr(part, "text_shapes", None)
        describe = getattr(part, "describe", None) or (lambda i, p=part: f"{p.data_path} row {i}")
        if getattr(part, "text_only", False):
            for i in range(len(text_shapes or [])):
                _check_text_width(describe(i), text_shapes[i], text_dim)
            continue
        for i, shape in enumerate(part.latent_shapes):
            where = describe(i)
            if len(shape) != 4:
                raise ConfigError(f"{where}: vae_latent_shape {list(shape)}; expected [C, T, H, W]")
            if in_channels is not None and shape[0] != in_channels:
                raise ConfigError(
                    f"{where}: latents have {shape[0]} channels (shape {list(shape)}) but the student "
                    f"transformer expects {in_channels} (in_channels); encode the data with the model's own VAE"
                )
            if patch_size is not None:
                for axis, size, patch in zip(("frame count", "height", "width"), shape[1:], patch_size):
                    if int(patch) > 1 and size % int(patch):
                        raise ConfigError(
                            f"{where}: latent {axis} {size} (vae_latent_shape {list(shape)}) is not divisible by "
                            f"the student transformer's patch size {list(patch_size)}; preprocess with frame "
                            f"sides that are multiples of {8 * int(patch)} pixels (e.g. --buckets 480x832)"
                        )
            if chunk_size is not None and chunk_size > shape[1]:
                raise ConfigError(
                    f"method.chunk_size ({chunk_size}) is larger than the latent frame count ({shape[1]}) of "
                    f"{where} (shape {list(shape)}); use a chunk size <= {shape[1]} or longer clips"
                )
            if text_shapes is not None:
                _check_text_width(where, text_shapes[i], text_dim)


def _check_text_width(where: str, text_shape: Sequence[int], text_dim: Optional[int]) -> None:
    from fv_accel.config import ConfigError

    if text_dim is not None and int(text_shape[-1]) != text_dim:
        raise ConfigError(
            f"{where}: text embeddings are {text_shape[-1]} wide (text_embedding_shape "
            f"{list(text_shape)}) but the student transformer takes {text_dim} (text_dim); "
            "encode the captions with the model's own text encoder"
        )
