"""Issues 28 and 31, the recipe: YAML aliases are bounded before they expand, a key given twice is
refused with its line, and `models.student.transformer_config` is checked against the family's
transformer class at build time (an unknown key, a wrong `_class_name`), each in one line."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fv_accel.cli import main as cli_main
from fv_accel.config import ConfigError, default_recipe, load_config
from tests.resume_helpers import SMALL_TRANSFORMER, build_fails, small_overrides, write_latent_dataset

REPO = Path(__file__).resolve().parent.parent

# 9 aliases of 9 aliases, 9 levels deep: 9^9 (387,420,489) strings once expanded.
ALIAS_BOMB = """\
method:
  name: finetune
models:
  student:
    transformer_config:
      a: &a [x0, x0, x0, x0, x0, x0, x0, x0, x0]
      b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
      c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
      d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
      e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]
      f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]
      g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]
      h: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g]
      x0: &i [*h, *h, *h, *h, *h, *h, *h, *h, *h]
"""

# Runs the entry scripts' body on the recipe in a fresh interpreter (a bomb that expands must not take
# the test process down with it) and reports the refusal's time and the memory Python allocated for it.
MEASURE = """\
import json, sys, time, tracemalloc
from fv_accel.cli import main
tracemalloc.start()
t0 = time.perf_counter()
code = main("finetune", ["--config", sys.argv[1], "--dry-run"])
seconds = time.perf_counter() - t0
print(json.dumps({"code": code, "seconds": seconds, "peak_bytes": tracemalloc.get_traced_memory()[1]}))
"""


def test_an_alias_bomb_in_transformer_config_is_refused_before_it_expands(tmp_path):
    recipe = tmp_path / "bomb.yaml"
    recipe.write_text(ALIAS_BOMB)
    proc = subprocess.run(
        [sys.executable, "-c", MEASURE, str(recipe)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["code"] == 2
    errors = proc.stderr.strip().splitlines()
    assert errors == [
        f"error: {recipe}: its aliases expand the recipe to 490,329,074 YAML nodes (490,329,036 added by aliases, more than "
        "the 10,000 allowed; the largest is the anchor &i at line 14, 435,848,050 nodes); refused before expanding "
        "it: write the values out or share fewer of them"
    ], proc.stderr
    # The bound: refused in under 2 s and 100 MB (it takes milliseconds and kilobytes: nothing is expanded).
    assert result["seconds"] < 2.0 and result["peak_bytes"] < 100 * 2**20, result


def test_aliases_within_the_bound_and_merge_keys_still_load(tmp_path):
    recipe = tmp_path / "shared.yaml"
    recipe.write_text(textwrap.dedent("""\
        models:
          student:
            transformer_config: {num_layers: 1}
        training:
          optimizer:
            learning_rate: &small 2.0e-4
          loop:
            max_train_steps: 7
        callbacks:
          grad_clip:
            <<: {max_grad_norm: 0.5}
          validation:
            context_noise: *small
        """))
    cfg = load_config(recipe)
    assert cfg.training.optimizer.learning_rate == 2e-4 == cfg.callbacks.validation.context_noise
    assert cfg.callbacks.grad_clip.max_grad_norm == 0.5
    recursive = tmp_path / "recursive.yaml"
    recursive.write_text("training:\n  data:\n    mix: &m [*m]\n")
    with pytest.raises(ConfigError) as err:
        load_config(recursive)
    assert str(err.value) == (
        f"{recursive}: the anchor &m at line 3 refers to itself through an alias (a recursive structure); recipes cannot hold one"
    )


@pytest.mark.parametrize(
    "text,line,key,first",
    [
        # A second `training:` section would silently replace the whole first one.
        ("training:\n  data:\n    train_batch_size: 4\n  optimizer:\n    learning_rate: 2.0e-4\n"
         "method:\n  name: finetune\ntraining:\n  loop:\n    max_train_steps: 3\n", 8, "training", 1),
        # A repeated leaf key would silently take the last value.
        ("training:\n  optimizer:\n    learning_rate: 2.0e-4\n    weight_decay: 0.1\n    learning_rate: 1.0e-6\n",
         5, "training.optimizer.learning_rate", 3),
    ],
    ids=["second_section", "repeated_leaf"],
)
def test_a_key_given_twice_is_refused_with_the_file_and_both_lines(tmp_path, capsys, text, line, key, first):
    recipe = tmp_path / "twice.yaml"
    recipe.write_text(text)
    expected = (
        f"{recipe}: line {line}: key '{key}' is given a second time (first at line {first}); "
        "YAML would keep only the last one: merge the two into one"
    )
    with pytest.raises(ConfigError) as err:
        load_config(recipe)
    assert str(err.value) == expected
    capsys.readouterr()
    assert cli_main("finetune", ["--config", str(recipe), "--dry-run"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"error: {expected}"]


def test_a_command_line_value_is_held_to_the_same_rules():
    from fv_accel.config import parse_cli

    with pytest.raises(ConfigError) as err:
        parse_cli(["--training.data.mix", "[{data_path: a, data_path: b}]"], "finetune")
    assert str(err.value).startswith("command line --training.data.mix: line 1: key '[0].data_path' is given a second time")


# ---- transformer_config against the family's transformer class -------------------------------------


@pytest.fixture(scope="module")
def latent_data(tmp_path_factory):
    return write_latent_dataset(tmp_path_factory.mktemp("latents"), num_clips=4)


def test_an_unknown_transformer_config_key_is_one_line_naming_the_key_and_the_class(tmp_path, latent_data):
    config = {**SMALL_TRANSFORMER, "num_layer": 2}
    over = small_overrides(tmp_path / "out", latent_data, **{"models.student.transformer_config": config})
    text = build_fails("finetune", over, ConfigError, "")
    assert text == (
        "models.student.transformer_config: unknown key 'num_layer' for WanTransformer3DModel (did you mean 'num_layers'?); "
        "its keys: added_kv_proj_dim, attention_head_dim, cross_attn_norm, eps, ffn_dim, freq_dim, image_dim, in_channels, "
        "num_attention_heads, num_layers, out_channels, patch_size, pos_embed_seq_len, qk_norm, rope_max_seq_len, text_dim"
    )
    assert not (tmp_path / "out").exists()


def test_transformer_config_class_name_picks_the_family_or_is_refused_in_one_line(tmp_path, latent_data):
    over = small_overrides(tmp_path / "out", latent_data)
    # A config.json pasted inline: its `_class_name` and `_diffusers_version` are the file's own bookkeeping.
    pasted = {**SMALL_TRANSFORMER, "_class_name": "WanTransformer3DModel", "_diffusers_version": "0.35.0"}
    from tests.resume_helpers import build

    run = build("finetune", {**over, "models.student.transformer_config": pasted, "training.loop.max_train_steps": 1})
    assert type(run.method.student.transformer).__name__ == "WanTransformer3DModel"
    run.output_lock.release(remove_created_dir=True)
    wrong = {**SMALL_TRANSFORMER, "_class_name": "WanTransformer3DModl"}
    text = build_fails("finetune", {**over, "training.checkpoint.output_dir": str(tmp_path / "o2"),
                                    "models.student.transformer_config": wrong}, ConfigError, "")
    assert text.startswith(
        "models.student.transformer_config._class_name: 'WanTransformer3DModl' is not a transformer class fv_accel "
        "trains; supported: "
    ) and "WanTransformer3DModel" in text, text


def test_a_wrong_class_name_in_a_model_folders_config_is_one_line_naming_the_file(tmp_path, latent_data):
    from fv_accel.models.loading import ModelLoadError

    model = tmp_path / "model"
    (model / "transformer").mkdir(parents=True)
    (model / "transformer" / "config.json").write_text(json.dumps({**SMALL_TRANSFORMER, "_class_name": "WanTransformer3DModl"}))
    over = small_overrides(tmp_path / "out", latent_data, **{"models.student.init_from": str(model),
                                                              "models.student.transformer_config": None})
    text = build_fails("finetune", over, ModelLoadError, "")
    assert text.startswith(
        f"model '{model}': transformer/config.json names transformer class 'WanTransformer3DModl' (_class_name), which is "
        "not supported; supported: "
    ), text
