"""Bad input gets one clear line naming the file/key/value and what was expected, before anything is
written to the output folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from fv_accel.checkpoint import CheckpointError
from fv_accel.cli import main as cli_main
from fv_accel.config import ConfigError, default_recipe, load_config
from fv_accel.trainer import Trainer
from tests.resume_helpers import build, build_fails, output_files, small_overrides, write_latent_dataset


@pytest.fixture(scope="module")
def latent_data(tmp_path_factory):
    return write_latent_dataset(tmp_path_factory.mktemp("latents"), num_clips=4)




def test_misspelled_key_in_a_recipe_file(tmp_path, latent_data, capsys):
    recipe = yaml.safe_load(default_recipe("finetune").read_text())
    recipe["training"]["optimizer"]["learnig_rate"] = recipe["training"]["optimizer"].pop("learning_rate")
    recipe["training"]["checkpoint"]["output_dir"] = str(tmp_path / "out")
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).startswith(f"{path}: unknown key 'training.optimizer.learnig_rate' (did you mean 'learning_rate'?)")
    # The command line prints the same, as one line, and exits 2.
    assert cli_main("finetune", ["--config", str(path)]) == 2
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert len(err_lines) == 1 and err_lines[0].startswith(f"error: {path}: unknown key 'training.optimizer.learnig_rate'")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("training.loop.max_train_steps", "ten", "key 'training.loop.max_train_steps': expected an integer, got 'ten'"),
        ("training.optimizer.learning_rate", -1e-4, "key 'training.optimizer.learning_rate': expected a number > 0, got -0.0001"),
        ("training.loop.nan_policy", "ignore", "key 'training.loop.nan_policy': expected one of 'auto', 'skip', 'stop', got 'ignore'"),
    ],
    ids=["wrong_type", "negative_lr", "unknown_choice"],
)
def test_wrong_values_name_the_key(tmp_path, latent_data, key, value, message):
    build_fails("finetune", small_overrides(tmp_path / "out", latent_data, **{key: value}), ConfigError, message)


def test_chunk_size_larger_than_the_latent_frame_count(tmp_path, latent_data):
    text = build_fails(
        "dfsft",
        small_overrides(tmp_path / "out", latent_data, **{"method.chunk_size": 5}),
        ConfigError,
        "method.chunk_size (5) is larger than the latent frame count (3) of",
    )
    assert "use a chunk size <= 3" in text and latent_data in text


def test_chunk_size_different_from_the_models_causal_block(tmp_path, latent_data, monkeypatch):
    import fv_accel.models as models

    real = models.build_student

    def causal_student(cfg):
        # A student whose attention is block-causal over 2 latent frames, fixed by the model.
        student = real(cfg)
        student.causal_block_size = 2
        return student

    monkeypatch.setattr(models, "build_student", causal_student)
    build_fails(
        "dfsft",
        small_overrides(tmp_path / "out", latent_data, **{"method.chunk_size": 3}),
        ValueError,
        "method.chunk_size (3) must equal the student's causal block size (2)",
    )


def test_latents_with_the_wrong_channel_count(tmp_path):
    data = write_latent_dataset(tmp_path / "latents8", num_clips=4, channels=8)
    text = build_fails(
        "finetune",
        small_overrides(tmp_path / "out", data),
        ConfigError,
        "latents have 8 channels (shape [8, 3, 4, 4]) but the student transformer expects 16 (in_channels)",
    )
    assert text.startswith(f"{data}/data.parquet row 0 (id 'clip-0'):")


def test_empty_dataset(tmp_path, capsys):
    import datasets

    from fv_accel.data.schema import make_row

    empty = tmp_path / "empty"
    empty.mkdir()
    row = make_row(sample_id="x", latent=torch.zeros(16, 3, 4, 4), text_embedding=torch.zeros(7, 32), caption="x")
    datasets.Dataset.from_list([row]).select([]).to_parquet(str(empty / "data.parquet"))
    message = f"{empty}: the dataset is empty (0 rows in 1 Parquet file(s))"
    build_fails("finetune", small_overrides(tmp_path / "out", str(empty)), ValueError, message)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(load_config(default_recipe("finetune"), small_overrides(tmp_path / "out", str(empty))).to_yaml())
    capsys.readouterr()
    assert cli_main("finetune", ["--config", str(recipe)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"error: {message}"]
    assert not (tmp_path / "out").exists()
    no_files = tmp_path / "no_files"
    no_files.mkdir()
    build_fails(
        "finetune",
        small_overrides(tmp_path / "out", str(no_files)),
        FileNotFoundError,
        f"training.data.data_path: no .parquet files under '{no_files}'",
    )


def test_output_dir_holding_another_runs_checkpoints(tmp_path, latent_data, capsys):
    out = tmp_path / "out"
    first = small_overrides(
        out, latent_data, **{"training.loop.max_train_steps": 2, "training.checkpoint.training_state_checkpointing_steps": 1}
    )
    Trainer(build("finetune", first)).run()
    text = build_fails(
        "finetune",
        small_overrides(out, latent_data),
        CheckpointError,
        f"training.checkpoint.output_dir: '{out}' already holds checkpoints of another run (checkpoint-1, checkpoint-2)",
    )
    assert "--resume_from_checkpoint latest" in text
    # Resuming it is fine (its last step has a checkpoint too).
    assert build("finetune", {**first, "training.checkpoint.resume_from_checkpoint": "latest"}).start_step == 2
    # From the command line: one line, exit 2.
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(load_config(default_recipe("finetune"), small_overrides(out, latent_data)).to_yaml())
    capsys.readouterr()
    assert cli_main("finetune", ["--config", str(recipe)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: training.checkpoint.output_dir: '{out}' already holds")
