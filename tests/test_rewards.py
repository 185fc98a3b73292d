"""fv_accel/rewards/: the recipe's `method.reward_fn` parsed, PickScore and CLIPScore on tiny CLIPs
(fv_accel/tiny/clip.py) against scores computed by hand with transformers, the tiny demo's reward,
the user's `module:function` rewards, and MultiReward's checks (weighted sum, invalid samples)."""

from __future__ import annotations

import logging
import sys
import textwrap

import numpy as np
import pytest
import torch

from fv_accel.rewards import REWARDS, MultiReward, RewardSpec, build_rewards, parse_reward_fn

PROMPTS = ["a red circle moving left", "a blue square moving up on a dark background"]


@pytest.fixture(scope="module")
def clip_dirs(tmp_path_factory):
    """{"pickscore": folder, "clip": folder}: the two tiny CLIPs in the Hub layout."""
    from fv_accel.tiny.clip import write_tiny_clip

    root = tmp_path_factory.mktemp("tiny_clip")
    return {kind: write_tiny_clip(root / kind, kind) for kind in ("pickscore", "clip")}


def random_clips(batch: int, frames: int, seed: int = 0, size: int = 40) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, frames, size, size + 8, 3), generator=gen, dtype=torch.uint8)


def assert_one_line(err: BaseException, *parts: str) -> None:
    text = str(err)
    assert "\n" not in text, text
    for part in parts:
        assert part in text, f"{part!r} not in {text!r}"


# ---- method.reward_fn ------------------------------------------------------------------------


def test_both_forms_parse_to_the_same_spec():
    mapping = parse_reward_fn({"pickscore": 1.0, "clipscore": 0.5})
    listed = parse_reward_fn([{"name": "pickscore", "weight": 1.0}, {"name": "clipscore", "weight": 0.5}])
    assert mapping == listed
    assert isinstance(mapping, RewardSpec)
    assert mapping.names == ["pickscore", "clipscore"]
    assert mapping.weights == {"pickscore": 1.0, "clipscore": 0.5}
    # Defaults filled in from the reward classes.
    pick = mapping.entries[0].options
    assert pick["model"] == "yuvalkirstain/PickScore_v1"
    assert pick["processor"] == "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
    assert (pick["frames"], pick["dtype"]) == (1, "float32")
    assert mapping.entries[1].options["model"] == "openai/clip-vit-large-patch14"
    # Options given in the list form; FastVideo's {rewards: {...}} wrapper.
    framed = parse_reward_fn([{"name": "PickScore", "weight": 2, "frames": "all", "dtype": "bfloat16"}])
    assert framed.entries[0].name == "pickscore" and framed.entries[0].weight == 2.0
    assert (framed.entries[0].options["frames"], framed.entries[0].options["dtype"]) == ("all", "bfloat16")
    assert parse_reward_fn({"rewards": {"tiny_left": 1.0}}) == parse_reward_fn([{"name": "tiny_left"}])
    assert {"pickscore", "clipscore", "tiny_left"} <= set(REWARDS)


