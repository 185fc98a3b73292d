"""Preprocess real clips into the precomputed-latent dataset the trainer reads.

    python -m fv_accel.preprocess --model Wan-AI/Wan2.1-T2V-1.3B-Diffusers --input clips/ --output data/latents
    python -m fv_accel.preprocess --model Wan-AI/Wan2.1-T2V-1.3B-Diffusers --prompts prompts.txt --output data/prompts
    accelerate launch -m fv_accel.preprocess --model ... --input ... --output ...   # clips sharded over processes

Input: a folder of videos/images with a same-named .txt caption beside each; a CSV or JSONL
metadata file (or a folder holding metadata.csv / metadata.jsonl) with a `video`/`file_name` column
and a `caption`/`prompt` column; or a Hugging Face dataset (a `save_to_disk` folder, a folder of
data files, or a Hub id in the local cache) with a video column and a caption column.

Output: FastVideo-schema Parquet shards `data-SSSSS-of-NNNNN.parquet` (clip i goes to shard
i // shard_size, in input order), `fv_dataset.json` (model and VAE latent statistics),
`unconditional_text.safetensors` (the encoding of the prompt the model's pipeline gives its
unconditional branch, which caption dropout trains on) and `skipped.jsonl` (every clip left out,
with its path and reason). Captions are encoded as the model's pipeline encodes a prompt (the Wan
family's text cleaning included); the `caption` column holds the text that was encoded.

Nothing is lost to an interruption but the clip in flight: each encoded clip is written at once
(atomically) to `.fv_pending/<key>.parquet`, where the key hashes the clip's bytes, its caption and
the settings; a shard is assembled when its clips are done. A rerun reuses every row whose key it
finds and encodes only the rest, so it ends with the same dataset as an uninterrupted run.

Prompts-only mode (`--prompts prompts.txt|prompts.csv` instead of `--input`): a text-only dataset
(FastVideo's `preprocessed_data_type: text_only`) for methods that roll the student out from noise:
one row per prompt with the text columns alone, keyed, kept and resumed as clips' rows are.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import torch

from fv_accel.data.audio import AUDIO_MISSING, AUDIO_NOTES_PENDING, audio_report, audio_summary, encode_clip_audio, note_clip_audio
from fv_accel.data.schema import (
    DATASET_INFO,
    PENDING_COMMAND,
    PENDING_DIR,
    SHARD_RE,
    TEXT_ONLY,
    make_row,
    make_text_row,
    tensor_columns,
    unconditional_text_metadata,
    write_dataset_info,
    write_rows,
    write_unconditional_text,
)
from fv_accel.data.video import (
    MEDIA_EXTENSIONS,
    ClipError,
    FrameSampling,
    content_hash,
    is_image,
    parse_buckets,
    read_clip,
)

logger = logging.getLogger(__name__)

SKIPPED_FILE = "skipped.jsonl"
VIDEO_COLUMNS = ("video", "file_name", "video_path", "path", "image")
CAPTION_COLUMNS = ("caption", "prompt", "text")
# Files that may sit beside clips without being clips (not reported as unsupported).
SIDE_FILE_EXTENSIONS = (".txt", ".md", ".json", ".jsonl", ".csv", ".yaml", ".yml")
METADATA_NAMES = ("metadata.csv", "metadata.jsonl")
SETTINGS_VERSION = 3  # raised whenever the same settings would decode a clip differently


class InputError(ValueError):
    """The input as a whole cannot be used (no clips, wrong columns); the message says what was expected."""


EXPECTED_INPUT = (
    "expected a folder of videos/images with a same-named .txt caption beside each, a CSV or JSONL "
    f"metadata file with a video column ({'/'.join(VIDEO_COLUMNS[:2])}) and a caption column "
    f"({'/'.join(CAPTION_COLUMNS[:2])}), or a Hugging Face dataset (folder or id)"
)


# --------------------------------------------------------------------------------------------
# Input listing
# --------------------------------------------------------------------------------------------


@dataclass
class ClipSource:
    """One input clip: where its bytes are, its caption, or the problem found while listing it."""

    index: int
    name: str  # relative path (or "row N" for bytes without a name): the row's id and file_name
    path: Optional[Path] = None
    fetch: Optional[Callable[[], bytes]] = None  # bytes held by a Hugging Face dataset
    caption: Optional[str] = None
    problem: Optional[tuple[str, str]] = None  # (reason, detail)

    def payload(self) -> Union[Path, bytes]:
        return self.path if self.path is not None else self.fetch()


def _caption_problem(caption: Any) -> Optional[tuple[str, str]]:
    if caption is None:
        return ("missing_caption", "no caption")
    if not isinstance(caption, str):
        return ("missing_caption", f"the caption is a {type(caption).__name__}, not text")
    if not caption.strip():
        return ("empty_caption", "the caption is empty")
    return None


def _extension_problem(name: str) -> Optional[tuple[str, str]]:
    ext = Path(name).suffix.lower()
    if ext not in MEDIA_EXTENSIONS:
        return ("unsupported_extension", f"extension '{ext or '(none)'}' is not one of {' '.join(MEDIA_EXTENSIONS)}")
    return None


def _visible_files(root: Path) -> list[Path]:
    return [f for f, problem in folder_entries(root) if problem is None]


def _unfollowable_link(link: Path) -> tuple[str, str]:
    """('dangling_link', detail) for a symbolic link that leads nowhere."""
    try:
        os.stat(link)
        why = "it resolves now"
    except OSError as err:
        why = err.strerror or err.__class__.__name__
    return ("dangling_link", f"a symbolic link to '{os.readlink(link)}' that cannot be followed ({why})")


def folder_entries(root: Path) -> list[tuple[Path, Optional[tuple[str, str]]]]:
    """Every visible file under `root` (no part of its path starts with '.'), in path order, links
    to folders followed: (path, None), or (path, (reason, detail)) for a link that is not followed:
    'dangling_link' (it leads nowhere), 'link_loop' (to a folder that contains it: following it
    would never end) or 'link_to_listed_folder' (to a folder listed already under another path).
    Real folders are listed before linked ones, so a clip is named by its real path where it has one."""
    entries: list[tuple[Path, Optional[tuple[str, str]]]] = []
    listed: dict[tuple[int, int], Path] = {}  # (device, inode) of each folder listed -> its path
    links: list[Path] = []

    def walk(top: Path) -> None:
        for here, dirnames, filenames in os.walk(top):  # does not descend into links: they are queued
            st = os.stat(here)
            listed.setdefault((st.st_dev, st.st_ino), Path(here))
            dirnames[:] = sorted(n for n in dirnames if not n.startswith("."))
            links.extend(Path(here, n) for n in dirnames if os.path.islink(os.path.join(here, n)))
            for n in filenames:
                f = Path(here, n)
                if not n.startswith(".") and (f.is_file() or f.is_symlink()):
                    entries.append((f, None if f.is_file() else _unfollowable_link(f)))

    walk(root)
    while links:
        link = links.pop(0)
        st = os.stat(link)
        seen = listed.get((st.st_dev, st.st_ino))
        if seen is None:
            walk(link)
            continue
        where = seen.relative_to(root).as_posix() if seen.is_relative_to(root) else str(seen)
        # A loop: the link leads back to a folder on its own path (as listed, links included).
        on_its_path = [p for p in link.parents if p == root or p.is_relative_to(root)]
        if any(os.path.samefile(p, link) for p in on_its_path):
            entries.append((link, ("link_loop", f"a link to the folder '{where}' that holds it: not followed (a loop)")))
        else:
            entries.append((link, ("link_to_listed_folder", f"a link to the folder '{where}', listed already: not followed")))
    return sorted(entries, key=lambda e: e[0])


def read_caption_file(path: Path, encoding: str = "utf-8") -> tuple[Optional[str], Optional[tuple[str, str]]]:
    """(caption, None), or (None, (reason, detail)) for a caption file not in `encoding`: never a
    caption with replacement characters in it."""
    import codecs

    raw = path.read_bytes()
    utf8 = codecs.lookup(encoding).name == "utf-8"
    try:
        return raw.decode("utf-8-sig" if utf8 else encoding).strip(), None
    except UnicodeDecodeError as err:
        bad = raw[err.start : err.end].hex(" ")
        return None, (
            "caption_not_utf8" if utf8 else "caption_not_decodable",
            f"{path.name} is not valid {encoding} (byte {bad} at offset {err.start}); pass --caption_encoding "
            f"with the file's encoding (e.g. latin-1), or save it as UTF-8",
        )


def list_folder(root: Path, caption_encoding: str = "utf-8") -> list[ClipSource]:
    clips: list[ClipSource] = []
    unsupported = []
    for f, link_problem in folder_entries(root):
        ext = f.suffix.lower()
        if ext in SIDE_FILE_EXTENSIONS and not f.is_dir():
            continue
        rel = f.relative_to(root).as_posix()
        if link_problem is not None:
            clips.append(ClipSource(len(clips), rel, path=f, problem=link_problem))
            continue
        if ext not in MEDIA_EXTENSIONS:
            unsupported.append(ext or "(none)")
            clips.append(ClipSource(len(clips), rel, path=f, problem=_extension_problem(rel)))
            continue
        caption_file = f.with_suffix(".txt")
        caption, problem = read_caption_file(caption_file, caption_encoding) if caption_file.is_file() else (None, None)
        problem = problem or _caption_problem(caption)
        if problem and problem[0] == "missing_caption":
            problem = ("missing_caption", f"no caption file {caption_file.name} beside the clip")
            if caption_file.is_symlink():
                problem = ("missing_caption", f"{caption_file.name}: {_unfollowable_link(caption_file)[1]}")
        clips.append(ClipSource(len(clips), rel, path=f, caption=caption, problem=problem))
    if not any(c.problem is None or c.problem[0] != "unsupported_extension" for c in clips):
        found = f"; found only files with unsupported extensions ({', '.join(sorted(set(unsupported)))})" if unsupported else ""
        raise InputError(f"{root}: no video or image files ({' '.join(MEDIA_EXTENSIONS)}){found}; {EXPECTED_INPUT}")
    return clips


def _pick_column(columns: Sequence[str], wanted: Optional[str], candidates: Sequence[str], what: str, where: str) -> str:
    if wanted:
        if wanted not in columns:
            raise InputError(f"{where}: no column '{wanted}' ({what}); columns found: {', '.join(columns) or '(none)'}")
        return wanted
    for name in candidates:
        if name in columns:
            return name
    raise InputError(
        f"{where}: no {what} column: expected one of {', '.join(repr(c) for c in candidates)}, "
        f"found columns {', '.join(repr(c) for c in columns) or '(none)'}"
    )


def _decode_text_file(path: Path, encoding: str = "utf-8", expected: str = EXPECTED_INPUT) -> str:
    """A metadata or prompts file's text. Binary content (a NUL byte: a video, an archive) is an
    InputError saying so; bytes not in `encoding` are one naming the line."""
    import codecs

    raw = path.read_bytes()
    name = codecs.lookup(encoding).name
    wide = name.startswith(("utf-16", "utf-32"))  # NUL bytes are part of their text
    try:
        text = raw.decode("utf-8-sig" if name == "utf-8" else encoding)
    except UnicodeDecodeError as err:
        if not wide and b"\0" in raw:
            _refuse_binary(path, raw.index(b"\0"), expected)
        line = raw[: err.start].count(b"\n") + 1
        raise InputError(
            f"{path} line {line}: not valid {encoding} (byte {raw[err.start:err.end].hex(' ')}); pass "
            "--caption_encoding with the file's encoding (e.g. latin-1), or save it as UTF-8"
        ) from None
    if "\0" in text:
        _refuse_binary(path, raw.index(b"\0") if not wide else text.index("\0"), expected)
    return text


def _refuse_binary(path: Path, offset: int, expected: str) -> None:
    ext = path.suffix.lower()
    what = f"a video or image file ({ext})" if ext in MEDIA_EXTENSIONS else f"binary data (a NUL byte at offset {offset})"
    raise InputError(f"{path}: {what}, not text; {expected}")


def _read_metadata(path: Path, encoding: str = "utf-8", expected: str = EXPECTED_INPUT) -> tuple[list[str], list[dict]]:
    import io

    text = _decode_text_file(path, encoding, expected)
    if path.suffix.lower() == ".csv":
        reader = csv.DictReader(io.StringIO(text, newline=""))
        rows = list(reader)
        return list(reader.fieldnames or []), rows
    rows = []
    for n, line in enumerate(io.StringIO(text), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise InputError(f"{path} line {n}: not valid JSON ({err.msg}); expected one JSON object per line") from None
        if not isinstance(row, dict):
            raise InputError(f"{path} line {n}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    return columns, rows


def list_metadata(
    path: Path, video_column: Optional[str], caption_column: Optional[str], caption_encoding: str = "utf-8"
) -> list[ClipSource]:
    columns, rows = _read_metadata(path, caption_encoding)
    vcol = _pick_column(columns, video_column, VIDEO_COLUMNS, "video", str(path))
    ccol = _pick_column(columns, caption_column, CAPTION_COLUMNS, "caption", str(path))
    if not rows:
        raise InputError(f"{path}: no rows; {EXPECTED_INPUT}")
    base = path.parent
    clips = []
    for i, row in enumerate(rows):
        ref = row.get(vcol)
        if not isinstance(ref, str) or not ref.strip():
            clips.append(ClipSource(i, f"row {i}", problem=("missing_file", f"row {i}: no path in column '{vcol}'")))
            continue
        file = Path(ref) if Path(ref).is_absolute() else base / ref
        name = ref
        problem = _extension_problem(ref) or _caption_problem(row.get(ccol))
        if problem is None and not file.is_file():
            problem = _unfollowable_link(file) if file.is_symlink() else ("missing_file", f"no such file: {file}")
        clips.append(ClipSource(i, name, path=file, caption=row.get(ccol), problem=problem))
    return clips


def _load_hf_dataset(spec: str, split: str):
    import datasets

    p = Path(spec)
    try:
        if p.is_dir() and ((p / "state.json").is_file() or (p / "dataset_dict.json").is_file()):
            ds = datasets.load_from_disk(str(p))
        else:
            ds = datasets.load_dataset(str(p) if p.is_dir() else spec, split=split)
    except (FileNotFoundError, ValueError, ConnectionError) as err:
        raise InputError(
            f"'{spec}': could not load it as a Hugging Face dataset ({err.__class__.__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}); {EXPECTED_INPUT}"
        ) from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise InputError(f"'{spec}': no split '{split}' (splits: {', '.join(ds)}); pass --split")
        ds = ds[split]
    return ds


def list_hf_dataset(spec: str, video_column: Optional[str], caption_column: Optional[str], split: str) -> list[ClipSource]:
    import datasets

    ds = _load_hf_dataset(spec, split)
    vcol = _pick_column(ds.column_names, video_column, VIDEO_COLUMNS, "video", spec)
    ccol = _pick_column(ds.column_names, caption_column, CAPTION_COLUMNS, "caption", spec)
    feature = ds.features[vcol]
    # Undecoded: {"bytes", "path"} (decoding would need torchcodec; PyAV decodes here).
    if isinstance(feature, datasets.Video):
        ds = ds.cast_column(vcol, datasets.Video(decode=False))
    elif isinstance(feature, datasets.Image):
        ds = ds.cast_column(vcol, datasets.Image(decode=False))
    if len(ds) == 0:
        raise InputError(f"'{spec}': the dataset has no rows; {EXPECTED_INPUT}")
    base = Path(spec) if Path(spec).is_dir() else None
    captions = ds[ccol]
    refs = ds.select_columns([vcol])
    clips = []
    for i in range(len(ds)):
        value = refs[i][vcol]
        if isinstance(value, dict):
            ref, has_bytes = value.get("path"), value.get("bytes") is not None
        else:
            ref, has_bytes = value, False
        name = ref if isinstance(ref, str) and ref else f"row {i}"
        path = None
        fetch = None
        problem = None
        if has_bytes:
            fetch = (lambda j=i: refs[j][vcol]["bytes"])
            if not isinstance(ref, str) or not ref:
                name = f"row {i}" + (".png" if isinstance(feature, datasets.Image) else ".mp4")
        elif isinstance(ref, str) and ref:
            path = Path(ref) if Path(ref).is_absolute() or base is None else base / ref
            if not path.is_file():
                problem = ("missing_file", f"no such file: {path}")
        else:
            problem = ("missing_file", f"row {i}: no file or bytes in column '{vcol}'")
        problem = problem or _extension_problem(name) or _caption_problem(captions[i])
        clips.append(ClipSource(i, name, path=path, fetch=fetch, caption=captions[i], problem=problem))
    return clips


def list_inputs(
    spec: str,
    *,
    video_column: Optional[str] = None,
    caption_column: Optional[str] = None,
    split: str = "train",
    caption_encoding: str = "utf-8",
) -> tuple[list[ClipSource], str]:
    """The clips of an input, in a fixed order, and which form the input was read as."""
    p = Path(spec)
    if p.is_file():
        if p.suffix.lower() in (".csv", ".jsonl", ".json"):
            return list_metadata(p, video_column, caption_column, caption_encoding), "metadata file"
        raise InputError(f"{p}: a file with extension '{p.suffix}' cannot be an input; {EXPECTED_INPUT}")
    if p.is_dir():
        for name in METADATA_NAMES:
            if (p / name).is_file():
                return list_metadata(p / name, video_column, caption_column, caption_encoding), f"metadata file {name}"
        if (p / "state.json").is_file() or (p / "dataset_dict.json").is_file():
            return list_hf_dataset(spec, video_column, caption_column, split), "Hugging Face dataset (save_to_disk)"
        files = _visible_files(p)
        if not any(f.suffix.lower() in MEDIA_EXTENSIONS for f in files) and any(
            f.suffix.lower() in (".parquet", ".arrow") for f in files
        ):
            return list_hf_dataset(spec, video_column, caption_column, split), "Hugging Face dataset (data files)"
        return list_folder(p, caption_encoding), "folder of clips"
    if re.fullmatch(r"[\w.-]+/[\w.-]+", spec):
        return list_hf_dataset(spec, video_column, caption_column, split), "Hugging Face dataset (Hub id)"
    raise InputError(f"'{spec}' does not exist; {EXPECTED_INPUT}")


# --------------------------------------------------------------------------------------------
# The pipeline
# --------------------------------------------------------------------------------------------


@dataclass
class PreprocessResult:
    encoded: int  # rows in the dataset
    skipped: int
    newly_encoded: int  # clips encoded by this run (all processes)
    reused: int  # rows found from earlier runs
    seconds: float
    output: Path
    input_form: str = ""
    num_processes: int = 1
    audio: dict = field(default_factory=dict)  # the sound of the rows (models with audio: LTX-2)
    # Prompts mode (a text-only dataset): what the prompts file held besides the prompts encoded.
    prompts: Optional["PromptReport"] = None

    @property
    def summary(self) -> str:
        if self.prompts is None:
            return f"encoded {self.encoded}, skipped {self.skipped} (see {SKIPPED_FILE}){audio_summary(self.audio)}"
        return f"encoded {self.encoded} prompt(s) (text only), skipped {self.skipped} (see {SKIPPED_FILE}); {self.prompts.describe()}"


@dataclass
class _Stats:
    newly_encoded: int = 0
    reused: int = 0
    encode_seconds: float = 0.0
    skipped: list = field(default_factory=list)


def settings_fingerprint(
    model: str,
    revision: Optional[str],
    sampling: FrameSampling,
    dtype: torch.dtype,
    text_max_length: int,
    conditioning: Sequence[str] = ("text",),
    audio_missing: Optional[str] = None,
) -> str:
    settings = {
        "v": SETTINGS_VERSION,
        "model": model,
        "revision": revision,
        "sampling": sampling.to_dict(),
        "dtype": str(dtype).replace("torch.", ""),
        "text_max_length": text_max_length,
    }
    if tuple(conditioning) != ("text",):
        # Image-to-video rows hold more columns: rows encoded without them are not reused.
        settings["conditioning"] = list(conditioning)
    if audio_missing is not None:  # models with sound: which clips have rows depends on it
        settings["audio_missing"] = audio_missing
    return json.dumps(settings, sort_keys=True)


def clip_key(content: str, caption: str, fingerprint: str) -> str:
    import hashlib

    h = hashlib.blake2b(digest_size=16)
    for part in (content, caption.strip(), fingerprint):
        h.update(part.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()


class _RowStore:
    """Rows already encoded (finished shards and pending rows), found by key."""

    def __init__(self, output: Path):
        import pyarrow.parquet as pq

        self.where: dict[str, tuple[Path, int]] = {}
        self._cache: tuple[Optional[Path], Any] = (None, None)
        files = sorted(f for f in output.glob("data-*-of-*.parquet") if SHARD_RE.match(f.name))
        files += sorted((output / PENDING_DIR).glob("*.parquet"))
        for f in files:
            try:
                keys = pq.read_table(f, columns=["fv_key"]).column("fv_key").to_pylist()
            except Exception:  # noqa: BLE001 - not one of ours (ours are written atomically): ignore it
                continue
            for i, key in enumerate(keys):
                self.where.setdefault(key, (f, i))

    def __contains__(self, key: str) -> bool:
        return key in self.where

    def get(self, key: str) -> Optional[dict]:
        """The row, or None when its file has gone (another process rewrote it): then re-encode."""
        import pyarrow.parquet as pq

        f, i = self.where[key]
        try:
            if self._cache[0] != f:
                self._cache = (f, pq.read_table(f))
            table = self._cache[1]
            row = table.slice(i, 1).to_pylist()[0]
        except Exception:  # noqa: BLE001
            return None
        return row if row.get("fv_key") == key else None


def _shard_keys(path: Path) -> Optional[list]:
    import pyarrow.parquet as pq

    try:
        t = pq.read_table(path, columns=["fv_key", "id", "file_name"])
    except Exception:  # noqa: BLE001
        return None
    return list(zip(*(t.column(c).to_pylist() for c in ("fv_key", "id", "file_name"))))


def check_output_writable(output: Path) -> None:
    """Raise InputError, one line naming the folder, when `output` cannot be created or written."""
    import tempfile

    if output.exists() and not output.is_dir():
        raise InputError(f"--output {output}: a file is there, not a folder")
    try:
        output.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=output, prefix=".fv_write_check_"):
            pass
    except OSError as err:
        raise InputError(f"--output {output}: cannot write there ({err.strerror or err.__class__.__name__})") from None


def preprocess(
    model: str,
    input: str,
    output: Union[str, Path],
    sampling: FrameSampling,
    *,
    revision: Optional[str] = None,
    video_column: Optional[str] = None,
    caption_column: Optional[str] = None,
    split: str = "train",
    shard_size: int = 32,
    device: Optional[torch.device] = None,
    dtype: Optional[torch.dtype] = None,
    vae_tiling: bool = False,
    rank: int = 0,
    world_size: int = 1,
    barrier: Optional[Callable[[], None]] = None,
    on_clip_done: Optional[Callable[[ClipSource, str], None]] = None,
    encoder: Any = None,
    caption_encoding: str = "utf-8",
    command: Optional[str] = None,
    audio_missing: str = AUDIO_MISSING[0],
) -> PreprocessResult:
    """Encode the clips of `input` into `output` (this process's share of them when world_size > 1).

    Every process must call it with the same arguments; `barrier` synchronises them before the
    main process (rank 0) writes skipped.jsonl and fv_dataset.json. `on_clip_done(clip, status)`
    is called after each clip ("encoded", "reused" or "skipped"). `caption_encoding`: of caption
    files and metadata files. `command`: the command line, kept with the pending rows until the
    end so that training on the unfinished folder can say how to finish it. `audio_missing`
    (models with sound): what a clip without an audio track becomes (`AUDIO_MISSING`).

    The stages: list the clips, probe the model, check the buckets against its VAE, encode (or
    reuse) each clip, write the shards, report (skipped.jsonl, fv_dataset.json).
    """
    t0 = time.perf_counter()
    if audio_missing not in AUDIO_MISSING:
        raise ValueError(f"audio_missing: one of {', '.join(AUDIO_MISSING)}, got {audio_missing!r}")
    device, dtype = _run_defaults("preprocess", shard_size, world_size, barrier, device, dtype)
    clips, form = list_inputs(
        input, video_column=video_column, caption_column=caption_column, split=split, caption_encoding=caption_encoding
    )
    family, spec = _probe_model(model, revision, encoder)
    _check_buckets(spec, sampling, model)
    job = _EncodeJob(model, revision, sampling, Path(output), device, dtype, vae_tiling, family, spec, encoder, audio_missing)
    source = str(Path(input).resolve()) if Path(input).exists() else input
    return _run_job(job, clips, input, source, form, shard_size, rank, world_size, barrier, command, on_clip_done, t0)


def _run_defaults(
    name: str, shard_size: int, world_size: int, barrier: Optional[Callable[[], None]],
    device: Optional[torch.device], dtype: Optional[torch.dtype],
) -> tuple[torch.device, torch.dtype]:
    """The arguments both modes check, and their device (CUDA where there is one) and dtype (bf16 on CUDA)."""
    if shard_size < 1:
        raise ValueError(f"shard_size: expected an integer >= 1, got {shard_size}")
    if world_size > 1 and barrier is None:
        raise ValueError(f"{name}: several processes need a barrier (e.g. PartialState().wait_for_everyone)")
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return device, dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)


def _run_job(
    job: "_EncodeJob", items: list[ClipSource], given: Union[str, Path], source: str, form: str, shard_size: int,
    rank: int, world_size: int, barrier: Optional[Callable[[], None]], command: Optional[str],
    on_done: Optional[Callable[[ClipSource, str], None]], t0: float,
) -> PreprocessResult:
    """What both modes do once the input is listed and the model probed: check the output folder
    (writable, and not a dataset of another input: after the checks of the input, so that a refused
    run creates no folder), start the job (resuming the rows it finds), encode and write this
    process's shards (shard s holds items s * shard_size onwards), report."""
    check_output_source(job, items, source)
    check_output_writable(job.output)
    job.input_source = source
    job.start(rank, command)
    num_shards = max(1, math.ceil(len(items) / shard_size))
    if rank == 0:
        logger.info("preprocessing %d %s(s) from %s (%s) on %d process(es)", len(items), job.unit, given, form, world_size)
    my_shards = [s for s in range(num_shards) if s % world_size == rank]
    from fv_accel.process import progress_bar

    # Rank 0's items (its shards): items/s and the ETA on stderr (plain lines in a log file); the
    # other ranks show none.
    progress = progress_bar(
        sum(len(items[s * shard_size : (s + 1) * shard_size]) for s in my_shards),
        job.label if world_size == 1 else f"{job.label} (process 0 of {world_size})",
        show=rank == 0, unit=job.unit,
    )
    for s in my_shards:
        rows, new_keys = job.encode_shard(items[s * shard_size : (s + 1) * shard_size], progress, on_done)
        job.write_shard(s, num_shards, rows, new_keys)
    progress.close()
    return job.report(rank, world_size, barrier, num_shards, form, t0)


def check_output_source(job: "_EncodeJob", items: Sequence[ClipSource], source: str) -> None:
    """Raise InputError, one line naming the folder, when the job's output holds a finished dataset
    (its fv_dataset.json) that this run would replace: one of the other kind (clips, prompts), or
    one made from another input that shares no row with this one (by the rows' `job.identity`). The
    same input again, or a copy of it edited, resumes or updates it; an unfinished folder (no
    fv_dataset.json yet) is a run to resume."""
    import pyarrow.parquet as pq

    from fv_accel.data.schema import read_dataset_info

    try:
        info = read_dataset_info(job.output) if job.output.is_dir() else {}
    except ValueError:  # not valid JSON: no dataset to keep, and the run writes the file again
        return
    if not info.get("num_rows"):
        return
    was_text_only = info.get("preprocessed_data_type") == TEXT_ONLY
    recorded = info.get("source")
    if was_text_only == job.text_only:
        if recorded == source:
            return
        ours = {job.identity(item) for item in items} - {None}
        for f in job.output.glob("data-*-of-*.parquet"):
            try:
                if ours.intersection(pq.read_table(f, columns=[job.identity_column]).column(0).to_pylist()):
                    return
            except Exception:  # noqa: BLE001 - an unreadable shard holds no row to keep
                continue
    held = "text-only dataset (prompts)" if was_text_only else "dataset of clips"
    made = f" made from {recorded}" if recorded is not None else ""
    raise InputError(
        f"--output {job.output}: holds a {info['num_rows']}-row {held}{made}; preprocessing the "
        f"{'prompts' if job.text_only else 'clips'} of {source} there would replace it: choose another --output, or "
        "remove the folder first"
    )


def _probe_model(model: str, revision: Optional[str], encoder: Any) -> tuple[Any, Any]:
    """The model's family and what the model is conditioned on, from its configs (an encoder
    passed in without a spec is text-only): (family or None, encoding spec or None)."""
    family = None
    if encoder is None:
        from fv_accel.models import family_of_repo

        family = family_of_repo(model, revision)
        spec = family.encoding_spec(model, revision)
    else:
        spec = getattr(encoder, "spec", None)
    return family, spec


def _check_buckets(spec: Any, sampling: FrameSampling, model: str) -> None:
    """The size buckets and frame counts the model's VAE can encode (an InputError naming the flag)."""
    problem = spec.bucket_problem(sampling.buckets, f"'{model}'") if spec is not None else None
    if problem:
        raise InputError(f"--buckets {problem}")
    factor = spec.scale_factor_temporal if spec is not None else 4
    bad = [n for n in sampling.num_frames if (int(n) - 1) % factor]
    if bad:
        raise InputError(
            f"--num_frames {','.join(str(n) for n in bad)}: the VAE of '{model}' compresses time by {factor}, so "
            f"frame counts must be {factor}k+1 (e.g. {factor + 1}, {2 * factor + 1}, {4 * factor + 1})"
        )


def warn_if_upscaled(name: str, source: tuple[int, int], bucket: tuple[int, int]) -> None:
    """One warning line when a clip is smaller than its bucket on either side (its frames are enlarged)."""
    (src_h, src_w), (h, w) = source, (int(bucket[0]), int(bucket[1]))
    if src_h < h or src_w < w:
        logger.warning(
            "%s: upscaled %.1fx: its frames are %dx%d (HEIGHTxWIDTH), smaller than its %dx%d bucket; smaller "
            "--buckets keep it sharp", name, max(h / src_h, w / src_w), src_h, src_w, h, w,
        )


class _EncodeJob:
    """One process's encoding: the settings, the encoder (loaded at the first clip that needs it),
    the rows already encoded (reused by key) and the counts; its stages encode a shard's clips,
    write the shard and report."""

    # The log's and progress bar's words, the kind of rows, and the column by which a row of an
    # earlier run holds the same item as this run's (check_output_source; `identity` gives it).
    unit, label, text_only, identity_column = "clip", "preprocess", False, "id"

    def __init__(
        self, model: str, revision: Optional[str], sampling: FrameSampling, output: Path, device: torch.device,
        dtype: torch.dtype, vae_tiling: bool, family: Any, spec: Any, encoder: Any, audio_missing: str = AUDIO_MISSING[0],
    ):
        from fv_accel.models.encoders import AUDIO, TEXT_MAX_LENGTH

        self.model, self.revision, self.sampling, self.output = model, revision, sampling, output
        self.device, self.dtype, self.vae_tiling = device, dtype, vae_tiling
        self.family, self.spec, self.encoder = family, spec, encoder
        self.conditioning = spec.conditioning if spec is not None else ("text",)
        # The family pipeline's text rules: the caption cleaning its encoder applies, and the prompt
        # of its unconditional branch (what caption dropout trains on).
        if family is not None:
            self.pipeline_prompt, self.unconditional_prompt = family.pipeline_prompt, family.unconditional_prompt
        else:
            self.pipeline_prompt = getattr(encoder, "pipeline_prompt", lambda caption: caption)
            self.unconditional_prompt = getattr(encoder, "unconditional_prompt", "")
        # Models with sound (AUDIO): the clip's audio latents, and what a clip without sound becomes.
        self.audio_missing = audio_missing if AUDIO in self.conditioning else None
        self.fingerprint = settings_fingerprint(
            model, revision, sampling, dtype, TEXT_MAX_LENGTH, self.conditioning, self.audio_missing
        )
        self.pending = output / PENDING_DIR
        self.rank = 0
        self.stats = _Stats()
        self.store: Optional[_RowStore] = None
        self.input_source: Optional[str] = None  # recorded in fv_dataset.json (check_output_source reads it)

    def start(self, rank: int, command: Optional[str]) -> None:
        """The pending folder, the command kept in it, and the rows found from an earlier run."""
        self.rank = rank
        self.pending.mkdir(parents=True, exist_ok=True)
        if rank == 0:
            # Written again at the end: until then the folder is a dataset in the making.
            (self.output / DATASET_INFO).unlink(missing_ok=True)
            if command:
                (self.pending / PENDING_COMMAND).write_text(command + "\n", encoding="utf-8")
        self.store = _RowStore(self.output)

    def get_encoder(self) -> Any:
        if self.encoder is None:
            self.encoder = self.family.make_encoder(
                self.model, device=self.device, dtype=self.dtype, revision=self.revision, vae_tiling=self.vae_tiling, spec=self.spec
            )
        return self.encoder

    def latent_space(self) -> dict:
        """What fv_dataset.json says of the latents' space: the model family and its VAE class
        (training refuses a student of another latent space, fv_accel.build.check_dataset_family)."""
        from fv_accel.models.loading import ModelLoadError, fetch_config

        info: dict = {}
        if self.family is not None:
            info["family"] = self.family.family
            try:
                vae_class = (fetch_config(self.model, "vae", revision=self.revision, required=False) or {}).get("_class_name")
            except ModelLoadError:
                vae_class = None
        else:
            vae = getattr(self.encoder, "vae", None)
            vae_class = type(vae).__name__ if vae is not None else None
        if vae_class:
            info["vae_class"] = vae_class
        return info

    def encode(self, clip: ClipSource, payload: Union[Path, bytes], content: str, key: str) -> dict:
        got = read_clip(payload, clip.name, self.sampling, content)
        warn_if_upscaled(clip.name, got.source_size, got.frames.shape[1:3])
        enc = self.get_encoder()
        t = time.perf_counter()
        latent = enc.encode_video(got.frames)
        columns = dict(enc.encode_caption(clip.caption.strip()))
        text = columns.pop("text_embedding")
        if self.conditioning != ("text",):
            columns.update(enc.encode_frames_conditioning(got.frames))
        if self.audio_missing is not None:
            sound, note = encode_clip_audio(enc, payload, got, self.audio_missing)
            columns.update(sound)
            note_clip_audio(self.pending / f"{AUDIO_NOTES_PENDING}{self.rank}.jsonl", key, note)
        note_caption_length(self.pending / f"{CAPTION_TOKENS_PENDING}{self.rank}.jsonl", key, enc, clip.caption.strip())
        extra = {}
        for name, value in columns.items():
            extra.update(tensor_columns(name, value))
        self.stats.encode_seconds += time.perf_counter() - t
        n, h, w = got.frames.shape[:3]
        image = is_image(clip.name)
        return make_row(
            sample_id=clip.name,
            latent=latent,
            text_embedding=text,
            caption=self.pipeline_prompt(clip.caption.strip()),
            file_name=clip.name,
            media_type="image" if image else "video",
            width=w,
            height=h,
            num_frames=n,
            duration_sec=0.0 if image or not got.fps else n / got.fps,
            fps=got.fps,
            fv_key=key,
            **extra,
        )

    def encode_shard(
        self, clips: list[ClipSource], progress: Any, on_clip_done: Optional[Callable[[ClipSource, str], None]]
    ) -> tuple[list[dict], list[str]]:
        """The shard's rows (encoded now or reused) and the keys of those encoded now."""
        rows: list[dict] = []
        new_keys: list[str] = []
        for clip in clips:
            status, row = self._clip_row(clip, new_keys)
            if row is not None:
                # The same bytes may sit under another name: the row takes this clip's name.
                rows.append({**row, **self.row_names(clip)})
            progress.update(1)
            if on_clip_done is not None:
                on_clip_done(clip, status)
        return rows, new_keys

    def row_names(self, clip: ClipSource) -> dict:
        """The `id` and `file_name` of a clip's row."""
        return {"id": clip.name, "file_name": clip.name}

    def identity(self, clip: ClipSource) -> Optional[str]:
        return clip.name

    def _clip_row(self, clip: ClipSource, new_keys: list[str]) -> tuple[str, Optional[dict]]:
        """("encoded" | "reused" | "skipped", the clip's row or None)."""
        stats, store = self.stats, self.store
        if clip.problem is not None:
            stats.skipped.append((clip.index, clip.name, *clip.problem))
            return "skipped", None
        try:
            payload = clip.payload()
            content = content_hash(payload)
        except OSError as err:
            stats.skipped.append((clip.index, clip.name, "unreadable", f"cannot read the file ({err})"))
            return "skipped", None
        # Keyed by the text the model encodes: a row encoded from other text is not reused.
        key = clip_key(content, self.pipeline_prompt(clip.caption.strip()), self.fingerprint)
        row = store.get(key) if key in store else None
        if row is not None:
            stats.reused += 1
            return "reused", row
        try:
            row = self.encode(clip, payload, content, key)
        except ClipError as err:
            stats.skipped.append((clip.index, clip.name, err.reason, err.detail))
            return "skipped", None
        # Written at once, so an interruption loses at most the clip in flight.
        write_rows([row], self.pending / f"{key}.parquet")
        store.where[key] = (self.pending / f"{key}.parquet", 0)  # the same bytes again
        new_keys.append(key)
        stats.newly_encoded += 1
        return "encoded", row

    def write_shard(self, s: int, num_shards: int, rows: list[dict], new_keys: list[str]) -> None:
        """Shard `s` from its rows (rewritten only when they changed), then its pending rows removed."""
        shard = self.output / f"data-{s:05d}-of-{num_shards:05d}.parquet"
        wanted = [(r["fv_key"], r["id"], r["file_name"]) for r in rows]
        if rows and (not shard.is_file() or _shard_keys(shard) != wanted):
            write_rows(rows, shard)
        elif not rows and shard.is_file():
            shard.unlink()
        for key in new_keys:
            (self.pending / f"{key}.parquet").unlink(missing_ok=True)

    def report(
        self, rank: int, world_size: int, barrier: Optional[Callable[[], None]], num_shards: int, form: str, t0: float
    ) -> PreprocessResult:
        """This process's counts; then (main process, after the others) skipped.jsonl, the
        latent statistics and fv_dataset.json."""
        stats, encoder = self.stats, self.encoder
        (self.pending / f"stats-r{rank}.json").write_text(
            json.dumps({"newly_encoded": stats.newly_encoded, "reused": stats.reused, "encode_seconds": stats.encode_seconds, "skipped": stats.skipped})
        )
        if world_size > 1:
            barrier()
        result = PreprocessResult(0, 0, 0, 0, 0.0, self.output, form, world_size)
        if rank == 0:
            ensure_unconditional_text(self.output, self.unconditional_prompt, self.fingerprint, self.get_encoder)
            encoder = self.encoder
            if encoder is not None and hasattr(encoder, "latent_statistics"):
                stats_found = encoder.latent_statistics()
            elif encoder is not None:  # an encoder without the method: its VAE's config says
                config = encoder.vae.config
                stats_found = (config.get("latents_mean"), config.get("latents_std")) if config.get("latents_mean") else None
            else:  # nothing was encoded by this process: read the statistics, load nothing
                stats_found = self.family.latent_statistics(self.model, self.revision)
            info = {**self.dataset_info(stats_found), "source": self.input_source}
            result = _finish(self.output, num_shards, world_size, form, info)
            result.seconds = time.perf_counter() - t0
        if world_size > 1:
            barrier()
        return result


    def dataset_info(self, latent_stats: Optional[tuple]) -> dict:
        """What fv_dataset.json records besides the row count and the captions cut."""
        return {
            "model": self.model,
            "latent_stats": latent_stats,
            **self.latent_space(),
            "preprocessing": self.sampling.to_dict(),
            **conditioning_info(self.spec, self.conditioning),
        }


def ensure_unconditional_text(output: Path, prompt: str, fingerprint: str, get_encoder: Callable[[], Any]) -> None:
    """Encode the pipeline's unconditional `prompt` into the dataset's unconditional text file, unless
    the file already holds it for these settings (then no encoder is loaded)."""
    stored = unconditional_text_metadata(output) or {}
    if (stored.get("prompt"), stored.get("fingerprint")) != (prompt, fingerprint):
        columns = dict(get_encoder().encode_caption(prompt))
        write_unconditional_text(output, columns, prompt=prompt, fingerprint=fingerprint)


def _finish(output: Path, num_shards: int, world_size: int, form: str, info: dict) -> PreprocessResult:
    """Main process, after every process is done: skipped.jsonl, stale files, fv_dataset.json
    (`info`, the job's dataset_info, with the row count and the captions cut)."""
    import pyarrow.parquet as pq

    pending = output / PENDING_DIR
    skipped: list = []
    newly = reused = 0
    for r in range(world_size):  # (files of an interrupted run with more processes are not read)
        st = json.loads((pending / f"stats-r{r}.json").read_text())
        skipped += st["skipped"]
        newly += st["newly_encoded"]
        reused += st["reused"]
    skipped.sort(key=lambda r: r[0])
    for _, name, reason, detail in skipped:
        logger.warning("skipped %s: %s (%s)", name, reason, detail)
    tmp = output / (SKIPPED_FILE + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for _, name, reason, detail in skipped:
            f.write(json.dumps({"path": name, "reason": reason, "detail": detail}) + "\n")
    tmp.replace(output / SKIPPED_FILE)
    # Shards of an earlier run with another shard count (or now empty) are not part of this dataset.
    encoded = 0
    for f in sorted(output.glob("data-*-of-*.parquet")):
        m = SHARD_RE.match(f.name)
        if m and int(m.group(2)) == num_shards:
            encoded += pq.read_metadata(f).num_rows
        elif m:
            f.unlink()
    captions_cut = captions_cut_report(output, pending, num_shards)
    audio = audio_report(output, pending, sorted(output.glob(f"data-*-of-{num_shards:05d}.parquet")), skipped)
    for f in pending.iterdir():
        f.unlink()
    pending.rmdir()
    write_dataset_info(output, **info, num_rows=encoded, **captions_cut, **audio)
    return PreprocessResult(encoded, len(skipped), newly, reused, 0.0, output, form, world_size, audio.get("audio", {}))


# Each caption's token count before the text encoder's cut, by row key: appended per encoded clip
# (per process, in the pending folder, so that an interrupted run keeps them), and kept with the
# dataset for later reruns, which reuse rows without encoding them.
CAPTION_TOKENS_PENDING = "caption-tokens-r"
CAPTION_TOKENS_FILE = "caption_tokens.jsonl"


def note_caption_length(path: Path, key: str, encoder: Any, caption: str) -> None:
    """Append the caption's token count and the text encoder's limit (where the family counts them)."""
    count = getattr(encoder, "caption_tokens", None)
    tokens = count(caption) if count is not None else None
    if tokens is not None:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"key": key, "tokens": int(tokens), "limit": int(encoder.text_max_length)}) + "\n")


