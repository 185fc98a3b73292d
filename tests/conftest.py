"""Shared fixtures: tiny models and datasets built from configs, no network."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", autouse=True)
def _cache_dir(tmp_path_factory):
    """One generated tiny model/dataset cache for the whole session (never the user's cache)."""
    cache = tmp_path_factory.mktemp("fv_cache")
    old = os.environ.get("FV_ACCEL_CACHE")
    os.environ["FV_ACCEL_CACHE"] = str(cache)
    os.environ.setdefault("HF_DATASETS_CACHE", str(cache / "hf_datasets"))
    yield cache
    if old is None:
        os.environ.pop("FV_ACCEL_CACHE", None)
    else:
        os.environ["FV_ACCEL_CACHE"] = old


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The tiny Wan model in the Hub layout (transformer, vae, text_encoder, tokenizer, scheduler)."""
    from fv_accel.tiny.model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny_model") / "tiny-wan", seed=0)


@pytest.fixture(scope="session")
def tiny_variant_dir(tmp_path_factory):
    """tiny_variant_dir(name): the folder of the tiny model `name` (fv_accel.tiny.model.TINY_MODELS,
    seed 0), written at its first use in the session."""
    from fv_accel.tiny.model import write_tiny_variant

    written = {}

    def get(name: str):
        if name not in written:
            written[name] = write_tiny_variant(tmp_path_factory.mktemp("tiny_variant") / name, name, seed=0)
        return written[name]

    return get


@pytest.fixture(scope="session")
def tiny_model_of(tmp_path_factory, tiny_variant_dir):
    """tiny_model_of(name): the folder of any tiny model `python -m fv_accel.tiny_model --list` names
    (seed 0), written at its first use in the session (the Wan variants: tiny_variant_dir's)."""
    from fv_accel.tiny import tiny_models
    from fv_accel.tiny.model import TINY_MODELS

    models = tiny_models()
    written = {}

    def get(name: str):
        if name in TINY_MODELS:
            return tiny_variant_dir(name)
        if name not in written:
            written[name] = models[name].write(tmp_path_factory.mktemp("tiny_model_of") / name, 0)
        return written[name]

    return get


@pytest.fixture(scope="session")
def tiny_data_path(_cache_dir):
    """The built-in tiny dataset (Parquet in FastVideo's schema), built once per session."""
    from fv_accel.config import default_recipe, load_config
    from fv_accel.tiny.data import ensure_tiny_dataset

    cfg = load_config(default_recipe("finetune"))
    return str(ensure_tiny_dataset(cfg.training.data))


# The tests' DFSFT scale: a 2-block, 96-wide Wan (tiny_finetune.yaml's transformer), batch 2 at
# learning rate 1e-3 and text padded to 512 tokens (the real models' length). The DFSFT demo recipe
# trains a 4-block, 128-wide Wan on batches of 8 with 16-token text; the tests run the code paths, at
# ~25 ms a step, on this one.
TEST_SCALE = {
    "models.student.transformer_config.num_layers": 2,
    "models.student.transformer_config.attention_head_dim": 24,
    "models.student.transformer_config.ffn_dim": 192,
    "training.data.train_batch_size": 2,
    "training.optimizer.learning_rate": 1.0e-3,
    "training.data.text_max_length": 512,
}


def tiny_overrides(tmp_path, **extra):
    """Overrides that keep a tiny run fast and inside tmp_path (TEST_SCALE, no checkpoints, trackers,
    samples, EMA or plots)."""
    out = {
        **TEST_SCALE,
        "training.checkpoint.output_dir": str(tmp_path / "out"),
        "training.tracker.trackers": ["none"],
        "training.checkpoint.training_state_checkpointing_steps": 0,
        # The tiny recipes' demo extras (sample videos, held-out loss, EMA, plots) cost seconds per
        # run; tests that want them switch them back on.
        "callbacks.validation.enable": False,
        "callbacks.ema.enable": False,
        "training.tracker.write_plots": False,
    }
    out.update(extra)
    return out


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """Each in-process run builds its own Accelerator: reset Accelerate's singletons around it."""
    yield
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()
