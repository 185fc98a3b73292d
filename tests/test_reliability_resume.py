"""Issues 28 and 31, resuming: a finished run is extended to a longer one (and the LR schedule's
length rule said), changed data behind the same path is refused, a checkpoint of another engine or
of another kind of run (LoRA / full) is named in one line, an empty exception message stays one
line, and under DeepSpeed a process with a finite loss names the process whose loss was not."""

from __future__ import annotations

import logging
import types
from pathlib import Path

import pytest
import torch

from fv_accel.checkpoint import CheckpointError, latest_checkpoint, read_metadata
from fv_accel.config import default_recipe, load_config
from fv_accel.trainer import Trainer
from tests.resume_helpers import build, ema_shadow, reset_accelerate, small_overrides, weights, write_latent_dataset

# A schedule whose shape does not depend on the run's length: extending a run is exactly a longer run.
# (One micro-batch a step: the test is about the schedule and the state, not accumulation.)
LENGTH_FREE = {"training.optimizer.lr_scheduler": "constant_with_warmup", "training.optimizer.lr_warmup_steps": 3,
               "training.loop.gradient_accumulation_steps": 1}


def small(out: Path, data: str, **extra) -> dict:
    """resume_helpers' one-block recipe without the end-of-run plots (seconds of matplotlib per run)."""
    return small_overrides(out, data, **{"training.tracker.write_plots": False, **extra})


@pytest.fixture(scope="module")
def latent_data(tmp_path_factory):
    return write_latent_dataset(tmp_path_factory.mktemp("latents"), num_clips=6)


def test_a_finished_run_extends_to_the_weights_of_a_straight_longer_run(tmp_path, latent_data, caplog):
    out = tmp_path / "out"
    four = small(out, latent_data, **LENGTH_FREE, **{"training.loop.max_train_steps": 4,
                                                               "training.checkpoint.training_state_checkpointing_steps": 2})
    Trainer(build("finetune", four)).run()
    # The last step has its checkpoint, as every interval step.
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert latest_checkpoint(out) == out / "checkpoint-4"

    with caplog.at_level(logging.WARNING, logger="fv_accel.checkpoint"):
        extended = build("finetune", {**four, "training.loop.max_train_steps": 6, "training.checkpoint.resume_from_checkpoint": "latest"})
    assert extended.start_step == 4
    assert (
        "training.loop.max_train_steps 4 -> 6: the constant_with_warmup LR schedule does not depend on the run's length: "
        "the run goes on as one straight run of 6 steps would"
    ) in caplog.text
    assert Trainer(extended).run()["final_step"] == 6
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    reset_accelerate()

    straight = build("finetune", small(tmp_path / "straight", latent_data, **LENGTH_FREE,
                                                 **{"training.loop.max_train_steps": 6}))
    Trainer(straight).run()
    got, want = weights(extended), weights(straight)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    assert all(torch.equal(a, b) for a, b in zip(ema_shadow(extended), ema_shadow(straight)))


def test_a_decaying_schedule_is_laid_out_again_over_the_new_length_and_says_so():
    from fv_accel.optim import schedule_length_change

    cfg = load_config(default_recipe("finetune"), {"training.optimizer.lr_scheduler": "linear", "training.optimizer.lr_warmup_steps": 0,
                                                   "training.optimizer.learning_rate": 1e-3, "training.loop.max_train_steps": 6})
    # Step k trains at lr * (N - (k - 1)) / N: the 4-step run's step 4 at 2.5e-4; step 5 of a 6-step schedule at 3.33e-4.
    assert schedule_length_change(cfg, 4, 4) == (
        "the linear LR schedule depends on the run's length: from step 5 it follows the 6-step schedule (LR 0.000333 "
        "there; the 4-step schedule gave 0.00025 at step 4), so the weights differ from those of a straight 6-step run"
    )


# ---- 31.2: the data behind a checkpoint ----------------------------------------------------------