def _read_caption_lengths(paths: Sequence[Path]) -> dict[str, dict]:
    found: dict[str, dict] = {}
    for path in paths:
        if path.is_file():
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    entry = json.loads(line)
                    found[entry["key"]] = {"tokens": int(entry["tokens"]), "limit": int(entry["limit"])}
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut short by a kill
    return found


def captions_cut_report(output: Path, pending: Path, num_shards: int) -> dict:
    """Captions the text encoder cut among the dataset's rows: logged, written to CAPTION_TOKENS_FILE
    (the counts of every row's caption), and returned as fv_dataset.json's `captions_cut` (how many,
    the longest in tokens, the limit, the first names); {} where no caption was counted."""
    import pyarrow.parquet as pq

    lengths = _read_caption_lengths([output / CAPTION_TOKENS_FILE, *sorted(pending.glob(f"{CAPTION_TOKENS_PENDING}*.jsonl"))])
    rows = []
    for f in sorted(output.glob(f"data-*-of-{num_shards:05d}.parquet")):
        rows += pq.read_table(f, columns=["id", "fv_key"]).to_pylist()
    counted = [(r["id"], r["fv_key"], lengths[r["fv_key"]]) for r in rows if r["fv_key"] in lengths]
    tmp = output / f".{CAPTION_TOKENS_FILE}.tmp"
    tmp.write_text("".join(json.dumps({"key": k, **entry}) + "\n" for _, k, entry in counted), encoding="utf-8")
    tmp.replace(output / CAPTION_TOKENS_FILE)
    if not counted:
        return {}
    cut = [(name, entry) for name, _, entry in counted if entry["tokens"] > entry["limit"]]
    report = {
        "captions": len(cut),
        "counted": len(counted),
        "longest_tokens": max((e["tokens"] for _, e in cut), default=None),
        "limit": max((e["limit"] for _, e in cut), default=None),
        "first": [name for name, _ in cut[:10]],
    }
    if cut:
        logger.warning(
            "%d of %d caption(s) are longer than the text encoder's %d tokens and were cut there (the longest: %d tokens; "
            "first: %s): their ends are not in the text embeddings; see captions_cut in %s",
            len(cut), len(counted), report["limit"], report["longest_tokens"], ", ".join(report["first"][:3]), output / DATASET_INFO,
        )
    return {"captions_cut": report}


