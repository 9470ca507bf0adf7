"""Image classifiers in configurations other than the fixtures' (a 3-channel 16 x 16 ViT whose preprocessor config is
mean = std = 0.5, served in float32): a greyscale transformers ViT (one channel, 20 x 20 in patches of 5, its own
layer-norm epsilon) served and compared with transformers on the same files; preprocessor configs read for one
channel as for three (no config at all, do_normalize false, do_rescale false with pixel-scale statistics, DeiT's
older integer size and crop_size); the Open Inference Protocol's FP32 pixels of an RGB model beside the same images
as BYTES. Every app runs in this process (`httpx.ASGITransport`) on tiny checkpoints, so that the tests take
seconds."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from tests.helpers.in_process import InProcessApp
from tests.model.test_option_combinations_images import b64, noise, png
from tserve.model import checkpoint
from tserve.model.preprocessing import ImagePreprocessing

# The outcome depends on the CPU's kernels (equality with transformers): `make test-avx2` runs it again.
pytestmark = pytest.mark.kernels

GREY_SIZE, GREY_PATCH = 20, 5
LABELS = ["zero", "one", "two", "three", "four"]
# A greyscale checkpoint's own preprocessing: one mean and one std, bicubic.
GREY_PREPROCESSOR = {"do_normalize": True, "do_rescale": True, "do_resize": True, "image_mean": [0.3],
                     "image_std": [0.2], "resample": 3, "rescale_factor": 1 / 255,
                     "size": {"height": GREY_SIZE, "width": GREY_SIZE}}


def grey_vit_dir(d: Path, preprocessor: dict | None) -> Path:
    """A random transformers ViT reading one channel, 20 x 20 pixels in 5 x 5 patches, whose layer norms take an
    epsilon of their own (`preprocessor` None: no preprocessor_config.json)."""
    d.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(7)
    cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                 image_size=GREY_SIZE, patch_size=GREY_PATCH, num_channels=1, layer_norm_eps=1e-3,
                                 id2label=dict(enumerate(LABELS)), label2id={v: k for k, v in enumerate(LABELS)})
    model = transformers.ViTForImageClassification(cfg).eval()
    with torch.no_grad():  # small activations: the layer norms' epsilon tells
        for name, p in model.named_parameters():
            if name.endswith(("cls_token", "position_embeddings")):
                p.normal_(0, 0.05)
    model.save_pretrained(d, safe_serialization=True)
    if preprocessor is not None:
        (d / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    return d


def scores(item: dict) -> list[float]:
    by_label = {p["label"]: p["score"] for p in item["predictions"]}
    return [by_label[label] for label in LABELS]


@pytest.fixture(scope="module")
def grey(tmp_path_factory):
    return grey_vit_dir(tmp_path_factory.mktemp("grey-vit"), GREY_PREPROCESSOR)


@pytest.fixture(scope="module")
def app(grey, hf_vit):
    served = InProcessApp({"grey": grey, "rgb": hf_vit})
    yield served
    served.stop()


# ------------------------------------------------------------------------------------------------------------
# A greyscale transformers ViT
# ------------------------------------------------------------------------------------------------------------
def test_a_greyscale_transformers_vit_classifies_and_embeds_as_transformers_does(app, grey):
    """A one-channel ViT of another image and patch size, with its own mean, std and layer-norm epsilon:
    greyscale and colour uploads of other sizes in one request get transformers' probabilities and class
    token (ViTImageProcessor on the greyscale picture, then ViTForImageClassification)."""
    blobs = [png(noise(1, (27, 19)), "L"), png(noise(2, (13, 31, 3))), png(noise(3, (GREY_SIZE, GREY_SIZE)), "L")]
    model = transformers.ViTForImageClassification.from_pretrained(grey).eval()
    processor = transformers.ViTImageProcessor(**GREY_PREPROCESSOR)
    pixels = processor([Image.open(io.BytesIO(b)).convert("L") for b in blobs], return_tensors="pt").pixel_values
    assert pixels.shape == (3, 1, GREY_SIZE, GREY_SIZE)
    with torch.no_grad():
        probs = model(pixel_values=pixels).logits.softmax(-1)
        states = model.vit(pixel_values=pixels).last_hidden_state[:, 0]
    ranked = app.post("/v1/classifications", {"model": "grey", "images": [b64(b) for b in blobs],
                                              "top_k": 10}).json()["data"]
    for item, p in zip(ranked, probs, strict=True):
        assert scores(item) == pytest.approx(p.tolist(), abs=1e-6)
    embedded = app.post("/v1/embeddings", {"model": "grey", "images": [b64(b) for b in blobs]}).json()
    got = np.array([d["embedding"] for d in embedded["data"]], dtype=np.float32)
    assert np.allclose(got, torch.nn.functional.normalize(states, dim=-1).numpy(), atol=1e-5)
    grid = GREY_SIZE // GREY_PATCH
    assert embedded["usage"]["prompt_tokens"] == len(blobs) * (grid * grid + 1)


# ------------------------------------------------------------------------------------------------------------
# Preprocessor configs for one channel and for three
# ------------------------------------------------------------------------------------------------------------
# (config as the checkpoint ships it, channels, the processor transformers reads it with, and its arguments)
PIXEL_SCALE = {"do_rescale": False, "image_mean": [127.5, 120.0, 110.0], "image_std": [60.0, 58.0, 57.0],
               "resample": 2, "size": {"height": 16, "width": 16}}
PREPROCESSOR_CONFIGS = {
    # a greyscale checkpoint without a preprocessor config: 0.5 and 0.5 for its one channel
    "greyscale-none": ({}, 1, transformers.ViTImageProcessor,
                       {"image_mean": [0.5], "image_std": [0.5], "size": GREY_SIZE}),
    "greyscale-unnormalized": ({**GREY_PREPROCESSOR, "do_normalize": False}, 1, transformers.ViTImageProcessor, None),
    "greyscale-pixel-scale": ({**PIXEL_SCALE, "image_mean": [100.0], "image_std": [70.0], "size": GREY_SIZE}, 1,
                              transformers.ViTImageProcessor, None),
    # statistics on the 0..255 scale: the pixels are not rescaled first
    "rgb-pixel-scale": (PIXEL_SCALE, 3, transformers.ViTImageProcessor, None),
    # DeiT's older configs: an integer size, resized to, and an integer crop_size, the centre taken
    "rgb-integer-crop": ({"do_center_crop": True, "crop_size": 16, "size": 23, "resample": 3,
                          "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}, 3,
                         transformers.DeiTImageProcessor, None),
}


@pytest.mark.parametrize("name", PREPROCESSOR_CONFIGS)
def test_a_preprocessor_config_is_read_for_the_models_channel_count_as_transformers_reads_it(name):
    """A config with none of the fixtures' defaults, for a one-channel and a three-channel model, gives the pixels
    transformers' processor gives for a picture taller than wide."""
    cfg, channels, processor, arguments = PREPROCESSOR_CONFIGS[name]
    size = GREY_SIZE if channels == 1 else 16
    shape = (37, 23) if channels == 1 else (37, 23, 3)
    image = Image.fromarray(noise(4, shape))
    ours = ImagePreprocessing.from_hf(cfg, size, channels)(image)
    theirs = processor(**(cfg if arguments is None else arguments))(image, return_tensors="pt").pixel_values[0]
    assert ours.shape == theirs.shape == (channels, size, size)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-5)