@pytest.mark.parametrize(
    "value, parts",
    [
        ({"aesthetic_v9": 1.0}, ["method.reward_fn[aesthetic_v9]", "'aesthetic_v9'", "unknown reward"]),
        ({"pickscore": "high"}, ["method.reward_fn[pickscore].weight", "'high'"]),
        ({"pickscore": float("nan")}, ["method.reward_fn[pickscore].weight", "nan"]),
        ({"pickscore": float("inf")}, ["method.reward_fn[pickscore].weight", "inf"]),
        ({"pickscore": True}, ["method.reward_fn[pickscore].weight", "True"]),
        ([{"name": "pickscore", "frame": 3}], ["method.reward_fn[0].frame", "3", "unknown option", "frames"]),
        ([{"name": "tiny_left", "model": "x"}], ["method.reward_fn[0].model", "'x'", "unknown option"]),
        ([{"name": "clipscore", "frames": 0}], ["method.reward_fn[0].frames", "0"]),
        ([{"name": "clipscore", "dtype": "float16"}], ["method.reward_fn[0].dtype", "'float16'"]),
        ([{"name": "no_such_module_fv:score"}], ["method.reward_fn[0]", "'no_such_module_fv:score'", "cannot import"]),
        ([{"name": "json:no_such_function"}], ["method.reward_fn[0]", "'json:no_such_function'", "no function"]),
        ([{"name": "pickscore"}, {"name": "pickscore"}], ["method.reward_fn[1]", "twice"]),
        ([{"weight": 1.0}], ["method.reward_fn[0]", "'name'"]),
        ([], ["method.reward_fn", "[]"]),
        ("pickscore", ["method.reward_fn", "'pickscore'"]),
    ],
)
def test_reward_fn_errors_are_one_line_naming_the_key(value, parts):
    with pytest.raises(ValueError) as err:
        parse_reward_fn(value)
    assert_one_line(err.value, *parts)


# ---- the tiny CLIP ---------------------------------------------------------------------------


def test_tiny_clip_loads_as_real_checkpoints_do(clip_dirs):
    from transformers import AutoModel, AutoProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer
    from PIL import Image

    for kind, folder in clip_dirs.items():
        assert {"config.json", "model.safetensors", "preprocessor_config.json", "vocab.json", "merges.txt",
                "tokenizer.json"} <= {p.name for p in folder.iterdir()}
        for model_cls, processor_cls in ((AutoModel, AutoProcessor), (CLIPModel, CLIPProcessor)):
            model = model_cls.from_pretrained(folder)
            processor = processor_cls.from_pretrained(folder)
            assert type(model) is CLIPModel and type(processor) is CLIPProcessor
            assert isinstance(processor.tokenizer, CLIPTokenizer)
            # The PIL image processor: no torchvision needed.
            assert type(processor.image_processor).__name__ == "CLIPImageProcessorPil"
            pixels = processor(images=[Image.new("RGB", (48, 40), (200, 10, 10))], return_tensors="pt")["pixel_values"]
            assert pixels.shape == (1, 3, 32, 32)
            ids = processor(text=["a red circle"], return_tensors="pt")["input_ids"][0].tolist()
            tok = processor.tokenizer
            assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id and len(ids) < 8  # merges used
            assert tok.convert_ids_to_tokens(ids[1]) == "a</w>"
            assert model.config.text_config.eos_token_id == tok.eos_token_id
        expected_act = {"pickscore": "gelu", "clip": "quick_gelu"}[kind]
        assert model.config.vision_config.hidden_act == expected_act
    a = CLIPModel.from_pretrained(clip_dirs["pickscore"]).text_projection.weight
    b = CLIPModel.from_pretrained(clip_dirs["clip"]).text_projection.weight
    assert not torch.equal(a, b)


# ---- PickScore and CLIPScore on the tiny CLIPs -------------------------------------------------


def test_frames_are_evenly_spaced_first_and_last_included():
    from fv_accel.rewards.base import frame_indices

    assert frame_indices(81, 1) == [0]
    assert frame_indices(81, 2) == [0, 80]
    assert frame_indices(81, 5) == [0, 20, 40, 60, 80]
    assert frame_indices(21, 4) == [0, 7, 13, 20]
    assert frame_indices(3, 8) == frame_indices(3, "all") == [0, 1, 2]
    assert frame_indices(1, 3) == [0]


def hand_embeddings(model, processor, frames: np.ndarray, prompts, **text_kwargs):
    """Normalised (image [N, D], text [B, D]) embeddings through the towers and projections."""
    from PIL import Image

    pixels = processor.image_processor(images=[Image.fromarray(f) for f in frames], return_tensors="pt")["pixel_values"]
    text = processor.tokenizer(list(prompts), truncation=True, max_length=77, return_tensors="pt", **text_kwargs)
    with torch.no_grad():
        image = model.visual_projection(model.vision_model(pixel_values=pixels).pooler_output)
        txt = model.text_projection(
            model.text_model(input_ids=text["input_ids"], attention_mask=text["attention_mask"]).pooler_output
        )
    return image / image.norm(dim=-1, keepdim=True), txt / txt.norm(dim=-1, keepdim=True)