def conditioning_info(spec: Any, conditioning: Sequence[str]) -> dict:
    """What fv_dataset.json says of the rows' conditioning and of the VAE that made them."""
    info: dict = {"conditioning": list(conditioning)}
    if spec is not None:
        info.update(
            z_dim=int(spec.z_dim),
            scale_factor_spatial=int(spec.scale_factor_spatial),
            scale_factor_temporal=int(spec.scale_factor_temporal),
        )
    if "first_frame" in conditioning:
        # first_frame_latent is stored normalised, (latent - latents_mean) / latents_std, as FastVideo
        # stores it and WanImageToVideoPipeline feeds it; vae_latent stays raw.
        info["first_frame_latent_normalized"] = True
    return info


# --------------------------------------------------------------------------------------------
# Prompts: a text-only dataset (FastVideo's `preprocessed_data_type: text_only`)
# --------------------------------------------------------------------------------------------

PROMPT_COLUMNS = ("caption", "prompt")
PROMPT_TABLES = (".csv", ".jsonl")
EXPECTED_PROMPTS = (
    "expected a text file with one prompt per non-empty line, or a CSV (or JSONL) file with a "
    f"{' or '.join(repr(c) for c in PROMPT_COLUMNS)} column"
)


@dataclass
class PromptReport:
    """What a prompts file held besides its prompts: blank lines (a text file's, not prompts) and
    prompts repeating an earlier one's text as the model encodes it (each kept as a row of its own,
    so it is drawn as often as it is listed; encoded once)."""

    blank_lines: int = 0
    duplicates: list[tuple[str, str]] = field(default_factory=list)  # (name, name of its first occurrence)

    def describe(self) -> str:
        dup = f"{len(self.duplicates)} duplicate prompt(s) kept, each a row of its own"
        if self.duplicates:
            name, first = self.duplicates[0]
            dup += f" (first: {name} repeats {first})"
        return f"{dup}; {self.blank_lines} blank line(s) ignored"

    def to_dict(self) -> dict:
        return {
            "blank_lines": self.blank_lines,
            "duplicates": len(self.duplicates),
            "first_duplicates": [{"row": name, "repeats": first} for name, first in self.duplicates[:10]],
        }


