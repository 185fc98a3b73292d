"""The training loader: (T, H, W) buckets, per-epoch reshuffle, resumable position, CFG dropout,
weighted mixing, and FastVideo-written Parquet files."""

from __future__ import annotations

from collections import Counter
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
import torch

from fv_accel.data.loader import BucketBatchSampler, LatentDataset, TrainLoader, build_train_loader, collate
from fv_accel.data.schema import make_row, write_rows, write_unconditional_text

SHAPES = [(1, 4, 4), (1, 4, 6), (3, 4, 4), (3, 4, 6)]  # two lengths x two resolutions


def _write_dataset(path: Path, shapes_counts: list[tuple[tuple, int]], *, seed: int = 0, text_len: int = 5) -> Path:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for shape, count in shapes_counts:
        for _ in range(count):
            k = len(rows)
            rows.append(
                make_row(
                    sample_id=f"s{k}",
                    latent=torch.randn(16, *shape, generator=g),
                    text_embedding=torch.randn(text_len, 32, generator=g) + 1.0,
                    caption=f"caption {k}",
                )
            )
    write_rows(rows, path / "data-00000-of-00001.parquet")
    return path


@pytest.fixture(scope="module")
def mixed_shapes(tmp_path_factory) -> str:
    return str(_write_dataset(tmp_path_factory.mktemp("mixed"), [(s, 4) for s in SHAPES]))


def _epoch_batches(sampler: BucketBatchSampler, epoch: int) -> list[list[tuple]]:
    steps = len(sampler.epoch_groups(epoch)) * sampler.grad_accum
    return [b for b in islice(iter(sampler), steps * (epoch + 1))][steps * epoch :]


def test_buckets_give_same_shape_batches_and_each_sample_once_per_epoch(mixed_shapes):
    ds = LatentDataset(mixed_shapes)
    assert len(ds) == 16 and sorted(set(ds.latent_shapes)) == sorted((16, *s) for s in SHAPES)
    keys = [ds.bucket_key(i) for i in range(len(ds))]
    sampler = BucketBatchSampler(keys, batch_size=2, seed=3)
    assert sampler.steps_per_epoch() == 8 and sampler.dropped_per_epoch == 0
    orders = []
    for epoch in range(3):
        batches = _epoch_batches(sampler, epoch)
        seen = [i for b in batches for (i, e, _) in b]
        assert sorted(seen) == list(range(16)), epoch  # every sample exactly once
        assert all(e == epoch for b in batches for (_, e, _) in b)
        for b in batches:
            batch = collate([ds[k] for k in b])  # raises on mixed shapes
            assert batch["vae_latent"].shape[0] == 2
            assert len({keys[i] for (i, _, _) in b}) == 1
        orders.append(seen)
    assert orders[0] != orders[1] != orders[2]  # reshuffled every epoch
    again = BucketBatchSampler(keys, batch_size=2, seed=3)
    assert [i for b in _epoch_batches(again, 1) for (i, _, _) in b] == orders[1]  # from the seed
    other = BucketBatchSampler(keys, batch_size=2, seed=4)
    assert [i for b in _epoch_batches(other, 0) for (i, _, _) in b] != orders[0]
    with pytest.raises(RuntimeError, match="mixes latent shapes"):
        collate([ds[0], ds[4]])


def test_two_ranks_split_each_step_and_cover_the_epoch_once(mixed_shapes):
    keys = [LatentDataset(mixed_shapes).bucket_key(i) for i in range(16)]
    ranks = [BucketBatchSampler(keys, batch_size=2, world_size=2, rank=r, seed=1) for r in range(2)]
    per_rank = [_epoch_batches(s, 0) for s in ranks]
    assert len(per_rank[0]) == len(per_rank[1]) == 4
    seen = [i for batches in per_rank for b in batches for (i, _, _) in b]
    assert sorted(seen) == list(range(16))
    for b0, b1 in zip(*per_rank):  # the two halves of one step come from one bucket
        assert len({keys[i] for (i, _, _) in b0 + b1}) == 1


def test_bucket_remainders_are_left_out_and_counted(tmp_path):
    path = _write_dataset(tmp_path, [(SHAPES[0], 5), (SHAPES[3], 3)])
    keys = [LatentDataset(str(path)).bucket_key(i) for i in range(8)]
    sampler = BucketBatchSampler(keys, batch_size=2, seed=0)
    assert sampler.steps_per_epoch() == 3 and sampler.dropped_per_epoch == 2
    left_out = []
    for epoch in range(4):
        seen = [i for b in _epoch_batches(sampler, epoch) for (i, _, _) in b]
        assert len(seen) == len(set(seen)) == 6
        left_out.append(frozenset(set(range(8)) - set(seen)))
    assert len(set(left_out)) > 1  # a different remainder each epoch
    with pytest.raises(ValueError, match="no bucket holds enough samples for one step: 8 needed"):
        BucketBatchSampler(keys, batch_size=4, world_size=2, seed=0)