def test_data_replaced_at_the_same_path_is_refused_on_resume_unless_allowed(tmp_path, caplog):
    data = tmp_path / "data"
    write_latent_dataset(data, num_clips=8)
    out = tmp_path / "out"
    over = small(out, str(data), **{"training.loop.max_train_steps": 2, "training.checkpoint.training_state_checkpointing_steps": 2})
    Trainer(build("finetune", over)).run()
    size_then = (data / "data.parquet").stat().st_size
    write_latent_dataset(data, num_clips=24, seed=1)  # new contents, same path
    resume = {**over, "training.loop.max_train_steps": 3, "training.checkpoint.resume_from_checkpoint": "latest"}
    with pytest.raises(CheckpointError) as err:
        build("finetune", resume)
    assert str(err.value) == (
        f"cannot resume from {out / 'checkpoint-2'}: the training data changed since it was saved (training.data.data_path: "
        f"24 rows, 8 in the checkpoint; training.data.data_path: data.parquet is {(data / 'data.parquet').stat().st_size} bytes, "
        f"{size_then} in the checkpoint); resume on the data it was trained on, or set "
        "training.checkpoint.allow_recipe_change: true to train on with this data"
    )
    with caplog.at_level(logging.WARNING, logger="fv_accel.checkpoint"):
        run = build("finetune", {**resume, "training.checkpoint.allow_recipe_change": True})
    assert f"resuming from {out / 'checkpoint-2'} on changed training data (training.data.data_path: 24 rows, 8 in the checkpoint" in caplog.text
    assert {"step": 2, "key": "training.data (fingerprint)", "old": "8 rows in 1 file(s)", "new": "24 rows in 1 file(s)"} in run.trainer_state["recipe_changes"]


def test_the_tiny_dataset_is_fingerprinted_too(tmp_path, tiny_data_path):
    """`data_path: tiny` resolves to a generated folder in the cache; a cache rebuilt with other contents
    (here: the session's tiny dataset, copied, then cut to 6 of its 8 clips) is refused like any other."""
    import json
    import shutil

    import pyarrow.parquet as pq

    from fv_accel.data.schema import DATASET_INFO
    from tests.conftest import tiny_overrides

    cache = tmp_path / "cache"
    generated = Path(tiny_data_path).parent
    shutil.copytree(generated, cache / generated.name, ignore=shutil.ignore_patterns("videos", "tiny-model"))
    over = tiny_overrides(tmp_path, **{"training.data.tiny_cache_dir": str(cache), "training.loop.max_train_steps": 1,
                                       "training.checkpoint.training_state_checkpointing_steps": 1})
    Trainer(build("finetune", over)).run()
    assert read_metadata(tmp_path / "out" / "checkpoint-1")["data_fingerprint"][0]["rows"] == 8
    latents = cache / generated.name / "latents"
    (shard,) = latents.glob("*.parquet")
    pq.write_table(pq.read_table(shard).slice(0, 6), shard)
    info = json.loads((latents / DATASET_INFO).read_text())
    (latents / DATASET_INFO).write_text(json.dumps({**info, "num_rows": 6}))
    with pytest.raises(CheckpointError, match=r"the training data changed since it was saved \(training.data.data_path: 6 rows, 8 in the checkpoint"):
        build("finetune", {**over, "training.loop.max_train_steps": 2, "training.checkpoint.resume_from_checkpoint": "latest"})


# ---- 31, weak: engines and kinds of run ------------------------------------------------------------


@pytest.fixture(scope="module")
def finished(tmp_path_factory, latent_data):
    """A one-process full fine-tune of 2 steps with its final checkpoint."""
    out = tmp_path_factory.mktemp("finished") / "out"
    over = small(out, latent_data, **{"training.loop.max_train_steps": 2, "training.checkpoint.training_state_checkpointing_steps": 2})
    Trainer(build("finetune", over)).run()
    reset_accelerate()
    return out / "checkpoint-2", over


def _fake_launch(kind: str):
    """What a launch of another engine hands build_from_config: its Accelerator's engine. The check
    comes before anything else asks the Accelerator for more."""
    from accelerate.utils import DistributedType

    plugin = types.SimpleNamespace(deepspeed_config={"zero_optimization": {"stage": 2}})
    return types.SimpleNamespace(distributed_type=DistributedType[kind], num_processes=2, is_main_process=True,
                                 state=types.SimpleNamespace(deepspeed_plugin=plugin))


@pytest.mark.parametrize("kind,name", [("FSDP", "FSDP2"), ("DEEPSPEED", "DeepSpeed ZeRO-2")])
def test_a_checkpoint_resumed_under_another_engine_is_one_line(finished, tmp_path, kind, name):
    from fv_accel.build import build_from_config

    ckpt, over = finished
    reset_accelerate()
    with pytest.raises(CheckpointError) as err:
        build_from_config(default_recipe("finetune"), {**over, "training.checkpoint.output_dir": str(tmp_path / "new"),
                                                       "training.checkpoint.resume_from_checkpoint": str(ckpt)},
                          accelerator=_fake_launch(kind))
    assert str(err.value) == (
        f"{ckpt}: checkpoint written by one process, this launch is {name}: it cannot be converted (each engine stores "
        "the model and optimizer state in its own layout); resume it under one process (the launch configuration that "
        f"wrote it), or start a new run from its weights with a fresh optimizer: `python -m fv_accel.export {ckpt} "
        "--to diffusers` writes them as a transformer folder for models.student.init_from"
    )
    assert not (tmp_path / "new").exists()