def _prompt_problem(prompt: Any) -> Optional[tuple[str, str]]:
    if prompt is None:
        return ("missing_prompt", "no prompt in this row")
    if not isinstance(prompt, str):
        return ("missing_prompt", f"the prompt is a {type(prompt).__name__}, not text")
    if not prompt.strip():
        return ("empty_prompt", "the prompt is empty")
    return None


def list_prompts(
    path: Union[str, Path], caption_column: Optional[str] = None, caption_encoding: str = "utf-8"
) -> tuple[list[ClipSource], str, PromptReport]:
    """The prompts of a file, in file order, as ClipSources (no clip: `caption` is the prompt, `name`
    '<file> line N' or '<file> row N'), the form the file was read as, and its blank lines. A text
    file holds one prompt per non-empty line; a CSV or JSONL file one per row, in its `caption` or
    `prompt` column (`caption_column` names another); an empty cell is a prompt skipped, with its reason."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"--prompts {p}: {'a folder, not a file' if p.is_dir() else 'no such file'}; {EXPECTED_PROMPTS}")
    if p.suffix.lower() in PROMPT_TABLES:
        columns, rows = _read_metadata(p, caption_encoding, EXPECTED_PROMPTS)
        column = _pick_column(columns, caption_column, PROMPT_COLUMNS, "prompt", str(p))
        if not rows:
            raise InputError(f"{p}: no rows; {EXPECTED_PROMPTS}")
        prompts = [
            ClipSource(i, f"{p.name} row {i + 1}", caption=row.get(column), problem=_prompt_problem(row.get(column)))
            for i, row in enumerate(rows)
        ]
        return prompts, f"{p.suffix.lower()[1:].upper()} file of prompts (column '{column}')", PromptReport()
    prompts, blank = [], 0
    for n, line in enumerate(_decode_text_file(p, caption_encoding, EXPECTED_PROMPTS).splitlines(), 1):
        if line.strip():
            prompts.append(ClipSource(len(prompts), f"{p.name} line {n}", caption=line.strip()))
        else:
            blank += 1
    if not prompts:
        raise InputError(f"{p}: no prompts ({blank} blank line(s)); {EXPECTED_PROMPTS}")
    return prompts, "text file of prompts", PromptReport(blank_lines=blank)


def find_duplicate_prompts(prompts: Sequence[ClipSource], pipeline_prompt: Callable[[str], str]) -> list[tuple[str, str]]:
    """(name, name of the first prompt of the same text) of each prompt whose text, as the model
    encodes it (`pipeline_prompt`: the family's cleaning), an earlier prompt has."""
    first: dict[str, str] = {}
    found = []
    for prompt in prompts:
        if prompt.problem is None:
            text = pipeline_prompt(prompt.caption.strip())
            if text in first:
                found.append((prompt.name, first[text]))
            else:
                first[text] = prompt.name
    return found


def prompts_fingerprint(model: str, revision: Optional[str], dtype: torch.dtype, text_max_length: int) -> str:
    """The settings a text-only row depends on (its key hashes them with the prompt)."""
    settings = {"v": SETTINGS_VERSION, "data": "text_only", "model": model, "revision": revision,
                "dtype": str(dtype).replace("torch.", ""), "text_max_length": text_max_length}
    return json.dumps(settings, sort_keys=True)


class _PromptJob(_EncodeJob):
    """One process's encoding of prompts into text-only rows (the text columns, no latent): a row's
    key hashes the prompt as the model encodes it and the settings, and rows are kept, reused and
    assembled into shards as clips' are (`_EncodeJob`)."""

    unit, label, text_only, identity_column = "prompt", "preprocess prompts", True, "caption"  # a prompt's text

    def __init__(self, model: str, revision: Optional[str], output: Path, device: torch.device, dtype: torch.dtype,
                 family: Any, spec: Any, encoder: Any, source: Path, report: PromptReport):
        import dataclasses

        from fv_accel.models.encoders import TEXT_MAX_LENGTH

        # The text alone: an image-to-video model's image encoders are not loaded.
        spec = dataclasses.replace(spec, conditioning=("text",)) if dataclasses.is_dataclass(spec) else spec
        super().__init__(model, revision, FrameSampling(), output, device, dtype, False, family, spec, encoder)
        self.conditioning = ("text",)
        self.fingerprint = prompts_fingerprint(model, revision, dtype, TEXT_MAX_LENGTH)
        self.source, self.prompt_report = source, report
        self.seen: set[str] = set()  # keys of this process's rows so far (a repeat is a duplicate)

    def row_names(self, clip: ClipSource) -> dict:
        return {"id": clip.name, "file_name": self.source.name}

    def identity(self, clip: ClipSource) -> Optional[str]:
        """The prompt as the model encodes it (a row's `caption`)."""
        return None if clip.problem is not None else self.pipeline_prompt(clip.caption.strip())

    def _clip_row(self, clip: ClipSource, new_keys: list[str]) -> tuple[str, Optional[dict]]:
        """("encoded" | "reused" | "duplicate" | "skipped", the prompt's row or None)."""
        if clip.problem is not None:
            self.stats.skipped.append((clip.index, clip.name, *clip.problem))
            return "skipped", None
        prompt = clip.caption.strip()
        key = clip_key(TEXT_ONLY, self.pipeline_prompt(prompt), self.fingerprint)
        row = self.store.get(key) if key in self.store else None
        status = "duplicate" if key in self.seen else "reused"
        self.seen.add(key)
        if row is not None:
            self.stats.reused += status == "reused"
            return status, row
        row = self.encode_prompt(prompt, key)
        write_rows([row], self.pending / f"{key}.parquet")  # at once: an interruption loses one prompt
        self.store.where[key] = (self.pending / f"{key}.parquet", 0)
        new_keys.append(key)
        self.stats.newly_encoded += 1
        return "encoded", row

    def encode_prompt(self, prompt: str, key: str) -> dict:
        enc = self.get_encoder()
        t = time.perf_counter()
        columns = dict(enc.encode_caption(prompt))
        text = columns.pop("text_embedding")
        note_caption_length(self.pending / f"{CAPTION_TOKENS_PENDING}{self.rank}.jsonl", key, enc, prompt)
        extra = {}
        for name, value in columns.items():  # the family's other text columns (pooled, a second encoder's)
            extra.update(tensor_columns(name, value))
        self.stats.encode_seconds += time.perf_counter() - t
        return make_text_row(
            sample_id=key, text_embedding=text, caption=self.pipeline_prompt(prompt), file_name=self.source.name, fv_key=key, **extra
        )

    def dataset_info(self, latent_stats: Optional[tuple]) -> dict:
        from fv_accel.models.encoders import TEXT_MAX_LENGTH

        info = {
            "model": self.model,
            "latent_stats": latent_stats,  # the model's VAE's, for a student that has none
            "preprocessed_data_type": TEXT_ONLY,
            **self.latent_space(),
            "revision": self.revision,
            "text_encoder": {"dtype": str(self.dtype).replace("torch.", ""), "max_length": TEXT_MAX_LENGTH},
            "prompts": {"file": self.source.name, **self.prompt_report.to_dict()},
            **conditioning_info(self.spec, self.conditioning),
        }
        return info

    def report(self, rank: int, world_size: int, barrier: Optional[Callable[[], None]], num_shards: int, form: str, t0: float) -> PreprocessResult:
        result = super().report(rank, world_size, barrier, num_shards, form, t0)
        result.prompts = self.prompt_report
        return result


def preprocess_prompts(
    model: str,
    prompts: Union[str, Path],
    output: Union[str, Path],
    *,
    revision: Optional[str] = None,
    caption_column: Optional[str] = None,
    shard_size: int = 256,
    device: Optional[torch.device] = None,
    dtype: Optional[torch.dtype] = None,
    rank: int = 0,
    world_size: int = 1,
    barrier: Optional[Callable[[], None]] = None,
    on_prompt_done: Optional[Callable[[ClipSource, str], None]] = None,
    encoder: Any = None,
    caption_encoding: str = "utf-8",
    command: Optional[str] = None,
) -> PreprocessResult:
    """Encode the prompts of a file (`list_prompts`) with the model's text encoder(s) into a
    text-only dataset in `output`: one row per prompt (`id` '<file> line N', the text columns,
    `caption`), fv_dataset.json with `preprocessed_data_type: text_only`, the unconditional text,
    skipped.jsonl (empty prompts of a CSV). Resumable and shardable over processes as `preprocess`.
    Duplicates and blank lines are counted in the result's `prompts` and in fv_dataset.json."""
    t0 = time.perf_counter()
    device, dtype = _run_defaults("preprocess_prompts", shard_size, world_size, barrier, device, dtype)
    items, form, report = list_prompts(prompts, caption_column, caption_encoding)
    family, spec = _probe_model(model, revision, encoder)
    job = _PromptJob(model, revision, Path(output), device, dtype, family, spec, encoder, Path(prompts), report)
    report.duplicates = find_duplicate_prompts(items, job.pipeline_prompt)
    if rank == 0 and report.duplicates:
        logger.warning("%d prompt(s) repeat an earlier one (first: %s repeats %s): each kept as a row of its own",
                       len(report.duplicates), *report.duplicates[0])
    source = str(Path(prompts).resolve())
    return _run_job(job, items, prompts, source, form, shard_size, rank, world_size, barrier, command, on_prompt_done, t0)


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from fv_accel.process import DefaultsHelpFormatter

    p = argparse.ArgumentParser(
        prog="python -m fv_accel.preprocess",
        formatter_class=DefaultsHelpFormatter,
        description="Encode clips and captions into FastVideo-schema Parquet latents (run under "
        "`accelerate launch` to shard the clips over processes).\n\nPrompts-only mode (--prompts instead of "
        "--input): encode prompts alone into a text-only dataset\n(text embeddings, no video latents; "
        "preprocessed_data_type text_only) for methods that roll the student out from noise.",
    )
    p.add_argument("--model", required=True, help="Hub id or local folder with vae/, text_encoder/, tokenizer/")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", help="folder of clips + .txt captions, CSV/JSONL metadata, or HF dataset folder/id")
    source.add_argument(
        "--prompts",
        help="prompts-only mode: a text file (one prompt per non-empty line) or a CSV/JSONL file with a 'caption' "
        "or 'prompt' column (--caption_column names another) -> a text-only dataset; the clip options are not used",
    )
    p.add_argument("--output", required=True, help="output folder (rerun into the same folder to resume)")
    p.add_argument("--num_frames", default="81", help="frames per clip, 4k+1; a list (33,81) takes the longest a clip can fill")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--frame_stride", type=int, default=1, help="take every N-th source frame")
    g.add_argument("--target_fps", type=float, default=None, help="sample frames at this rate instead of a stride (default: the source rate, with --frame_stride)")
    p.add_argument("--start", choices=["head", "uniform"], default="head", help="where the frames start in a longer clip")
    p.add_argument("--buckets", default="480x832", help="HEIGHTxWIDTH[,...]: each clip is resized and centre-cropped to the nearest")
    p.add_argument("--seed", type=int, default=0, help="seed of the uniform start")
    p.add_argument("--video_column", default=None, help="metadata/dataset column of the clips (default: found by its name)")
    p.add_argument("--caption_column", default=None, help="metadata/dataset column of the captions (default: found by its name)")
    p.add_argument("--split", default="train", help="split of a Hugging Face dataset")
    p.add_argument("--revision", default=None, help="revision (branch, tag, commit) of a Hub --model (default: main)")
    p.add_argument("--shard_size", type=int, default=None, help="rows per Parquet shard; 256 with --prompts (default: 32)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto", help="auto: bf16 on GPU, fp32 on CPU")
    p.add_argument("--vae_tiling", action="store_true", help="encode in spatial tiles (less memory at high resolution)")
    p.add_argument(
        "--audio_missing",
        choices=AUDIO_MISSING,
        default=AUDIO_MISSING[0],
        help="models with sound (LTX-2): a clip without an audio track is kept and trained video-only, or skipped",
    )
    p.add_argument(
        "--caption_encoding",
        default="utf-8",
        help="text encoding of caption and metadata files (e.g. latin-1, cp1252)",
    )
    return p


def main(argv: Optional[list[str]] = None) -> int:
    from datetime import timedelta

    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    from fv_accel.models.loading import ModelLoadError

    import codecs
    import shlex

    args = build_parser().parse_args(argv)
    try:
        codecs.lookup(args.caption_encoding)
    except LookupError:
        print(f"error: --caption_encoding: unknown encoding {args.caption_encoding!r}", file=sys.stderr)
        return 2
    try:
        sampling = FrameSampling(
            num_frames=tuple(int(v) for v in str(args.num_frames).split(",") if v.strip()),
            frame_stride=args.frame_stride,
            target_fps=args.target_fps,
            start=args.start,
            buckets=parse_buckets(args.buckets),
            seed=args.seed,
        )
    except ValueError as err:
        print(f"error: --{err}", file=sys.stderr)
        return 2
    # Processes finish their shards at different times: allow a long wait at the final barrier.
    # (The CPU flag is read as Accelerator reads it: `accelerate launch --cpu` / ACCELERATE_USE_CPU.)
    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"), timeout=timedelta(hours=12))
    logging.basicConfig(level=logging.INFO if state.is_main_process else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    command = shlex.join(["python", "-m", "fv_accel.preprocess", *(sys.argv[1:] if argv is None else argv)])
    if args.prompts is not None:
        return _main_prompts(args, state, dtype, command)
    try:
        result = preprocess(
            args.model,
            args.input,
            args.output,
            sampling,
            revision=args.revision,
            video_column=args.video_column,
            caption_column=args.caption_column,
            split=args.split,
            shard_size=32 if args.shard_size is None else args.shard_size,
            device=state.device,
            dtype=dtype,
            vae_tiling=args.vae_tiling,
            rank=state.process_index,
            world_size=state.num_processes,
            barrier=state.wait_for_everyone,
            caption_encoding=args.caption_encoding,
            audio_missing=args.audio_missing,
            command=command,
        )
    except (InputError, ModelLoadError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if state.is_main_process:
        rate = result.newly_encoded / result.seconds if result.seconds > 0 else 0.0
        print(
            f"{result.input_form}: {result.newly_encoded} clip(s) encoded now, {result.reused} reused from "
            f"earlier runs, on {result.num_processes} process(es) in {result.seconds:.1f}s ({rate:.2f} clips/s)"
        )
        print(result.summary)
        if result.encoded == 0:
            print(f"error: no clip could be encoded; see {Path(args.output) / SKIPPED_FILE}", file=sys.stderr)
            return 1
    return 0


def _main_prompts(args: argparse.Namespace, state: Any, dtype: Optional[torch.dtype], command: str) -> int:
    """`--prompts`: a text-only dataset from a prompts file; the summary line on the main process."""
    from fv_accel.models.loading import ModelLoadError

    try:
        result = preprocess_prompts(
            args.model,
            args.prompts,
            args.output,
            revision=args.revision,
            caption_column=args.caption_column,
            shard_size=256 if args.shard_size is None else args.shard_size,
            device=state.device,
            dtype=dtype,
            rank=state.process_index,
            world_size=state.num_processes,
            barrier=state.wait_for_everyone,
            caption_encoding=args.caption_encoding,
            command=command,
        )
    except (InputError, ModelLoadError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if state.is_main_process:
        rate = result.newly_encoded / result.seconds if result.seconds > 0 else 0.0
        print(
            f"{result.input_form}: {result.newly_encoded} prompt(s) encoded now, {result.reused} reused from "
            f"earlier runs, on {result.num_processes} process(es) in {result.seconds:.1f}s ({rate:.2f} prompts/s)"
        )
        print(result.summary)
        if result.encoded == 0:
            print(f"error: no prompt could be encoded; see {Path(args.output) / SKIPPED_FILE}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    exit_code = main()
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # Skip the interpreter teardown after a sharded run (gloo teardown deadlock, see there).
        from fv_accel.process import exit_without_teardown

        exit_without_teardown(exit_code)
    sys.exit(exit_code)