def test_loader_position_resumes_where_it_stopped(mixed_shapes):
    def loader():
        ds = LatentDataset(mixed_shapes)
        return TrainLoader(ds, BucketBatchSampler([ds.bucket_key(i) for i in range(len(ds))], batch_size=2, seed=5))

    straight = loader()
    reference = [b["sample_index"].tolist() for b in islice(iter(straight), 20)]  # 2.5 epochs
    first = loader()
    it = iter(first)
    for _ in range(11):  # stop inside the second epoch
        first.mark_step_done(next(it))
    state = first.state_dict()
    assert state == {"epoch": 1, "step_in_epoch": 3, "group_size": 2, "set_aside": []}
    resumed = loader()
    resumed.load_state_dict(state)
    assert [b["sample_index"].tolist() for b in islice(iter(resumed), 9)] == reference[11:]
    # A fresh pass over the same loader also continues after the last finished step.
    assert next(iter(first))["sample_index"].tolist() == reference[11]


def test_prefetched_loader_keeps_the_order_and_checkpoints_the_consumed_position(mixed_shapes):
    """Through BatchPrefetcher (the trainer's reader) the batches come in the loader's order, and the
    position a checkpoint keeps is that of the last batch consumed, not of those read ahead."""
    import threading

    from fv_accel.data.loader import BatchPrefetcher

    def loader():
        ds = LatentDataset(mixed_shapes)
        return TrainLoader(ds, BucketBatchSampler([ds.bucket_key(i) for i in range(len(ds))], batch_size=2, seed=5))

    reference = [b["sample_index"].tolist() for b in islice(iter(loader()), 14)]
    prefetched = loader()
    drawn = []
    read_ahead = threading.Event()
    original = prefetched._batches

    def counting():
        for batch in original():
            drawn.append(batch["sample_index"].tolist())
            if len(drawn) >= 13:
                read_ahead.set()
            yield batch

    prefetched._batches = counting
    batches = BatchPrefetcher(prefetched, torch.device("cpu"), depth=2)
    got = []
    for _ in range(11):
        batch = next(batches)
        got.append(batch["sample_index"].tolist())
        prefetched.mark_step_done(batch)
    assert read_ahead.wait(timeout=30)  # two batches beyond the 11th were read ahead (no timing)
    assert got == reference[:11]
    assert prefetched.state_dict() == {"epoch": 1, "step_in_epoch": 3, "group_size": 2, "set_aside": []}
    batches.close()
    # A new pass (after a fault's set-aside, or a resume) continues after the consumed batch.
    assert next(iter(prefetched))["sample_index"].tolist() == reference[11]


def test_cfg_dropout_trains_the_stored_unconditional_text_at_a_reproducible_rate(tmp_path):
    path = str(_write_dataset(tmp_path, [(SHAPES[0], 400)]))
    with pytest.raises(ValueError) as err:
        LatentDataset(path, cfg_rate=0.25)
    assert str(err.value) == (
        f"{path}: training.data.training_cfg_rate is 0.25 but the dataset has no unconditional_text.safetensors (the "
        "encoding of the prompt the pipeline's unconditional branch uses, which caption dropout trains on): rerun the "
        "preprocess command that made it (it reuses the encoded clips and adds the file), or set "
        "training.data.training_cfg_rate: 0"
    )
    # The pipeline's empty prompt: 2 tokens, with its own mask (not zeros under the caption's mask).
    unconditional = torch.randn(2, 32, generator=torch.Generator().manual_seed(3))
    write_unconditional_text(path, {"text_embedding": unconditional}, prompt="")

    def dropped(rate: float, epoch: int) -> list[bool]:
        ds = LatentDataset(path, cfg_rate=rate, seed=11)
        out = []
        for i in range(len(ds)):
            item = ds[(i, epoch, 0)]
            text, mask = item["text_embedding"], item["text_attention_mask"]
            is_dropped = int(mask.sum()) == 2
            out.append(is_dropped)
            if is_dropped:
                assert torch.equal(text[:2], unconditional) and text[2:].abs().sum() == 0
            else:
                assert int(mask.sum()) == 5 and not torch.equal(text[:2], unconditional)
        return out

    d0 = dropped(0.25, 0)
    assert 0.19 < np.mean(d0) < 0.31, np.mean(d0)
    assert dropped(0.25, 0) == d0
    d1 = dropped(0.25, 1)
    assert d1 != d0 and 0.19 < np.mean(d1) < 0.31
    assert not any(dropped(0.0, 0)) and all(dropped(1.0, 0))
    kept = LatentDataset(path)[(0, 0, 0)]
    assert kept["text_embedding"].shape == (512, 32) and kept["text_embedding"][5:].abs().sum() == 0


