"""Text-only datasets (FastVideo's `preprocessed_data_type: text_only`): prompts files preprocessed into
text embeddings without video latents, loaded into batches without `vae_latent`, the rollout's latent
shape from the recipe, and the methods and rollout modes that need video latents refusing them."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from fv_accel.config import ConfigError
from fv_accel.preprocess import InputError, main, preprocess_prompts

CPU = torch.device("cpu")
PROMPTS = [
    "a red circle moving left on a dark background",
    "a blue square   rotating slowly",  # cleaned by the Wan pipeline to single spaces
    "",
    "a green triangle bouncing",
    "a blue square rotating slowly",  # the second prompt as the model encodes it: a duplicate
]


def _rows(out: Path) -> list[dict]:
    import pyarrow.parquet as pq

    rows = []
    for f in sorted(out.glob("data-*.parquet")):
        rows += pq.read_table(f).to_pylist()
    return rows


@pytest.fixture(scope="module")
def encoder(tiny_model_dir):
    from fv_accel.models.encoders import TextVideoEncoder

    return TextVideoEncoder(str(tiny_model_dir), device=CPU)


@pytest.fixture(scope="module")
def prompts_dataset(tiny_model_dir, tmp_path_factory):
    """A text-only dataset made by the command line from a text file of PROMPTS (one blank line)."""
    root = tmp_path_factory.mktemp("prompts")
    (root / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    argv = ["--model", str(tiny_model_dir), "--prompts", str(root / "prompts.txt"), "--output", str(root / "out"), "--dtype", "float32"]
    return root, argv


def test_prompts_file_preprocesses_into_a_text_only_dataset(prompts_dataset, encoder, capsys):
    from fv_accel.data.schema import dataset_is_text_only

    root, argv = prompts_dataset
    out = root / "out"
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("text file of prompts: 3 prompt(s) encoded now, 0 reused from earlier runs, on 1 process(es)")
    assert lines[-1] == (
        "encoded 4 prompt(s) (text only), skipped 0 (see skipped.jsonl); 1 duplicate prompt(s) kept, each a row of "
        "its own (first: prompts.txt line 5 repeats prompts.txt line 2); 1 blank line(s) ignored"
    )
    rows = _rows(out)
    assert [r["id"] for r in rows] == ["prompts.txt line 1", "prompts.txt line 2", "prompts.txt line 4", "prompts.txt line 5"]
    assert not any(k.startswith("vae_latent") for k in rows[0])
    assert rows[1]["caption"] == rows[3]["caption"] == "a blue square rotating slowly"
    assert rows[1]["text_embedding_bytes"] == rows[3]["text_embedding_bytes"]
    assert {r["media_type"] for r in rows} == {"text"} and {r["file_name"] for r in rows} == {"prompts.txt"}
    info = json.loads((out / "fv_dataset.json").read_text())
    assert info["preprocessed_data_type"] == "text_only" and info["family"] == "wan" and info["model"] == argv[1]
    assert info["num_rows"] == 4 and info["conditioning"] == ["text"] and info["scale_factor_spatial"] == 8
    assert info["text_encoder"] == {"dtype": "float32", "max_length": 512}
    assert info["latents_mean"] == encoder.vae.config.latents_mean
    assert info["prompts"] == {
        "file": "prompts.txt", "blank_lines": 1, "duplicates": 1,
        "first_duplicates": [{"row": "prompts.txt line 5", "repeats": "prompts.txt line 2"}],
    }
    assert (out / "skipped.jsonl").read_text() == ""
    assert dataset_is_text_only(out) and not (out / ".fv_pending").exists()
    # A rerun reuses every row (the duplicate is not counted as reused) and rewrites nothing.
    before = {f.name: f.stat().st_mtime_ns for f in out.glob("data-*.parquet")}
    assert main(argv) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith("text file of prompts: 0 prompt(s) encoded now, 3 reused")
    assert {f.name: f.stat().st_mtime_ns for f in out.glob("data-*.parquet")} == before


def test_text_only_batches_hold_the_encoders_text_and_no_latent(prompts_dataset, encoder):
    from fv_accel.config import default_recipe, load_config
    from fv_accel.data.loader import build_train_loader, pad_text

    root, argv = prompts_dataset
    out = root / "out"
    if not (out / "fv_dataset.json").is_file():
        assert main(argv) == 0
    cfg = load_config(default_recipe("finetune"), {"training.data.data_path": str(out), "training.data.train_batch_size": 2})
    loader = build_train_loader(cfg, world_size=1, rank=0)
    assert loader.preprocessed_data_type == "text_only" and loader.dataset.text_only
    assert loader.dataset.latent_shapes == [] and loader.rollout_tokens == 0  # no training.data.num_* keys
    batch = next(iter(loader))
    assert "vae_latent" not in batch
    assert {"text_embedding", "text_attention_mask", "sample_index", "epoch", "source", "nonfinite", "caption"} <= set(batch)
    assert batch["text_embedding"].shape == (2, 512, 32) and batch["nonfinite"] == [False, False]
    assert loader.batch_tokens(batch) == 0
    for k, index in enumerate(batch["sample_index"].tolist()):
        prompt = [p for p in PROMPTS if p][index]
        expected, mask = pad_text(encoder.encode_caption(prompt)["text_embedding"], 512)
        assert torch.equal(batch["text_embedding"][k], expected)
        assert torch.equal(batch["text_attention_mask"][k], mask) and 1 < int(mask.sum()) < 512
        assert batch["source"][k].endswith(f"row {index} (id {_rows(out)[index]['id']!r})")
    from fv_accel.data.inspect import report

    lines = report(str(out))
    assert "text-only dataset (preprocessed_data_type text_only): prompts without video latents" in lines
    assert "  text_embedding: float32 x 4" in lines and "steps per epoch: 4" in lines


def test_prompts_csv_variants_and_errors(encoder, tmp_path, capsys, tiny_model_dir):
    txt = tmp_path / "p.txt"
    txt.write_text("a red circle\na blue square\n")
    by_text = {r["caption"]: r["text_embedding_bytes"] for r in (preprocess_prompts("tiny", txt, tmp_path / "t", encoder=encoder, device=CPU), _rows(tmp_path / "t"))[1]}
    for column in ("caption", "prompt"):
        path = tmp_path / f"{column}.csv"
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["id", column])
            w.writerows([[1, "a red circle"], [2, "  "], [3, "a blue square"]])
        res = preprocess_prompts("tiny", path, tmp_path / column, encoder=encoder, device=CPU)
        assert (res.encoded, res.skipped, res.input_form) == (2, 1, f"CSV file of prompts (column '{column}')")
        rows = _rows(tmp_path / column)
        assert [r["id"] for r in rows] == [f"{column}.csv row 1", f"{column}.csv row 3"]
        assert {r["caption"]: r["text_embedding_bytes"] for r in rows} == by_text
        skipped = [json.loads(line) for line in (tmp_path / column / "skipped.jsonl").read_text().splitlines()]
        assert skipped == [{"path": f"{column}.csv row 2", "reason": "empty_prompt", "detail": "the prompt is empty"}]
    (tmp_path / "other.csv").write_text("id,text\n1,hello\n")
    with pytest.raises(InputError) as err:
        preprocess_prompts("tiny", tmp_path / "other.csv", tmp_path / "o", encoder=encoder, device=CPU)
    assert str(err.value) == f"{tmp_path / 'other.csv'}: no prompt column: expected one of 'caption', 'prompt', found columns 'id', 'text'"
    assert not (tmp_path / "o").exists()  # a refused run creates no folder
    (tmp_path / "blank.txt").write_text("\n  \n")
    with pytest.raises(InputError, match=r"blank\.txt: no prompts \(2 blank line\(s\)\); expected a text file with one prompt per non-empty line"):
        preprocess_prompts("tiny", tmp_path / "blank.txt", tmp_path / "o", encoder=encoder, device=CPU)
    capsys.readouterr()
    rc = main(["--model", str(tiny_model_dir), "--prompts", str(tmp_path / "missing.txt"), "--output", str(tmp_path / "o")])
    err_text = capsys.readouterr().err
    assert rc == 2 and err_text.count("\n") == 1 and "--prompts " in err_text and "missing.txt: no such file" in err_text
    with pytest.raises(SystemExit):  # --input and --prompts together
        main(["--model", "m", "--input", "x", "--prompts", str(txt), "--output", str(tmp_path / "o")])
    assert "not allowed with argument" in capsys.readouterr().err


def test_help_shows_the_prompts_mode(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(--input INPUT | --prompts PROMPTS)" in text and "Prompts-only mode" in text
    assert "a CSV/JSONL file with a 'caption' or 'prompt' column" in text


def _text_only_dataset(folder: Path, texts: list[torch.Tensor], **info) -> Path:
    from fv_accel.data.schema import make_text_row, write_dataset_info, write_rows

    rows = [make_text_row(sample_id=f"p{i}", text_embedding=t, caption=f"prompt {i}") for i, t in enumerate(texts)]
    write_rows(rows, folder / "data-00000-of-00001.parquet")
    write_dataset_info(folder, model="tiny", preprocessed_data_type="text_only", family="wan", num_rows=len(rows), **info)
    return folder


def test_nonfinite_text_is_flagged_and_rollout_shape_comes_from_the_recipe(tmp_path):
    from fv_accel.config import default_recipe, load_config
    from fv_accel.data.loader import LatentDataset, build_train_loader, rollout_latent_shape

    bad = torch.ones(4, 32)
    bad[1, 3] = float("nan")
    data = _text_only_dataset(tmp_path / "d", [torch.ones(3, 32), bad])
    ds = LatentDataset(str(data))
    assert [ds[i]["nonfinite"] for i in range(2)] == [False, True] and "vae_latent" not in ds[0]
    cfg = load_config(default_recipe("finetune"), {"training.data.data_path": str(data)})
    with pytest.raises(ConfigError) as err:
        rollout_latent_shape(cfg, 16)
    assert "training.data.num_latent_t (or num_frames), num_height, num_width not set" in str(err.value)
    assert "\n" not in str(err.value) and str(data) in str(err.value)
    over = {"training.data.data_path": str(data), "training.data.num_frames": 9, "training.data.num_height": 32, "training.data.num_width": 48}
    cfg = load_config(default_recipe("finetune"), over)
    assert rollout_latent_shape(cfg, 16) == [16, 3, 4, 6]
    loader = build_train_loader(cfg, world_size=1, rank=0)
    assert loader.rollout_tokens == 3 * 2 * 3  # (T, H/2, W/2) patches of the default (1, 2, 2)
    batch = next(iter(loader))
    assert len(batch["sample_index"]) == 2 and loader.batch_tokens(batch) == 2 * 18  # the tiny recipe's batch of 2
    # A VAE of 16x spatial compression (Wan 2.2's, recorded with the dataset): sides of 16k pixels.
    wan22 = _text_only_dataset(tmp_path / "d22", [torch.ones(3, 32)], scale_factor_spatial=16, scale_factor_temporal=4)
    cfg = load_config(default_recipe("finetune"), {**over, "training.data.data_path": str(wan22), "training.data.num_width": 40})
    with pytest.raises(ConfigError, match="training.data.num_width 40: not a multiple of 16, the spatial compression of the VAE"):
        rollout_latent_shape(cfg, 48)
    cfg = load_config(default_recipe("finetune"), {**over, "training.data.data_path": str(wan22)})
    assert rollout_latent_shape(cfg, 48) == [48, 3, 2, 3]


def test_methods_and_rollout_modes_that_need_latents_refuse_text_only_data(tmp_path, tiny_data_path):
    from conftest import tiny_overrides

    from fv_accel.build import build_from_config, check_text_only_family
    from fv_accel.config import default_recipe, load_config
    from fv_accel.data.loader import LatentDataset, build_train_loader, check_rollout_data

    data = _text_only_dataset(tmp_path / "d", [torch.ones(3, 32), torch.ones(4, 32)])
    for method in ("finetune", "dfsft"):
        with pytest.raises(ConfigError) as err:
            build_from_config(str(default_recipe(method)), tiny_overrides(tmp_path / method, **{"training.data.data_path": str(data)}))
        assert str(err.value).startswith(
            f"training.data.data_path '{data}' is a text-only dataset (prompts without video latents): method {method} "
            "trains on video latents"
        ) and "\n" not in str(err.value)
        assert not (tmp_path / method / "out").exists()
    expected = (
        f"training.data.data_path '{data}' is a text-only dataset (prompts without video latents): method.rollout_mode "
        "data_latent needs video latents; use rollout_mode simulate or a dataset preprocessed from videos"
    )
    for given in (str(data), LatentDataset(str(data))):
        with pytest.raises(ConfigError) as err:
            check_rollout_data("data_latent", given)
        assert str(err.value) == expected
        check_rollout_data("simulate", given)  # no error
    check_rollout_data("data_latent", tiny_data_path)
    check_rollout_data("data_latent", "tiny")
    assert LatentDataset(tiny_data_path).preprocessed_data_type == "t2v"
    # A mix of text-only and latent datasets is refused; text embeddings of another family too.
    cfg = load_config(default_recipe("finetune"), {"training.data.data_path": tiny_data_path, "training.data.mix": [{"data_path": str(data)}]})
    with pytest.raises(ValueError, match=r"training\.data\.mix: .* is a text-only dataset .* mix datasets of one kind"):
        build_train_loader(cfg, world_size=1, rank=0)
    # Validation that needs the training data's latents: refused in one line.
    from fv_accel.validation import check_validation_data, default_video_size

    over = {"training.data.data_path": str(data), "callbacks.validation.enable": True, "callbacks.validation.heldout_fraction": 0.25,
            "callbacks.validation.heldout_data_path": None}
    with pytest.raises(ConfigError) as err:
        check_validation_data(load_config(default_recipe("finetune"), over), str(data))
    assert str(err.value).startswith(
        f"callbacks.validation.heldout_fraction need the video latents of training.data.data_path, but '{data}' is a text-only dataset"
    )
    over.update({"callbacks.validation.heldout_fraction": 0.0, "callbacks.validation.heldout_data_path": str(data)})
    with pytest.raises(ConfigError, match="heldout_data_path .* is a text-only dataset"):
        check_validation_data(load_config(default_recipe("finetune"), over), str(data))
    over.update({"callbacks.validation.heldout_data_path": None, "training.data.num_frames": 9, "training.data.num_height": 32,
                 "training.data.num_width": 48})
    cfg = load_config(default_recipe("finetune"), over)
    check_validation_data(cfg, str(data))  # sample videos alone: no error
    assert default_video_size(str(data), 8, 4, cfg=cfg) == (32, 48, 9)
    check_text_only_family(str(data), "wan", "tiny", "wan")
    with pytest.raises(ConfigError, match=r"the text-only dataset was encoded by 'tiny' \(wan family\), but the student is of the cosmos2 family"):
        check_text_only_family(str(data), "wan", "tiny", "cosmos2")


def test_memory_estimate_takes_the_rollout_shape_of_text_only_data(tmp_path):
    from fv_accel.config import default_recipe, load_config
    from fv_accel.memory_estimate import EstimateUnavailable, largest_bucket

    data = _text_only_dataset(tmp_path / "d", [torch.ones(3, 32)])
    cfg = load_config(default_recipe("finetune"), {"training.data.data_path": str(data)})
    with pytest.raises(EstimateUnavailable, match="training.data.data_path holds no latents \\(text-only\\)"):
        largest_bucket(cfg, (1, 2, 2), 16)
    cfg = load_config(default_recipe("finetune"), {
        "training.data.data_path": str(data), "training.data.num_frames": 9, "training.data.num_height": 32, "training.data.num_width": 48,
    })
    bucket = largest_bucket(cfg, (1, 2, 2), 16)
    assert bucket.latent == (16, 3, 4, 6) and bucket.source.startswith("training.data.num_*")