def test_a_greyscale_checkpoint_without_a_preprocessor_config_loads_with_one_mean_and_std(tmp_path):
    """Without preprocessor_config.json a one-channel ViT takes 0.5 and 0.5 for its one channel: it loads, and
    classifies as transformers does on those pixels."""
    d = grey_vit_dir(tmp_path / "bare", None)
    loaded = checkpoint.load(d, device="cpu")
    assert loaded.preprocessing.mean == (0.5,) and loaded.preprocessing.std == (0.5,)
    image = Image.fromarray(noise(5, (GREY_SIZE, GREY_SIZE)), "L")
    pixels = loaded.preprocessing(image)[None]
    model = transformers.ViTForImageClassification.from_pretrained(d).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(pixels), model(pixel_values=pixels).logits, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------------------
# The Open Inference Protocol: FP32 pixels of a three-channel model
# ------------------------------------------------------------------------------------------------------------
def test_oip_pixels_of_an_rgb_model_are_read_channels_first_as_its_images_are(app):
    """FP32 pixels [N, 3, H, W] (channels first, as the metadata says) of a colour model give the probabilities
    of the same images sent as BYTES on /v2 and on /v1: a greyscale model cannot tell which axis is which."""
    blobs = [png(noise(6, (21, 17, 3))), png(noise(7, (16, 16, 3)))]
    prep = app.registry.get("rgb", None).loaded.preprocessing
    pixels = torch.stack([prep(Image.open(io.BytesIO(b))) for b in blobs])
    assert pixels.shape == (2, 3, 16, 16)
    as_pixels = app.post("/v2/models/rgb/infer", {"inputs": [{"name": "pixels", "datatype": "FP32",
                                                              "shape": list(pixels.shape),
                                                              "data": pixels.flatten().tolist()}]}).json()
    as_images = app.post("/v2/models/rgb/infer", {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [2],
                                                              "data": [b64(b) for b in blobs]}]}).json()
    by_name = [{o["name"]: o for o in r["outputs"]} for r in (as_pixels, as_images)]
    assert by_name[0]["probabilities"]["data"] == pytest.approx(by_name[1]["probabilities"]["data"], abs=1e-6)
    assert by_name[0]["label"]["data"] == by_name[1]["label"]["data"]
    v1 = app.post("/v1/classifications", {"model": "rgb", "images": [b64(b) for b in blobs], "top_k": 1}).json()
    assert [d["predictions"][0]["label"] for d in v1["data"]] == by_name[0]["label"]["data"]


def test_classes_that_share_a_name_keep_their_own_probabilities_on_both_protocols(tmp_path):
    """ImageNet's labels name two classes "crane" and two "maillot": /v2's probabilities are per class, in the
    model's order, each the softmax of its own logit, and /v1 lists every class, both "cat"s included."""
    d = grey_vit_dir(tmp_path / "twins", GREY_PREPROCESSOR)
    config = json.loads((d / "config.json").read_text())
    config["id2label"] = {"0": "cat", "1": "cat", "2": "two", "3": "three", "4": "four"}
    (d / "config.json").write_text(json.dumps(config))
    blob = png(noise(8, (20, 20)), "L")
    app = InProcessApp({"twins": d})
    try:
        served = app.registry.get("twins", None)
        with torch.inference_mode():
            want = torch.softmax(served.loaded.model(served.loaded.preprocessing(Image.open(io.BytesIO(blob)))[None]),
                                 dim=-1)[0].tolist()
        v2 = app.post("/v2/models/twins/infer", {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1],
                                                             "data": [b64(blob)]}]})
        assert v2.status_code == 200, v2.text
        outputs = {o["name"]: o for o in v2.json()["outputs"]}
        assert outputs["probabilities"]["data"] == pytest.approx(want, abs=1e-6)
        v1 = app.post("/v1/classifications", {"model": "twins", "images": [b64(blob)], "top_k": 5}).json()
        assert sorted(p["label"] for p in v1["data"][0]["predictions"]) == ["cat", "cat", "four", "three", "two"]
    finally:
        app.stop()
