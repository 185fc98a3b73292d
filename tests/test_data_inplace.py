"""Issue 15: datasets opened in place with pyarrow (footers and shape columns at open, rows by row
group on demand). Same samples, order, dropout and resume as the former `datasets` reader; an open
writes no file; DataLoader workers give the same batches and resume exactly; the inspect command."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import tempfile
from itertools import islice
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import fv_accel.data.loader as loader_module
from fv_accel.data.loader import BucketBatchSampler, LatentDataset, TrainLoader, build_train_loader, collate
from fv_accel.data.schema import make_row, tensor_columns, write_dataset_info, write_unconditional_text

REPO = Path(__file__).resolve().parent.parent


def _rows(shapes_counts, *, seed: int, start: int = 0, extra=None) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for shape, count in shapes_counts:
        for _ in range(count):
            k = start + len(rows)
            row = make_row(
                sample_id=f"s{k}",
                latent=torch.randn(16, *shape, generator=g).to(torch.bfloat16),
                text_embedding=torch.randn(3 + k % 4, 32, generator=g),
                caption=f"caption {k}",
            )
            if extra:
                row.update(extra(k, g))
            rows.append(row)
    return rows


def _write(path: Path, rows: list[dict], row_group_size: int = 3) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return path


def _nested_dataset(folder: Path, *, seed: int, shapes_counts, shards: int, stats: bool = True) -> str:
    """Rows spread over `shards` files in nested folders, row groups of 3 rows."""
    rows = _rows(shapes_counts, seed=seed)
    per = -(-len(rows) // shards)
    for k in range(shards):
        _write(folder / f"part{k % 3}" / f"sub{k}" / f"rows-{k:03d}.parquet", rows[k * per : (k + 1) * per])
    # The unconditional text caption dropout trains on (2 tokens, as a pipeline's empty prompt).
    write_unconditional_text(folder, {"text_embedding": torch.randn(2, 32, generator=torch.Generator().manual_seed(seed))}, prompt="")
    if stats:
        write_dataset_info(folder, model=None, latent_stats=([0.0] * 16, [1.0] * 16), num_rows=len(rows))
    return str(folder)


class DatasetsRows:
    """The former reader, kept here as the reference: `datasets` converts the files to its Arrow
    cache (in `cache_dir`) and a row is `ds[i]`."""

    def __init__(self, files, cache_dir):
        import datasets

        self.ds = datasets.Dataset.from_parquet(list(files), cache_dir=str(cache_dir))

    def __len__(self) -> int:
        return len(self.ds)

    def row(self, index: int) -> dict:
        return self.ds[int(index)]


def _old_dataset(path: str, cache_dir: Path, **kw) -> LatentDataset:
    """A LatentDataset whose rows, ids and shapes come from the former `datasets` reader."""
    new = LatentDataset(path, **kw)
    old = copy.copy(new)
    old.rows = DatasetsRows(new.files, cache_dir)
    old.ids = old.rows.ds["id"]
    old.latent_shapes = [tuple(int(v) for v in s) for s in old.rows.ds["vae_latent_shape"]]
    old.text_shapes = [tuple(int(v) for v in s) for s in old.rows.ds["text_embedding_shape"]]
    return old


def _same_batch(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


def test_same_batches_as_the_datasets_reader_over_two_epochs_with_mixing_and_heldout(tmp_path, monkeypatch):
    from fv_accel.config import default_recipe, load_config
    from fv_accel.validation import heldout_split

    a = _nested_dataset(tmp_path / "a", seed=1, shapes_counts=[((2, 4, 4), 10), ((3, 4, 6), 8)], shards=5)
    b = _nested_dataset(tmp_path / "b", seed=2, shapes_counts=[((2, 4, 4), 6), ((3, 4, 6), 6)], shards=2)
    cfg = load_config(default_recipe("finetune"), {
        "training.data.data_path": a, "training.data.mix": [{"data_path": b, "weight": 0.5}],
        "training.data.train_batch_size": 2, "training.data.training_cfg_rate": 0.3, "training.data.seed": 7,
    })
    held = heldout_split(18, 0.2, 7)
    new = build_train_loader(cfg, world_size=1, rank=0, exclude_indices=held)
    assert [len(p.files) for p in new.dataset.parts] == [5, 2]
    real = loader_module.LatentDataset
    monkeypatch.setattr(loader_module, "LatentDataset", lambda path, **kw: _old_dataset(path, tmp_path / "hf", **kw))
    old = build_train_loader(cfg, world_size=1, rank=0, exclude_indices=held)
    monkeypatch.setattr(loader_module, "LatentDataset", real)
    assert isinstance(old.dataset.parts[0].rows, DatasetsRows) and any((tmp_path / "hf").rglob("*.arrow"))
    assert new.sampler.bucket_keys == old.sampler.bucket_keys and new.sampler.weights == old.sampler.weights
    steps = len(new.sampler.epoch_groups(0)) + len(new.sampler.epoch_groups(1))
    seen = set()
    for n, (x, y) in enumerate(zip(islice(iter(new), steps), islice(iter(old), steps))):
        _same_batch(x, y)
        seen |= set(x["sample_index"].tolist())
    assert n == steps - 1 and int(x["epoch"][0]) == 1
    assert not seen & set(held) and {i >= 18 for i in seen} == {False, True}  # both datasets drawn


def test_extra_columns_read_as_before(tmp_path):
    def extra(k, g):
        out = {}
        out.update(tensor_columns("first_frame_latent", torch.randn(16, 2, 4, 4, generator=g)))
        out.update(tensor_columns("clip_feature", torch.randn(1, 5, 8, generator=g)))
        out.update(tensor_columns("pil_image", torch.randint(0, 255, (32, 32, 3), generator=g, dtype=torch.uint8)))
        out.update(tensor_columns("pooled_text_embedding", torch.randn(24, generator=g)))
        # Even rows: a caption with none of the second encoder's tokens, stored [0, D] with no bytes.
        second = torch.zeros(0, 12) if k % 2 == 0 else torch.randn(4, 12, generator=g)
        out.update(tensor_columns("text_embedding_2", second))
        return out

    data = tmp_path / "d"
    _write(data / "data.parquet", _rows([((2, 4, 4), 4)], seed=3, extra=extra), row_group_size=2)
    new, old = LatentDataset(str(data)), _old_dataset(str(data), tmp_path / "hf")
    for i in range(4):
        x, y = new[(i, 0, 0)], old[(i, 0, 0)]
        _same_batch(x, y)
        assert {"first_frame_latent", "clip_feature", "pil_image", "pooled_text_embedding", "text_embedding_2"} <= x.keys()
    empty = new[(0, 0, 0)]
    assert empty["text_embedding_2"].shape == (512, 12) and not empty["text_embedding_2"].any()
    assert not empty["text_attention_mask_2"].any() and new[(1, 0, 0)]["text_attention_mask_2"].sum() == 4
    batch = collate([new[(i, 0, 0)] for i in range(4)])
    assert batch["pil_image"].dtype == torch.uint8 and batch["clip_feature"].shape == (4, 5, 8)
    assert new.describe(3) == f"{data}/data.parquet row 3 (id 's3')"


def _listing(*folders: Path) -> dict:
    return {
        str(p): p.stat().st_size for folder in folders for p in Path(folder).rglob("*")
    }


def test_an_open_writes_no_file(tmp_path, monkeypatch):
    data = Path(_nested_dataset(tmp_path / "data", seed=4, shapes_counts=[((2, 4, 4), 8)], shards=3))
    home, tmp, hf = tmp_path / "home", tmp_path / "tmp", tmp_path / "hf"
    for folder in (home, tmp, hf):
        folder.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setenv("HF_HOME", str(hf))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(hf / "datasets"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(home / ".cache"))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    before = _listing(home, tmp, hf, data)
    ds = LatentDataset(str(data))
    sampler = BucketBatchSampler([ds.bucket_key(i) for i in range(len(ds))], batch_size=2, seed=0)
    batches = list(islice(iter(TrainLoader(ds, sampler)), 6))
    assert sorted(int(i) for b in batches[:4] for i in b["sample_index"]) == list(range(8))
    assert _listing(home, tmp, hf, data) == before


def test_many_nested_shards_and_a_bounded_row_group_cache(tmp_path):
    data = _nested_dataset(tmp_path / "d", seed=5, shapes_counts=[((2, 4, 4), 36)], shards=12)
    ds = LatentDataset(data)
    assert len(ds.files) == 12 and len(ds) == 36 and ds.files == sorted(ds.files)
    assert sum(len(s) - 1 for s in ds.rows.row_group_starts) == 12  # 3 rows a shard, one row group each
    # Row i is the files' rows in the order of their sorted paths (nested folders included).
    written = [c for f in ds.files for c in pq.read_table(f, columns=["caption"]).column("caption").to_pylist()]
    assert sorted(written) == sorted(f"caption {k}" for k in range(36)) and written != sorted(written)
    assert [ds[(i, 0, 0)]["caption"] for i in range(36)] == written
    assert len(ds.rows._groups) == 2 and len(ds.rows._files) == 12
    ident = pq.read_table(ds.files[5], columns=["id"]).column("id")[2].as_py()
    assert ds.describe(17) == f"{ds.files[5]} row 2 (id {ident!r})"


def test_files_with_different_columns_are_named(tmp_path):
    data = tmp_path / "d"
    _write(data / "a.parquet", _rows([((2, 4, 4), 2)], seed=0))
    rows = _rows([((2, 4, 4), 2)], seed=0, start=2, extra=lambda k, g: tensor_columns("clip_feature", torch.ones(2, 3)))
    _write(data / "b.parquet", rows)
    with pytest.raises(ValueError) as err:
        LatentDataset(str(data))
    assert str(err.value) == (
        f"{data}/b.parquet: its columns differ from those of {data}/a.parquet (has clip_feature_bytes, "
        "clip_feature_dtype, clip_feature_shape); the files of one dataset must share one schema (preprocess them "
        "with the same model, or give them as separate datasets)"
    )


def test_large_dataset_checks_byte_lengths_when_a_row_is_read(tmp_path, monkeypatch):
    import fv_accel.data.checks as checks
    rows = _rows([((2, 4, 4), 4)], seed=6)
    rows[2]["vae_latent_bytes"] = rows[2]["vae_latent_bytes"][:-8]
    data = tmp_path / "d"
    _write(data / "data.parquet", rows)
    with pytest.raises(ValueError, match=r"row 2 \(id 's2'\): vae_latent_bytes: 1016 bytes stored for shape"):
        LatentDataset(str(data))  # small: checked at open
    monkeypatch.setattr(checks, "BYTE_CHECK_LIMIT", 0)
    read_at_open = []
    real_read = pq.ParquetFile.read

    def spy(self, columns=None, **kw):
        read_at_open.append(columns)
        return real_read(self, columns=columns, **kw)

    monkeypatch.setattr(pq.ParquetFile, "read", spy)
    ds = LatentDataset(str(data))
    assert ds.rows.lengths is None and read_at_open and not any(c.endswith("_bytes") for cols in read_at_open for c in cols)
    assert ds[(1, 0, 0)]["vae_latent"].shape == (16, 2, 4, 4)
    with pytest.raises(ValueError) as err:
        ds[(2, 0, 0)]
    message = (
        f"{data}/data.parquet row 2 (id 's2'): vae_latent_bytes: 1016 bytes stored for shape [16, 2, 4, 4] of "
        "bfloat16 (1024 bytes expected)"
    )
    assert str(err.value) == message
    # The same line when a DataLoader worker reads the row (not torch's wrapped worker traceback).
    sampler = BucketBatchSampler([ds.bucket_key(i) for i in range(4)], batch_size=4, shuffle=False)
    with pytest.raises(ValueError) as err:
        next(iter(TrainLoader(ds, sampler, num_workers=1)))
    assert str(err.value) == message


def _loader(data: str, workers: int) -> TrainLoader:
    ds = LatentDataset(data, cfg_rate=0.3, seed=2)
    keys = [ds.bucket_key(i) for i in range(len(ds))]
    return TrainLoader(ds, BucketBatchSampler(keys, batch_size=2, seed=9), num_workers=workers)


def test_workers_give_the_same_batches_and_resume_exactly(tmp_path):
    data = _nested_dataset(tmp_path / "d", seed=7, shapes_counts=[((2, 4, 4), 8), ((3, 4, 6), 6)], shards=4)
    reference = list(islice(iter(_loader(data, 0)), 14))  # two epochs of 7 steps
    with_workers = _loader(data, 2)
    it = iter(with_workers)
    got = []
    for _ in range(5):
        got.append(next(it))
        with_workers.mark_step_done(got[-1])
    del it
    for x, y in zip(got, reference):
        _same_batch(x, y)
    state = with_workers.state_dict()
    assert state == {"epoch": 0, "step_in_epoch": 5, "group_size": 2, "set_aside": []}
    resumed = _loader(data, 2)
    resumed.load_state_dict(state)
    for x, y in zip(islice(iter(resumed), 9), reference[5:], strict=True):
        _same_batch(x, y)
    # The recipe key reaches the loader.
    from fv_accel.config import default_recipe, load_config

    cfg = load_config(default_recipe("finetune"), {"training.data.data_path": data, "training.data.dataloader_num_workers": 2})
    assert build_train_loader(cfg, world_size=1, rank=0).num_workers == 2


def _isolated_env(env_root: Path) -> dict:
    """This environment with HOME, TMPDIR and the Hugging Face caches in empty folders under `env_root`."""
    env = dict(os.environ)
    for name, sub in (("HOME", "home"), ("TMPDIR", "tmp"), ("HF_HOME", "hf"), ("HF_DATASETS_CACHE", "hf/datasets"),
                      ("XDG_CACHE_HOME", "home/.cache")):
        (env_root / sub).mkdir(parents=True, exist_ok=True)
        env[name] = str(env_root / sub)
    env["PYTHONPATH"] = str(REPO)
    return env


def _run_inspect(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fv_accel.data.inspect", *args], env=env, capture_output=True, text=True, timeout=120)


def test_inspect_prints_the_dataset_and_writes_nothing(tmp_path, capsys):
    data = Path(_nested_dataset(tmp_path / "d", seed=8, shapes_counts=[((2, 4, 4), 9), ((3, 4, 6), 3)], shards=2))
    env_root = tmp_path / "env"
    env = _isolated_env(env_root)
    before = _listing(env_root, data)
    done = _run_inspect([str(data), "--batch_size", "2", "--num_processes", "2"], env)
    assert done.returncode == 0, done.stderr
    assert _listing(env_root, data) == before
    lines = done.stdout.splitlines()
    text = done.stdout
    assert lines[0] == f"dataset: {data}"
    assert "rows: 12 in 2 Parquet file(s), 4 row group(s)" in lines
    assert "buckets (latent T, H, W): 2" in lines
    assert "  (2, 4, 4): 9 row(s)" in lines and "  (3, 4, 6): 3 row(s)" in lines
    assert "  vae_latent: bfloat16 x 12" in lines and "  text_embedding: float32 x 12" in lines
    assert "latent statistics: found in fv_dataset.json (16 channels)" in lines
    # 4 samples a step: 3 of the (3, 4, 6) rows can never be trained; each epoch leaves 1 of the others out.
    assert "rows no step can take at batch 2 x 2 processes x 1 accumulation (4 a step): 3 (bucket(s) (3, 4, 6))" in lines
    assert "rows left out each epoch (bucket remainders): 1" in lines
    assert any(line.startswith("open time: ") and "imports included" in line for line in lines)
    assert "bytes: " in text and "byte lengths: checked at open" in text
    # In process from here. A FastVideo dataset without fv_dataset.json: the statistics are reported missing.
    from fv_accel.data.inspect import main as inspect_main

    (data / "fv_dataset.json").unlink()
    capsys.readouterr()
    assert inspect_main([str(data)]) == 0
    assert "latent statistics: missing (no fv_dataset.json; set models.student.latents_mean / latents_std, or " \
        "models.student.init_from a model whose VAE has them)" in capsys.readouterr().out.splitlines()
    # An incomplete shard set is refused in one line.
    bad = tmp_path / "bad"
    _write(bad / "data-00000-of-00002.parquet", _rows([((2, 4, 4), 2)], seed=0))
    assert inspect_main([str(bad)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {bad}: the dataset is incomplete: shard(s) 00001 of data-*-of-00002 are missing (1 of 2 present) and "
        "fv_dataset.json, which preprocessing writes last, is missing; finish it by rerunning the same `python -m "
        f"fv_accel.preprocess ... --output {bad}` command (it resumes where it stopped)"
    ]
    assert inspect_main([str(data), "--batch_size", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: --batch_size: expected an integer >= 1, got 0"


def test_a_dataset_in_the_local_hugging_face_cache(tmp_path, monkeypatch):
    """`hf://<owner>/<name>` and a repository's cache folder: its snapshot, read where it lies
    (files are links to blobs, as the hub client stores them), offline."""
    from huggingface_hub import constants

    from fv_accel.data.schema import read_dataset_info

    hub = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    repo = hub / "datasets--me--clips"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / commit
    _write(repo / "blobs" / "aaaa", _rows([((2, 4, 4), 4)], seed=9))
    (snapshot / "data").mkdir(parents=True)
    (snapshot / "data" / "train-00000-of-00001.parquet").symlink_to(repo / "blobs" / "aaaa")
    write_dataset_info(snapshot, model=None, latent_stats=([0.0] * 16, [1.0] * 16), num_rows=4)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for path in ("hf://me/clips", str(repo)):
        ds = LatentDataset(path)
        assert ds.data_path == str(snapshot) and len(ds) == 4
        assert ds.describe(1) == f"{snapshot}/data/train-00000-of-00001.parquet row 1 (id 's1')"
        assert ds[(3, 0, 0)]["caption"] == "caption 3"
    assert read_dataset_info("hf://me/clips")["num_rows"] == 4
    from fv_accel.build import resolve_data_path
    from fv_accel.config import default_recipe, load_config

    cfg = load_config(default_recipe("finetune"), {"training.data.data_path": "hf://me/clips"})
    assert resolve_data_path(cfg, accelerator=None) == str(snapshot)
    assert len(LatentDataset("hf://me/clips/data")) == 4
    with pytest.raises(FileNotFoundError) as err:
        LatentDataset("hf://me/other")
    assert str(err.value) == (
        f"training.data.data_path: 'hf://me/other': the dataset repository me/other is not in the local Hugging Face "
        f"cache ({hub}); download it first: hf download --repo-type dataset me/other"
    )


def test_prefetcher_reads_ahead_on_its_thread_in_order():
    """The trainer reads through BatchPrefetcher: batch i + 1 is made while batch i is in use (on the
    CPU device the loader's very batches, no copy), in the loader's order, then the end."""
    import threading

    from fv_accel.data.loader import BatchPrefetcher

    made = [threading.Event() for _ in range(3)]
    threads = set()
    batches = [{"vae_latent": torch.full((1, 2), float(i)), "sample_index": torch.tensor([i])} for i in range(3)]

    def source():
        for i, batch in enumerate(batches):
            threads.add(threading.current_thread().name)
            yield batch
            made[i].set()  # the consumer's request for batch i + 1 is not needed to get here

    prefetcher = BatchPrefetcher(source(), torch.device("cpu"))
    first = next(prefetcher)
    # Batch 1 is made while batch 0 is in use (a wait on an event, no timing).
    assert made[0].wait(timeout=30)
    rest = list(prefetcher)
    assert [id(b) for b in [first, *rest]] == [id(b) for b in batches]
    assert threads == {"fv_accel-prefetch"}
    assert next(prefetcher, None) is None
    prefetcher.close()


def test_the_prefetch_thread_computes_with_one_torch_thread_and_starts_no_openmp_team():
    """torch's thread count is per thread (OpenMP): the prefetch thread's is BatchPrefetcher.threads,
    and on Linux its nice value is raised by BatchPrefetcher.nice; the training thread's stay what
    they were. A parallel op there starts no OpenMP team of its own:
    the only thread it adds is its own (with a team, libgomp counts more threads than cores and makes
    the step's threads sleep between ops instead of spinning)."""
    from fv_accel.data.loader import BatchPrefetcher

    before = torch.get_num_threads()
    big = torch.randn(1 << 22)
    big.sum()  # the training thread's own team exists before the count
    tasks = Path("/proc/self/task")
    threads_before = len(list(tasks.iterdir())) if tasks.is_dir() else None
    seen = []
    nice = {"training": os.getpriority(os.PRIO_PROCESS, 0) if hasattr(os, "getpriority") else None}

    def source():
        seen.append(torch.get_num_threads())
        if hasattr(os, "getpriority"):
            nice["prefetch"] = os.getpriority(os.PRIO_PROCESS, 0)
        big.mul(2.0).sum()  # parallel over the training thread's count of threads, were it that
        if threads_before is not None:
            seen.append(len(list(tasks.iterdir())) - threads_before)  # this thread, and a team's workers
        yield {"vae_latent": torch.zeros(1)}

    prefetcher = BatchPrefetcher(source(), torch.device("cpu"))
    list(prefetcher)
    prefetcher.close()
    assert seen == ([1, 1] if threads_before is not None else [1])
    assert torch.get_num_threads() == before
    if sys.platform.startswith("linux"):
        # Its own nice value is raised by BatchPrefetcher.nice (capped at 19); the training thread's is not.
        own = os.getpriority(os.PRIO_PROCESS, 0)
        assert own == nice["training"]
        assert BatchPrefetcher.nice > 0 and nice["prefetch"] == min(19, own + BatchPrefetcher.nice)


def test_binary_values_are_sliced_without_a_copy_from_every_binary_layout():
    """parquet_rows.binary_value over binary, large binary and fixed-size binary columns, with nulls,
    empty values, several chunks and a sliced chunk: the values of column[r], and a slice of the
    column's own data buffer (no copy)."""
    from fv_accel.data.parquet_rows import binary_value

    values = [b"abc", None, b"", b"0123456789" * 100, b"xy"]
    for typ in (pa.binary(), pa.large_binary()):
        whole = pa.array(values, type=typ)
        column = pa.chunked_array([whole.slice(0, 2), whole.slice(2)])
        for r, want in enumerate(values):
            got = binary_value(column, r)
            assert (got is None) if want is None else got.to_pybytes() == want, (typ, r)
        big = binary_value(column, 3)
        assert big.address == whole.buffers()[2].address + len(b"abc")
    fixed = pa.chunked_array([pa.array([b"ab", None, b"cd", b"ef"], type=pa.binary(2)).slice(1)])
    assert [None if v is None else v.to_pybytes() for v in (binary_value(fixed, r) for r in range(3))] == [None, b"cd", b"ef"]
    with pytest.raises(IndexError):
        binary_value(fixed, 3)
    empty = pa.chunked_array([pa.array([b"", b""], type=pa.binary())])
    assert binary_value(empty, 1).to_pybytes() == b""


def test_prefetcher_raises_the_loaders_error_at_its_turn_and_close_stops_the_thread():
    from fv_accel.data.loader import BatchPrefetcher

    def failing():
        yield {"sample_index": torch.tensor([0])}
        raise ValueError("data-00000.parquet row 1 (id 'b'): vae_latent_bytes is missing (null)")

    prefetcher = BatchPrefetcher(failing(), torch.device("cpu"))
    assert int(next(prefetcher)["sample_index"][0]) == 0
    with pytest.raises(ValueError, match=r"^data-00000\.parquet row 1 \(id 'b'\): vae_latent_bytes is missing \(null\)$"):
        next(prefetcher)
    prefetcher.close()

    closed = []

    def endless():
        try:
            i = 0
            while True:
                yield {"sample_index": torch.tensor([i])}
                i += 1
        finally:
            closed.append(True)

    prefetcher = BatchPrefetcher(endless(), torch.device("cpu"), depth=2)
    assert [int(next(prefetcher)["sample_index"][0]) for _ in range(3)] == [0, 1, 2]
    prefetcher.close()
    assert not prefetcher._thread.is_alive() and closed == [True]
    assert next(prefetcher, None) is None


def test_a_batch_of_one_is_the_items_tensors_without_a_copy():
    """collate of a single item: its tensors with a batch dimension, sharing their storage."""
    from fv_accel.data.loader import collate

    item = {"vae_latent": torch.randn(16, 2, 4, 4), "text_embedding": torch.randn(8, 32),
            "text_attention_mask": torch.ones(8, dtype=torch.long), "caption": "", "sample_index": 3, "epoch": 0, "position": 0}
    batch = collate([item])
    for key in ("vae_latent", "text_embedding", "text_attention_mask"):
        assert batch[key].shape == (1, *item[key].shape) and batch[key].data_ptr() == item[key].data_ptr()
    two = collate([item, dict(item, sample_index=4)])
    assert torch.equal(two["vae_latent"][1], item["vae_latent"]) and two["vae_latent"].data_ptr() != item["vae_latent"].data_ptr()


def _count_row_reads(loader: TrainLoader) -> list[int]:
    """Wrap every dataset part's row read; returns the list the indices read are appended to."""
    reads: list[int] = []
    for part in getattr(loader.dataset, "parts", [loader.dataset]):
        original = part.rows.row

        def row(index, original=original, offset=part.global_offset):
            reads.append(offset + int(index))
            return original(index)

        part.rows.row = row
    return reads


def test_the_data_cache_reads_each_row_once_and_gives_the_files_values(tmp_path):
    """training.data.cache_gb: over three epochs of a mix with caption dropout and the extra text
    columns, the batches equal those read from the files every time, and each row is read once."""
    from fv_accel.config import default_recipe, load_config

    def extra(k, g):
        out = dict(tensor_columns("pooled_text_embedding", torch.randn(24, generator=g)))
        out.update(tensor_columns("text_embedding_2", torch.randn(4, 12, generator=g)))
        return out

    a = tmp_path / "a"
    _write(a / "data.parquet", _rows([((2, 4, 4), 6), ((3, 4, 6), 4)], seed=11, extra=extra))
    write_unconditional_text(a, {"text_embedding": torch.randn(2, 32), "pooled_text_embedding": torch.randn(24),
                                 "text_embedding_2": torch.randn(1, 12)}, prompt="")
    b = tmp_path / "b"
    _write(b / "data.parquet", _rows([((2, 4, 4), 4)], seed=12, start=10, extra=extra))
    write_unconditional_text(b, {"text_embedding": torch.randn(2, 32), "pooled_text_embedding": torch.randn(24),
                                 "text_embedding_2": torch.randn(1, 12)}, prompt="")

    def loader(cache_gb):
        cfg = load_config(default_recipe("finetune"), {
            "training.data.data_path": str(a), "training.data.mix": [{"data_path": str(b), "weight": 0.5}],
            "training.data.training_cfg_rate": 0.5, "training.data.seed": 3, "training.data.cache_gb": cache_gb,
        })
        return build_train_loader(cfg, world_size=1, rank=0)

    cached, plain = loader(1.0), loader(0)
    assert cached.dataset.parts[0].cache is cached.dataset.parts[1].cache and plain.dataset.parts[0].cache is None
    cached_reads, plain_reads = _count_row_reads(cached), _count_row_reads(plain)
    steps = sum(len(cached.sampler.epoch_groups(e)) for e in range(3))
    dropped = 0
    for x, y in zip(islice(iter(cached), steps), islice(iter(plain), steps), strict=True):
        _same_batch(x, y)
        dropped += int((x["text_attention_mask"].sum(-1) == 2).sum())
    assert int(x["epoch"][0]) == 2 and dropped > 0  # three epochs, some captions dropped
    assert len(plain_reads) == 2 * steps and sorted(cached_reads) == sorted(set(plain_reads)) == list(range(14))
    stats = cached.dataset.parts[0].cache.stats()
    assert stats["rows"] == 14 and stats["hits"] == 2 * steps - 14 and stats["misses"] == 14 and stats["changed"] == 0
    # The bytes counted are those of the kept rows' tensors (the padded text and the latent the largest).
    row_bytes = [sum(t.untyped_storage().nbytes() for t in part._decode(i).values() if isinstance(t, torch.Tensor))
                 for part in plain.dataset.parts for i in range(len(part))]
    assert stats["bytes"] == sum(row_bytes)


def test_the_data_cache_keeps_rows_within_its_budget_and_rereads_a_row_changed_in_place(tmp_path):
    from fv_accel.data.loader import ItemCache

    data = _nested_dataset(tmp_path / "d", seed=4, shapes_counts=[((2, 4, 4), 9)], shards=3)
    reference = LatentDataset(data)
    one = sum(t.untyped_storage().nbytes() for t in reference[(0, 0, 0)].values() if isinstance(t, torch.Tensor))
    ds = LatentDataset(data, cache=ItemCache(int(one * 3.5)))  # room for three rows of this size
    reads = []
    original = ds.rows.row
    ds.rows.row = lambda index: (reads.append(int(index)), original(index))[1]
    for epoch in range(3):
        for i in range(9):
            _same_batch(ds[(i, epoch, i)], reference[(i, epoch, i)])
    assert len(ds.cache) == 3 and ds.cache.bytes <= ds.cache.max_bytes and ds.cache.full
    assert reads == list(range(9)) + list(range(3, 9)) * 2  # rows 0-2 kept, the others read each time
    # A consumer that changes a kept tensor in place (a batch of one is a view of it) does not change
    # what the next draw of that row holds: the row is read from its file again.
    batch = collate([ds[(1, 3, 0)]])
    batch["vae_latent"].mul_(2)
    again = ds[(1, 4, 0)]
    assert torch.equal(again["vae_latent"], reference[(1, 0, 0)]["vae_latent"]) and ds.cache.changed == 1
    assert reads[-1] == 1 and len(ds.cache) == 3
    # Not shared with another process: a pickled cache (a spawned DataLoader worker's) holds nothing,
    # and a process other than its maker's neither keeps nor finds rows.
    import pickle

    copy_ = pickle.loads(pickle.dumps(ds.cache))
    assert len(copy_) == 0 and copy_.get((ds.data_path, 1)) is None
    copy_._pid = -1
    assert copy_.put((ds.data_path, 1), reference[(1, 0, 0)]) is False and len(copy_) == 0


def test_the_data_cache_budget_is_checked():
    from fv_accel.config import ConfigError, default_recipe, load_config

    for bad in (-1, "lots", True, float("inf")):
        with pytest.raises(ConfigError, match="cache_gb"):
            load_config(default_recipe("finetune"), {"training.data.cache_gb": bad})
    assert load_config(default_recipe("finetune"), {"training.data.cache_gb": 0}).training.data.cache_gb == 0
