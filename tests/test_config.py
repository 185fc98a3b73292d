"""Recipe loading: strict keys and types, dotted overrides, the CLI flags."""

import subprocess
import sys

import pytest
import yaml

from fv_accel.config import ConfigError, default_recipe, load_config, parse_cli
from tests.conftest import REPO


def write(tmp_path, data, name="recipe.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def test_defaults_follow_reference():
    from fv_accel.config import RunConfig

    assert load_config(default_recipe("dfsft")).method.name == "dfsft"
    cfg = RunConfig()  # the dataclass defaults (recipes may override them)
    # Unset: the family's own; a Wan student trains on REFERENCE.md's 3.0.
    assert cfg.models.student.flow_shift is None
    from fv_accel.models.wan import WanStudent

    assert WanStudent.default_flow_shift == 3.0
    assert cfg.training.optimizer.betas == [0.9, 0.999]
    assert cfg.training.optimizer.eps == 1e-8
    assert cfg.training.model.logit_std == 1.0
    assert cfg.callbacks.grad_clip.max_grad_norm == 1.0
    assert cfg.callbacks.ema.decay == 0.9999
    assert cfg.training.optimizer.weight_decay == 0.0
    assert cfg.training.optimizer.lr_scheduler == "constant"
    assert cfg.training.loop.gradient_accumulation_steps == 1
    assert cfg.training.data.train_batch_size == 1
    assert cfg.training.model.weighting_scheme == "uniform"


def test_unknown_key_names_key_and_file(tmp_path):
    path = write(tmp_path, {"training": {"optimizer": {"learnig_rate": 1e-4}}})
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert "training.optimizer.learnig_rate" in msg
    assert str(path) in msg
    assert "learning_rate" in msg  # the suggestion


def test_a_recipe_without_a_model_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="models.student.init_from"):
        load_config(write(tmp_path, {"training": {"loop": {"max_train_steps": 3}}}))


def test_unknown_section_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="'distributed'"):
        load_config(write(tmp_path, {"distributed": {"num_gpus": 8}}))


@pytest.mark.parametrize(
    "data, key",
    [
        ({"training": {"loop": {"max_train_steps": "many"}}}, "training.loop.max_train_steps"),
        ({"training": {"loop": {"max_train_steps": 1.5}}}, "training.loop.max_train_steps"),
        ({"training": {"model": {"precondition_outputs": "yes"}}}, "training.model.precondition_outputs"),
        ({"training": {"optimizer": {"betas": 0.9}}}, "training.optimizer.betas"),
        ({"training": {"optimizer": {"lr_scheduler": "cosine_annealing"}}}, "training.optimizer.lr_scheduler"),
        ({"models": {"student": {"lora": {"rank": True}}}}, "models.student.lora.rank"),
    ],
)
def test_wrong_type_names_the_key(tmp_path, data, key):
    path = write(tmp_path, data)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert key in str(err.value) and str(path) in str(err.value)


@pytest.mark.parametrize(
    "override, key",
    [
        ({"training.optimizer.learning_rate": -1e-4}, "training.optimizer.learning_rate"),
        ({"training.optimizer.learning_rate": 0}, "training.optimizer.learning_rate"),
        ({"training.model.logit_std": -1}, "training.model.logit_std"),
        ({"training.data.training_cfg_rate": 1.5}, "training.data.training_cfg_rate"),
        ({"models.student.flow_shift": 0}, "models.student.flow_shift"),
        ({"training.loop.gradient_accumulation_steps": 0}, "training.loop.gradient_accumulation_steps"),
        ({"training.model.compile": "full"}, "training.model.compile"),
        ({"models.student.storage_dtype": "float8"}, "models.student.storage_dtype"),
        # A frozen base in fp8 is a LoRA run's: a fully trained model is refused.
        ({"models.student.storage_dtype": "float8_e4m3fn"}, "models.student.storage_dtype"),
        (
            {"models.student.storage_dtype": "bfloat16", "models.student.lora.enable": True, "training.model.compile": "blocks"},
            "training.model.compile",
        ),
        ({"callbacks.validation.distance_clips": -1}, "callbacks.validation.distance_clips"),
    ],
)
def test_out_of_range_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(default_recipe("finetune"), override)


def test_zero_is_zero_not_a_default():
    cfg = load_config(default_recipe("finetune"), {"training.model.logit_std": 0, "training.model.logit_mean": 0})
    assert cfg.training.model.logit_std == 0.0


def test_yaml_exponent_without_dot_is_a_number(tmp_path):
    # YAML 1.1 reads "1e-6" as a string; a learning rate written that way must still work.
    path = tmp_path / "r.yaml"
    path.write_text("models:\n  student:\n    init_from: org/model\ntraining:\n  optimizer:\n    learning_rate: 1e-6\n")
    assert load_config(path).training.optimizer.learning_rate == 1e-6


def test_cli_dotted_overrides_and_shorthands(tmp_path):
    cfg, flags = parse_cli(
        [
            "--training.optimizer.learning_rate",
            "2e-6",
            "--method.chunk_size",
            "1",
            "--output_dir",
            str(tmp_path / "o"),
            "--resume_from_checkpoint=latest",
            "--dry-run",
        ],
        "dfsft",
    )
    assert cfg.training.optimizer.learning_rate == 2e-6
    assert cfg.method.chunk_size == 1
    assert cfg.training.checkpoint.output_dir == str(tmp_path / "o")
    assert cfg.training.checkpoint.resume_from_checkpoint == "latest"
    assert flags["dry_run"] is True


def test_cli_unknown_option_and_wrong_method():
    with pytest.raises(ConfigError, match="--lr"):
        parse_cli(["--lr", "1"], "finetune")
    with pytest.raises(ConfigError, match="method.name"):
        parse_cli(["--config", str(default_recipe("dfsft"))], "finetune")
    with pytest.raises(ConfigError, match="training.optimizer.learnig_rate"):
        parse_cli(["--training.optimizer.learnig_rate", "1"], "finetune")


def test_dry_run_prints_resolved_recipe_and_exits():
    proc = subprocess.run(
        [sys.executable, "train_dfsft.py", "--dry-run", "--method.chunk_size", "2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    printed = yaml.safe_load(proc.stdout)
    assert printed["method"]["chunk_size"] == 2
    assert printed["method"]["name"] == "dfsft"
    assert printed["training"]["optimizer"]["betas"] == [0.9, 0.999]


def test_entry_script_reports_config_errors_in_one_line():
    proc = subprocess.run(
        [sys.executable, "train_finetune.py", "--training.loop.max_train_steps", "abc"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "training.loop.max_train_steps" in proc.stderr
    assert "Traceback" not in proc.stderr