def test_a_lora_checkpoint_resumed_as_a_full_fine_tune_and_back_is_one_line(finished, latent_data, tmp_path):
    ckpt, over = finished
    with pytest.raises(CheckpointError) as err:
        build("finetune", {**over, "training.checkpoint.resume_from_checkpoint": str(ckpt), "models.student.lora.enable": True,
                           "training.checkpoint.output_dir": str(tmp_path / "lora")})
    assert str(err.value).startswith(
        f"{ckpt}: checkpoint written by a full fine-tune, this launch trains a LoRA adapter (models.student.lora.enable: true): "
        "there is no adapter in it to resume; resume it with models.student.lora.enable: false, or start a LoRA run on its weights: "
    )
    out = tmp_path / "lora_run"
    lora = small(out, latent_data, **{"models.student.lora.enable": True, "training.loop.max_train_steps": 1,
                                                 "training.checkpoint.training_state_checkpointing_steps": 1})
    Trainer(build("finetune", lora)).run()
    with pytest.raises(CheckpointError) as err:
        build("finetune", {**lora, "models.student.lora.enable": False, "training.loop.max_train_steps": 2,
                           "training.checkpoint.resume_from_checkpoint": "latest"})
    assert str(err.value) == (
        f"{out / 'checkpoint-1'}: checkpoint written by a LoRA run (models.student.lora.enable: true), this launch trains the "
        "full model: the checkpoint holds the adapter and its optimizer state only, which a full fine-tune cannot resume; "
        "resume it with models.student.lora.enable: true, or start a full fine-tune from the merged weights: "
        f"`python -m fv_accel.export {out / 'checkpoint-1'} --to merged`, then models.student.init_from that folder"
    )


def test_a_load_error_without_a_message_is_still_one_line(finished, tmp_path, monkeypatch):
    """Accelerate and torch raise some errors without a message (a bare `assert`)."""
    import accelerate

    ckpt, over = finished

    def load_state(self, *args, **kwargs):
        raise AssertionError()

    monkeypatch.setattr(accelerate.Accelerator, "load_state", load_state)
    with pytest.raises(CheckpointError) as err:
        build("finetune", {**over, "training.checkpoint.output_dir": str(tmp_path / "new"), "training.loop.max_train_steps": 3,
                           "training.checkpoint.resume_from_checkpoint": str(ckpt)})
    assert str(err.value) == f"cannot resume from {ckpt}: AssertionError while loading; there is no complete checkpoint before it in {ckpt.parent}"


# ---- 31, weak: under DeepSpeed, which process had the non-finite loss ----------------------------------


def test_a_process_with_a_finite_loss_names_the_process_whose_loss_was_not(monkeypatch):
    """DeepSpeed checks each micro-batch's loss before backward; every process gets the verdict of
    the collective. Process 1 (finite loss) must not report its own loss as the non-finite one."""
    import torch.distributed as dist
    from accelerate.utils import DistributedType

    sent = {}

    def trainer_on(rank: int) -> Trainer:
        acc = types.SimpleNamespace(num_processes=2, process_index=rank, device=torch.device("cpu"), scaler=None,
                                    distributed_type=DistributedType.DEEPSPEED)
        run = types.SimpleNamespace(accelerator=acc, config=load_config(default_recipe("finetune")), method=None,
                                    dataloader=None, start_step=0, callbacks=[])
        return Trainer(run)

    def all_reduce(tensor, op=None):
        # The collective of two processes: each sends its tensor, both get the elementwise maximum.
        sent.setdefault("first", tensor.clone())
        tensor.copy_(torch.maximum(tensor, sent["first"]))

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    nan, finite = torch.tensor(float("nan")), torch.tensor(0.53)
    on_0 = trainer_on(0)._find_fault(nan, None, [(nan, None)], 3)
    on_1 = trainer_on(1)._find_fault(finite, None, [(finite, None)], 3)
    assert on_0 == "non-finite loss at step 3 on this process (0): loss=nan (micro-batches [nan]), grad_norm=None, timesteps=[None]"
    assert on_1 == (
        "non-finite loss at step 3 on process 0; this process (1) has a finite loss: loss=0.53 (micro-batches "
        "[0.5299999713897705]), grad_norm=None, timesteps=[None]"
    )