def test_weighted_mixing_draws_datasets_by_weight(tmp_path):
    from fv_accel.config import default_recipe, load_config

    a = _write_dataset(tmp_path / "a", [(SHAPES[0], 8)], seed=1)
    b = _write_dataset(tmp_path / "b", [(SHAPES[3], 24)], seed=2)  # another shape: another bucket
    cfg = load_config(
        default_recipe("finetune"),
        {"training.data.data_path": str(a), "training.data.mix": [{"data_path": str(b), "weight": 1 / 3}]},
    )
    loader = build_train_loader(cfg, world_size=1, rank=0)
    assert len(loader.dataset) == 32
    counts = Counter()
    for batch in islice(iter(loader), 400):
        counts.update("a" if i < 8 else "b" for i in batch["sample_index"].tolist())
    share_b = counts["b"] / sum(counts.values())
    assert 0.20 < share_b < 0.30, share_b  # shares 1 : 1/3 whatever the sizes (24 : 8 would give 0.75)
    item = loader.dataset[(9, 0, 0)]
    assert item["sample_index"] == 9 and item["vae_latent"].shape == (16, 3, 4, 6)


def _fastvideo_parquet(path: Path, n: int) -> Path:
    """Rows as FastVideo's preprocessing writes them: raw bytes + shape + dtype columns, text
    embeddings already zero-padded to 512 tokens (bf16 here), written with pyarrow directly."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    g = torch.Generator().manual_seed(0)
    cols = {k: [] for k in ("id", "vae_latent_bytes", "vae_latent_shape", "vae_latent_dtype", "text_embedding_bytes",
                            "text_embedding_shape", "text_embedding_dtype", "file_name", "caption", "media_type",
                            "width", "height", "num_frames", "duration_sec", "fps")}
    for k in range(n):
        latent = torch.randn(16, 3, 4, 4, generator=g).numpy().astype(np.float32)
        text = torch.zeros(512, 32)
        text[:7] = torch.randn(7, 32, generator=g)
        cols["id"].append(f"clip_{k}")
        cols["vae_latent_bytes"].append(latent.tobytes())
        cols["vae_latent_shape"].append(list(latent.shape))
        cols["vae_latent_dtype"].append("float32")
        cols["text_embedding_bytes"].append(text.to(torch.bfloat16).view(torch.int16).numpy().tobytes())
        cols["text_embedding_shape"].append([512, 32])
        cols["text_embedding_dtype"].append("bfloat16")
        cols["file_name"].append(f"clip_{k}.mp4")
        cols["caption"].append("a red circle moving left")
        cols["media_type"].append("video")
        cols["width"].append(32)
        cols["height"].append(32)
        cols["num_frames"].append(9)
        cols["duration_sec"].append(9 / 16)
        cols["fps"].append(16.0)
    pq.write_table(pa.table(cols), path)
    return path


def test_fastvideo_written_parquet_loads_and_trains(tmp_path):
    from fv_accel.build import build_from_config
    from fv_accel.config import default_recipe
    from fv_accel.trainer import Trainer

    from conftest import tiny_overrides

    path = _fastvideo_parquet(tmp_path / "fastvideo.parquet", 4)
    ds = LatentDataset(str(path))
    item = ds[0]
    assert item["vae_latent"].shape == (16, 3, 4, 4) and item["text_embedding"].dtype == torch.float32
    assert item["text_embedding"][:7].abs().sum() > 0 and item["text_embedding"][7:].abs().sum() == 0

    over = tiny_overrides(tmp_path, **{
        "training.data.data_path": str(path),
        "training.loop.max_train_steps": 3,
        "training.checkpoint.save_final": False,
        # FastVideo writes no fv_dataset.json: the latent statistics come from the recipe.
        "models.student.latents_mean": [0.0] * 16,
        "models.student.latents_std": [1.0] * 16,
    })
    run = build_from_config(str(default_recipe("finetune")), over)
    before = [p.detach().clone() for p in run.method.student.trainable_parameters()]
    summary = Trainer(run).run()
    assert summary["steps"] == 3 and np.isfinite(summary["first_loss"]) and np.isfinite(summary["last_loss"])
    after = list(run.method.student.trainable_parameters())
    assert any(not torch.equal(b, a.detach()) for b, a in zip(before, after))
