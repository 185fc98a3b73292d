"""A row whose own data holds NaN/inf is set aside once found: never drawn again, named once,
listed in the summary and the model card, kept in checkpoints; the other rows keep their order.
`python -m fv_accel.data.inspect --check` finds such rows before training. A skipped first step
shows no library warning."""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import warnings
from itertools import islice
from pathlib import Path

import pytest
import torch

from fv_accel.checkpoint import latest_checkpoint, read_metadata
from fv_accel.data.inspect import main as inspect_main
from fv_accel.data.loader import BucketBatchSampler, LatentDataset, TrainLoader
from fv_accel.data.schema import make_row, tensor_columns, write_dataset_info, write_rows
from fv_accel.trainer import Trainer, TrainerCallback, TrainingStopped, skipped_step_warnings_silenced
from tests.resume_helpers import build, small_overrides, weights

SHARD = "data-00000-of-00001.parquet"


def _rows(n: int, *, bad: dict | None = None) -> list[dict]:
    """`n` rows with ids tiny-0000.mp4...; `bad`: row number -> (column, value) put into one value."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(n):
        latent, text = torch.randn(16, 3, 4, 4, generator=g), torch.randn(7, 32, generator=g)
        column, value = (bad or {}).get(i, (None, None))
        if column == "latent":
            latent[1, 2, 3, 0] = value
        elif column == "text":
            text[3, 5] = value
        rows.append(make_row(sample_id=f"tiny-{i:04d}.mp4", latent=latent, text_embedding=text, caption=f"clip {i}"))
    return rows


def _dataset(folder: Path, rows: list[dict]) -> str:
    write_rows(rows, folder / SHARD)
    write_dataset_info(folder, model=None, latent_stats=([0.0] * 16, [1.0] * 16))
    return str(folder)


# ---- the sampler: left out from the next epoch, as a dataset without the row would order the rest ----


def test_a_row_set_aside_is_left_out_before_the_next_epochs_shuffle():
    keys = [(3, 4, 4)] * 6
    sampler = BucketBatchSampler(keys, batch_size=1)
    without = BucketBatchSampler(keys[:5], batch_size=1)  # the dataset less its row 2
    epoch0 = sampler.epoch_groups(0)
    sampler.set_aside[2] = 0  # drawn (and found) in epoch 0
    assert sampler.epoch_groups(0) == epoch0  # the epoch's order was fixed when it began
    to_full = [0, 1, 3, 4, 5]  # row k of the smaller dataset is this row of the full one
    for epoch in (1, 2, 3):
        assert sampler.epoch_groups(epoch) == [[to_full[i] for i in g] for g in without.epoch_groups(epoch)]
    # Drawing: a pass from epoch 0's next step never yields it again.
    found_at = next(step for step, group in enumerate(epoch0) if group == [2])
    sampler.position.step_in_epoch = found_at + 1
    drawn = [key for _, key in zip(range(20), sampler)]
    assert all(i != 2 for [(i, _, _)] in drawn)
    assert [(e, s) for [(_, e, s)] in drawn[: 6 - found_at - 1]] == [(0, s) for s in range(found_at + 1, 6)]


def test_mixing_skips_a_later_group_holding_a_set_aside_row_in_its_own_epoch():
    # Draws with replacement: one row can be in several groups of an epoch.
    keys = [(3, 4, 4)] * 3
    sampler = BucketBatchSampler(keys, batch_size=1, weights=[0.8, 0.1, 0.1])
    groups = sampler.epoch_groups(0)
    assert sum(g == [0] for g in groups) >= 2, groups
    sampler.set_aside[0] = 0
    drawn = [key for _, key in zip(range(12), sampler)]
    assert all(i != 0 for [(i, _, _)] in drawn)
    # Epoch 0 still yields its other groups at their own positions.
    assert [s for [(_, e, s)] in drawn if e == 0] == [s for s, g in enumerate(groups) if g != [0]]


def test_a_new_pass_after_setting_aside_draws_again_with_workers_as_without(tmp_path):
    data = _dataset(tmp_path / "d", _rows(4, bad={0: ("latent", math.nan)}))

    def draws(workers: int) -> list[tuple]:
        dataset = LatentDataset(data)
        sampler = BucketBatchSampler([dataset.bucket_key(i) for i in range(4)], batch_size=1)
        loader = TrainLoader(dataset, sampler, num_workers=workers)
        first = next(iter(loader))  # the workers have drawn batches ahead by now
        assert first["nonfinite"] == [True] and int(first["sample_index"][0]) == 0
        assert loader.set_aside([0], epoch=0, step=1) == [0] and loader.set_aside([0], epoch=0, step=1) == []
        loader.mark_step_done(first)
        batches = list(islice(iter(loader), 7))
        return [(int(b["epoch"][0]), int(b["position"]), int(b["sample_index"][0]), b["nonfinite"][0]) for b in batches]

    without_workers = draws(0)
    assert [(e, p) for e, p, _, _ in without_workers] == [(0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (2, 0)]
    assert all(i != 0 and not bad for _, _, i, bad in without_workers)
    assert draws(2) == without_workers


def test_a_run_whose_set_aside_rows_leave_no_step_stops_in_one_line_with_a_checkpoint(tmp_path):
    data = _dataset(tmp_path / "d", _rows(2, bad={1: ("latent", math.nan)}))
    over = small_overrides(tmp_path / "out", data, **{
        "training.data.train_batch_size": 2,
        "training.loop.gradient_accumulation_steps": 1,
        "training.loop.max_train_steps": 3,
        "callbacks.ema.enable": False,
    })
    trainer = Trainer(build("finetune", over))
    with pytest.raises(TrainingStopped) as err:
        trainer.run()
    text = str(err.value)
    assert "\n" not in text
    assert text == (
        f"stopped: no step can be taken once the row(s) whose data holds NaN/inf are set aside ({data}/{SHARD} row 1 "
        "(id 'tiny-0001.mp4')): no bucket holds the 2 samples a step takes; find such rows with `python -m "
        f"fv_accel.data.inspect DATA --check` and preprocess those clips again; checkpoint saved in {tmp_path}/out/checkpoint-1"
    )
    assert read_metadata(err.value.checkpoint)["data"]["set_aside"] == [{"index": 1, "epoch": 0, "step": 1}]


# ---- training: one skipped step, the row named once, the others in order, resume keeps it aside ----


class DrawRecord(TrainerCallback):
    """The (epoch, position, id) each step trained on, from the batches the method got."""

    def __init__(self, run):
        self.draws = []
        ids = run.dataloader.dataset.ids
        real = run.method.single_train_step

        def step(batch, iteration):
            self.draws += [(int(e), int(batch["position"]), ids[int(i)]) for i, e in zip(batch["sample_index"], batch["epoch"])]
            return real(batch, iteration)

        run.method.single_train_step = step


class SigtermAfter(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, trainer, step, logs):
        if step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def _run(out: Path, data: str, callbacks=(), **extra):
    over = small_overrides(out, data, **{
        "training.loop.gradient_accumulation_steps": 1,
        "training.loop.max_train_steps": 8,
        "callbacks.ema.enable": False,
        **extra,
    })
    run = build("finetune", over)
    record = DrawRecord(run)
    trainer = Trainer(run, callbacks=[*run.callbacks, *(cb(run) if isinstance(cb, type) else cb for cb in callbacks)])
    return run, trainer, record


def _draws(data: str, epochs: int) -> list[tuple]:
    """(epoch, position, id) of the steps a training loader at batch 1 draws over `epochs` epochs."""
    dataset = LatentDataset(data)
    loader = TrainLoader(dataset, BucketBatchSampler([dataset.bucket_key(i) for i in range(len(dataset))], batch_size=1))
    batches = [batch for _, batch in zip(range(epochs * len(dataset)), loader)]
    return [(int(b["epoch"][0]), int(b["position"]), dataset.ids[int(b["sample_index"][0])]) for b in batches]


def _history(trainer):
    return [(h["step"], h["loss"], h["lr"], h["grad_norm"]) for h in trainer.history]


@pytest.mark.slow
def test_a_nan_row_costs_one_step_and_stays_aside_through_a_resume(tmp_path, caplog, recwarn):
    # Row 0 is the first one epoch 0 draws (seed 0): the skipped step is the run's first.
    bad = _dataset(tmp_path / "bad", _rows(4, bad={0: ("latent", math.nan)}))
    clean = _dataset(tmp_path / "clean", _rows(4)[1:])  # the same rows less row 0
    run, full, record = _run(tmp_path / "full", bad)
    with caplog.at_level(logging.WARNING):
        summary = full.run()

    # Exactly one skipped step, the other 7 applied; the row named once, in that step's warning.
    assert summary["skipped_steps"] == 1 and summary["final_step"] == 8
    assert [h["step"] for h in full.history if not math.isfinite(h["loss"])] == [1]
    assert sum(math.isfinite(h["loss"]) for h in full.history) == 7
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "tiny-0000" in r.getMessage()]
    assert len(warned) == 1 and warned[0].count("tiny-0000") == 1, warned
    assert warned[0].startswith("skipped step 1 (1 skipped in all): non-finite loss at step 1")
    assert warned[0].endswith(f"samples: {bad}/{SHARD} row 0 (id 'tiny-0000.mp4') [NaN/inf in its data], set aside for the rest of the run")
    # Drawn once; never again.
    assert [d for d in record.draws if d[2] == "tiny-0000.mp4"] == [(0, 0, "tiny-0000.mp4")]
    expected = [{"file": f"{bad}/{SHARD}", "row": 0, "id": "tiny-0000.mp4", "step": 1}]
    assert summary["skipped_samples"] == expected
    assert json.loads((tmp_path / "full" / "logs" / "summary.json").read_text())["skipped_samples"] == expected
    card = (tmp_path / "full" / "README.md").read_text()
    assert (f"- data: `{bad}` (3 training clips; 1 row(s) set aside when found to hold NaN/inf in their data, not "
            f"trained on: `{SHARD}` row 0 (id `tiny-0000.mp4`), step 1)") in card
    # No library warning from the skipped first step (torch's LR scheduler order check).
    assert not [str(w.message) for w in recwarn if "lr_scheduler.step()" in str(w.message)]
    assert "lr_scheduler.step()" not in caplog.text

    # From epoch 1 on the other rows come in the order of a dataset without the row.
    later = [d for d in record.draws if d[0] >= 1]
    assert [e for e, _, _ in record.draws] == [0, 0, 0, 0, 1, 1, 1, 2]
    assert later == _draws(clean, epochs=3)[3 : 3 + len(later)]

    # Stopped after step 4 (a checkpoint), resumed: the row stays aside, bit for bit the same run.
    cut_run, cut, cut_record = _run(tmp_path / "cut", bad, callbacks=[SigtermAfter(4)])
    assert cut.run()["stopped_by"] == "SIGTERM"
    ckpt = latest_checkpoint(tmp_path / "cut")
    assert ckpt.name == "checkpoint-4"
    assert read_metadata(ckpt)["data"]["set_aside"] == [{"index": 0, "epoch": 0, "step": 1}]
    resumed_run, resumed, resumed_record = _run(tmp_path / "cut", bad, **{"training.checkpoint.resume_from_checkpoint": "latest"})
    assert resumed_run.start_step == 4
    resumed_summary = resumed.run()
    assert cut_record.draws + resumed_record.draws == record.draws
    assert all(d[2] != "tiny-0000.mp4" for d in resumed_record.draws)
    assert _history(resumed) == _history(full)[4:]
    full_weights, resumed_weights = weights(run), weights(resumed_run)
    assert all(torch.equal(full_weights[k], resumed_weights[k]) for k in full_weights)
    assert resumed_summary["skipped_samples"] == expected and resumed_summary["skipped_steps"] == 1


def test_a_skipped_first_step_shows_no_lr_scheduler_warning():
    def first_schedule_step_without_an_update() -> list[str]:
        param = torch.nn.Parameter(torch.zeros(2))
        optimizer = torch.optim.AdamW([param], lr=1e-3)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with skipped_step_warnings_silenced():
                scheduler.step()
            after = scheduler.last_epoch
        return [str(w.message) for w in caught], after

    caught, steps = first_schedule_step_without_an_update()
    assert caught == [] and steps == 1  # silent, and the schedule still took its step
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        param = torch.nn.Parameter(torch.zeros(2))
        torch.optim.lr_scheduler.LambdaLR(torch.optim.AdamW([param]), lambda step: 1.0).step()
    assert any("Detected call of `lr_scheduler.step()` before `optimizer.step()`" in str(w.message) for w in seen)


# ---- python -m fv_accel.data.inspect --check ----


def _inspect(argv: list[str], capsys) -> tuple[int, list[str], str]:
    status = inspect_main(argv)
    out = capsys.readouterr()
    return status, out.out.splitlines(), out.err


def test_inspect_check_passes_a_clean_dataset(tmp_path, capsys):
    data = _dataset(tmp_path / "d", _rows(4))
    status, lines, err = _inspect([data, "--check"], capsys)
    assert (status, err) == (0, "")
    assert lines[0] == f"dataset: {data}"
    assert lines[-1] == "check: 4 row(s) read, no problems"
    status, plain, _ = _inspect([data], capsys)
    assert status == 0 and len(plain) == len(lines) - 1
    assert plain[:-1] == lines[:-2] and plain[-1].startswith("open time: ")  # the report alone


def test_inspect_check_names_each_bad_row_and_exits_1(tmp_path, capsys):
    rows = _rows(7, bad={1: ("latent", math.nan), 2: ("text", math.inf)})
    rows[3]["vae_latent_dtype"] = "int7"
    rows[4]["text_embedding_bytes"] = rows[4]["text_embedding_bytes"][:-4]
    rows[5]["vae_latent_shape"] = [16, 3, 16]
    first_frame = torch.zeros(16, 3, 4, 4)
    first_frame[0, 0, 0, 0] = -math.inf
    for i, row in enumerate(rows):  # an image-to-video column on every row, non-finite on row 6
        row.update(tensor_columns("first_frame_latent", first_frame if i == 6 else torch.zeros(16, 3, 4, 4)))
    data = _dataset(tmp_path / "d", rows)
    status, lines, err = _inspect([data, "--check"], capsys)
    shard = f"{data}/{SHARD}"
    # The open (as training does) refuses the dataset at its first bad row; the check lists them all.
    assert status == 1
    assert err.startswith(f"error: {shard} row 3 (id 'tiny-0003.mp4'): vae_latent_bytes: unsupported dtype 'int7'")
    assert lines[-7:] == [
        "check: 7 row(s) read; 6 problem(s):",
        f"  {shard} row 1 (id 'tiny-0001.mp4'): vae_latent: 1 of 768 value(s) are NaN/inf",
        f"  {shard} row 2 (id 'tiny-0002.mp4'): text_embedding: 1 of 224 value(s) are NaN/inf",
        f"  {shard} row 3 (id 'tiny-0003.mp4'): vae_latent_bytes: unsupported dtype 'int7'; expected one of "
        "float32, float16, bfloat16, float64, uint8",
        f"  {shard} row 4 (id 'tiny-0004.mp4'): text_embedding_bytes: 892 bytes stored for shape [7, 32] of float32 "
        "(896 bytes expected)",
        f"  {shard} row 5 (id 'tiny-0005.mp4'): vae_latent_shape [16, 3, 16]; expected [C, T, H, W]",
        f"  {shard} row 6 (id 'tiny-0006.mp4'): first_frame_latent: 1 of 768 value(s) are NaN/inf",
    ]
    assert len(lines) == 7  # the report needs the dataset open


def test_inspect_check_on_the_nan_dataset_of_a_run(tmp_path, capsys):
    data = _dataset(tmp_path / "d", _rows(4, bad={1: ("latent", math.nan)}))
    status, lines, err = _inspect([data, "--check"], capsys)
    assert (status, err) == (1, "")
    assert lines[-2:] == [
        "check: 4 row(s) read; 1 problem(s):",
        f"  {data}/{SHARD} row 1 (id 'tiny-0001.mp4'): vae_latent: 1 of 768 value(s) are NaN/inf",
    ]


# ---- two processes: the rank that drew the row tells the others ----


@pytest.mark.slow
@pytest.mark.multiproc
def test_two_processes_set_the_row_aside_on_both_ranks(tmp_path):
    import subprocess
    import sys

    from fv_accel.config import default_recipe
    from tests.launch_helpers import ANY_FREE_PORT

    repo = Path(__file__).resolve().parent.parent
    data = _dataset(tmp_path / "d", _rows(4, bad={1: ("latent", math.nan)}))
    out = tmp_path / "out"
    over = small_overrides(out, data, **{
        "training.loop.gradient_accumulation_steps": 1,
        "training.loop.max_train_steps": 8,
        "callbacks.ema.enable": False,
    })
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"out_root": str(tmp_path / "records"),
                                "runs": [{"name": "aside", "recipe": str(default_recipe("finetune")), "overrides": over}]}))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(repo))
    env.pop("ACCELERATE_USE_CPU", None)
    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file",
           str(repo / "accelerate_configs" / "cpu_2proc.yaml"), "--num_processes", "2", *ANY_FREE_PORT,
           str(repo / "tests" / "dist_driver.py"), str(spec)]
    proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    records = [json.loads((tmp_path / "records" / "aside" / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["world_size"] for r in records] == [2, 2]
    found = [(r["rank"], s + 1) for r in records for s in (0, 1) if 1 in r["steps"][s]["samples"]]
    assert len(found) == 1  # drawn by one rank in epoch 0 (2 steps of 2 rows) ...
    (rank, step), = found
    for record in records:  # ... and by neither rank in the 6 steps after
        assert len(record["steps"]) == 8
        assert all(1 not in step["samples"] for step in record["steps"][2:])
    warnings_logged = [line for line in log.splitlines() if line.startswith("WARNING")]
    # The main process warns of the skipped step, and the one that drew the row, naming it.
    assert [line.split(": ")[1] for line in warnings_logged if "skipped step" in line] == \
        [f"skipped step {step} (1 skipped in all)"] * (1 if rank == 0 else 2)
    (named,) = [line for line in warnings_logged if "tiny-0001" in line]
    assert named.endswith(f"row 1 (id 'tiny-0001.mp4') [NaN/inf in its data], set aside for the rest of the run (process {rank})")
    summary = json.loads((out / "logs" / "summary.json").read_text())
    assert summary["skipped_steps"] == 1
    assert summary["skipped_samples"] == [{"file": f"{data}/{SHARD}", "row": 1, "id": "tiny-0001.mp4", "step": step}]
    assert "lr_scheduler.step()" not in log