@pytest.mark.parametrize("kind, name, divisor, padding", [("pickscore", "pickscore", 26.0, True),
                                                         ("clip", "clipscore", 100.0, "max_length")])
def test_clip_rewards_match_the_hand_computed_score(clip_dirs, kind, name, divisor, padding, monkeypatch):
    from transformers import AutoModel, AutoProcessor

    folder = str(clip_dirs[kind])
    options = {"model": folder, "processor": folder} if name == "pickscore" else {"model": folder}
    first = build_rewards([{"name": name, **options}])
    three = build_rewards([{"name": name, "frames": 3, **options}])
    clips = random_clips(2, 5)
    scores, invalid = first.score(clips, PROMPTS)
    got = scores[name]
    assert got.dtype == torch.float32 and got.shape == (2,) and torch.isfinite(got).all()
    assert invalid.tolist() == [False, False]
    assert torch.equal(scores["avg"], got)  # weight 1.0

    model = AutoModel.from_pretrained(folder).eval()
    processor = AutoProcessor.from_pretrained(folder)
    scale = model.logit_scale.exp().item()
    image, text = hand_embeddings(model, processor, clips[:, 0].numpy(), PROMPTS, padding=padding)
    expected = scale * (image * text).sum(-1) / divisor
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)

    # frames: 3 of 5 are frames 0, 2 and 4; the clip's score is their scores' mean.
    per_frame = []
    for t in (0, 2, 4):
        image, _ = hand_embeddings(model, processor, clips[:, t].numpy(), PROMPTS, padding=padding)
        per_frame.append(scale * (image * text).sum(-1) / divisor)
    torch.testing.assert_close(three(clips, PROMPTS)[name], torch.stack(per_frame).mean(0), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(three(clips, PROMPTS)[name], got)
    # Split into forward passes of one sample's frames each, the same scores.
    monkeypatch.setattr("fv_accel.rewards.base.MAX_IMAGES_PER_FORWARD", 3)
    torch.testing.assert_close(three(clips, PROMPTS)[name], torch.stack(per_frame).mean(0), atol=1e-5, rtol=1e-5)

    # Another prompt, another score; the same inputs, the same score.
    other = first(clips, ["a photo of a cat", PROMPTS[1]])[name]
    assert abs(float(other[0] - got[0])) > 1e-4 and float(other[1]) == pytest.approx(float(got[1]), abs=1e-6)


def test_reward_models_are_frozen_in_the_dtype_asked(clip_dirs):
    folder = str(clip_dirs["pickscore"])
    rewards = build_rewards([{"name": "pickscore", "model": folder, "processor": folder, "dtype": "bfloat16"},
                             {"name": "clipscore", "model": str(clip_dirs["clip"]), "weight": 0.5}])
    pick, clip = rewards.rewards
    for reward, dtype in ((pick, torch.bfloat16), (clip, torch.float32)):
        params = list(reward.model.parameters())
        assert params and not any(p.requires_grad for p in params)
        assert not reward.model.training and not any(m.training for m in reward.model.modules())
        assert {p.dtype for p in params} == {dtype}
    scores, _ = rewards.score(random_clips(2, 1, seed=3), PROMPTS)
    assert scores["pickscore"].dtype == torch.float32 and torch.isfinite(scores["pickscore"]).all()
    assert not scores["avg"].is_inference()  # usable in autograd expressions
    torch.testing.assert_close(scores["avg"], scores["pickscore"] + 0.5 * scores["clipscore"])
    sizes = rewards.parameter_bytes()
    assert sizes["pickscore"] == sum(p.numel() * 2 for p in pick.model.parameters())
    assert sizes["clipscore"] == sum(p.numel() * 4 for p in clip.model.parameters())
    assert 0 < sizes["pickscore"] < sizes["clipscore"]
    # A prompt longer than CLIP's 77 tokens is truncated, not an error.
    long_scores, invalid = rewards.score(random_clips(2, 1, seed=3), [" ".join(["red circle"] * 100), PROMPTS[1]])
    assert torch.isfinite(long_scores["avg"]).all() and invalid.tolist() == [False, False]
    # The other sample's float32 score is untouched (bfloat16 PickScore's moves with the padded length).
    torch.testing.assert_close(long_scores["clipscore"][1], scores["clipscore"][1])


def test_a_missing_model_offline_is_one_line_with_hf_download(clip_dirs, monkeypatch, tmp_path):
    from fv_accel.models.loading import ModelLoadError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = str(clip_dirs["pickscore"])
    with pytest.raises(ModelLoadError) as err:
        build_rewards([{"name": "pickscore", "model": "fv-accel-test/no-such-reward-model", "processor": folder}])
    assert_one_line(err.value, "reward 'pickscore'", "weights", "hf download fv-accel-test/no-such-reward-model")
    with pytest.raises(ModelLoadError) as err:
        build_rewards([{"name": "pickscore", "model": folder, "processor": "fv-accel-test/no-such-processor"}])
    assert_one_line(err.value, "reward 'pickscore'", "processor", "hf download fv-accel-test/no-such-processor")
    # A folder that does not exist is no Hub id: no `hf download` advice for it.
    missing = str(tmp_path / "not" / "here")
    with pytest.raises(ModelLoadError) as err:
        build_rewards([{"name": "clipscore", "model": missing}])
    assert_one_line(err.value, "reward 'clipscore'", f"'{missing}' is neither an existing local folder nor a valid Hub id")
    assert "hf download" not in str(err.value)


# ---- the tiny demo's reward --------------------------------------------------------------------


def square_clip(centres_x, width: int = 32, half: int = 2) -> torch.Tensor:
    """One clip [1, T, 32, width, 3]: a white 5x5 square centred at each x (None: no square) on black."""
    frames = np.zeros((len(centres_x), 32, width, 3), dtype=np.uint8)
    for t, x in enumerate(centres_x):
        if x is not None:
            frames[t, 14 - half : 14 + half + 1, x - half : x + half + 1] = 255
    return torch.from_numpy(frames)[None]


def test_tiny_left_scores_where_the_shape_ends():
    rewards = build_rewards({"tiny_left": 1.0})
    assert rewards.parameter_bytes() == {"tiny_left": 0}
    clips = torch.cat([
        square_clip([24, 16, 8]),        # ends at x = 8 of 32: 1 - 8/32
        square_clip([8, 16, 24]),        # ends at x = 24: 1 - 24/32
        square_clip([20, 12, None]),     # last frame empty: the frame before counts, x = 12
        square_clip([None, None, None]),  # no shape: 0
    ])
    scores = rewards(clips, ["a", "b", "c", "d"])["tiny_left"]
    torch.testing.assert_close(scores, torch.tensor([0.75, 0.25, 1 - 12 / 32, 0.0]), atol=1e-6, rtol=0)
    assert rewards.last_invalid.tolist() == [False] * 4


def test_tiny_speed_scores_how_far_the_shape_travels():
    rewards = build_rewards({"tiny_speed": 1.0})
    clips = torch.cat([
        square_clip([4, 10, 16]),        # 12 px of 32
        square_clip([20, 20, 20]),       # still: 0
        square_clip([None, 8, 26]),      # from the first frame that shows it: 18 px
        square_clip([None, None, 9]),    # shown once: 0
    ])
    scores = rewards(clips, ["a", "b", "c", "d"])["tiny_speed"]
    torch.testing.assert_close(scores, torch.tensor([12 / 32, 0.0, 18 / 32, 0.0]), atol=1e-6, rtol=0)


# ---- the user's module:function ----------------------------------------------------------------

USER_MODULE = """
    import numpy as np
    import torch

    CALLS = []


    def brightness(clips, prompts):
        CALLS.append((clips.dtype, tuple(clips.shape), list(prompts)))
        return [float(c.float().mean()) / 255.0 for c in clips]


    def nan_second(clips, prompts):
        return np.array([0.5] + [float("nan")] * (len(prompts) - 1))


    def too_many(clips, prompts):
        return torch.zeros(len(prompts) + 1)


    def integers(clips, prompts):
        return list(range(len(prompts)))


    def text(clips, prompts):
        return "high"
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """The module `fv_user_rewards_test` in a fresh working directory (imported from it)."""
    name = "fv_user_rewards_test"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    yield name
    sys.modules.pop(name, None)


def test_user_function_is_called_with_the_clips_and_weights_combine(user_module):
    spec = parse_reward_fn([{"name": f"{user_module}:brightness", "weight": 2.0}, {"name": "tiny_left", "weight": 0.5}])
    rewards = build_rewards(spec)
    clips = torch.cat([square_clip([8, 8]), square_clip([20, 24])])
    scores, invalid = rewards.score(clips, PROMPTS)
    module = sys.modules[user_module]
    assert module.CALLS == [(torch.uint8, (2, 2, 32, 32, 3), PROMPTS)]
    brightness = clips.float().mean(dim=(1, 2, 3, 4)) / 255.0
    torch.testing.assert_close(scores[f"{user_module}:brightness"], brightness)
    torch.testing.assert_close(scores["tiny_left"], torch.tensor([0.75, 0.25]))
    torch.testing.assert_close(scores["avg"], 2.0 * brightness + 0.5 * torch.tensor([0.75, 0.25]))
    assert set(scores) == {f"{user_module}:brightness", "tiny_left", "avg"}
    assert invalid.tolist() == [False, False]


def test_a_non_finite_score_marks_the_sample_and_warns_once(user_module, caplog):
    rewards = build_rewards({f"{user_module}:nan_second": 1.0, "tiny_left": 1.0})
    clips = torch.cat([square_clip([8, 8]), square_clip([8, 24])])
    with caplog.at_level(logging.WARNING, logger="fv_accel.rewards"):
        scores, invalid = rewards.score(clips, PROMPTS)
        assert invalid.tolist() == [False, True]
        assert rewards.last_invalid.tolist() == [False, True]
        assert float(scores[f"{user_module}:nan_second"][0]) == 0.5
        assert float(scores["avg"][0]) == pytest.approx(0.5 + 0.75)
        assert torch.isnan(scores["avg"][1]) and float(scores["tiny_left"][1]) == pytest.approx(0.25)
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == 1 and PROMPTS[1] in warned[0] and f"{user_module}:nan_second" in warned[0]
        rewards.score(clips, PROMPTS)
        assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


@pytest.mark.parametrize("function, got", [("too_many", "shape [3]"), ("integers", "int64"), ("text", "str")])
def test_a_bad_reward_result_is_one_line_naming_the_reward(user_module, function, got):
    rewards = build_rewards([{"name": f"{user_module}:{function}"}])
    with pytest.raises(ValueError) as err:
        rewards(random_clips(2, 1), PROMPTS)
    assert_one_line(err.value, f"reward '{user_module}:{function}'", got, "[B] = [2]", repr(PROMPTS[0]))


def test_clips_must_be_uint8_with_a_prompt_each():
    rewards = build_rewards({"tiny_left": 1.0})
    assert isinstance(rewards, MultiReward)
    with pytest.raises(ValueError) as err:
        rewards(random_clips(2, 1).float(), PROMPTS)
    assert_one_line(err.value, "uint8", "[B, T, H, W, 3]", "float32")
    with pytest.raises(ValueError) as err:
        rewards(random_clips(2, 1), PROMPTS[:1])
    assert_one_line(err.value, "2 clips", "1 prompts")
