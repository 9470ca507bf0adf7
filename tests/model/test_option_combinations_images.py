"""Image classifiers where a checkpoint's own options meet the request's: a preprocessor_config.json other than
the fixtures' default (ImageNet's mean and std, bicubic or nearest resampling, do_normalize false) read as
transformers' image processor reads it, for a non-square photo, through the served routes too; images of other
sizes batched together; a JPEG as a data URL beside the same file uploaded; a greyscale image with an alpha
channel; --max-image-bytes and --max-image-pixels at their limits on every image route; and --dtype bfloat16.
Every app runs in this process (`httpx.ASGITransport`) on tiny transformers checkpoints, so that the tests take
seconds."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from tests.helpers import factories
from tests.helpers.in_process import InProcessApp
from tserve.model.preprocessing import ImagePreprocessing

# The outcome depends on the CPU's kernels (equality with transformers): `make test-avx2` runs it again.
pytestmark = pytest.mark.kernels

SIZE = 16  # factories.hf_vit_dir's image size
IMAGENET = {"do_normalize": True, "do_rescale": True, "do_resize": True, "image_mean": [0.485, 0.456, 0.406],
            "image_std": [0.229, 0.224, 0.225], "resample": 3, "rescale_factor": 1 / 255,
            "size": {"height": SIZE, "width": SIZE}}
# Preprocessor configs as checkpoints ship them, each unlike the fixtures' default (mean = std = 0.5, bilinear).
CONFIGS = {
    "imagenet-bicubic": IMAGENET,
    "unnormalized": {**IMAGENET, "do_normalize": False, "resample": 2, "size": SIZE},
    "nearest-own-mean": {**IMAGENET, "image_mean": [0.2, 0.4, 0.6], "image_std": [0.3, 0.2, 0.1], "resample": 0},
    "lanczos": {**IMAGENET, "resample": 1},
    # DeiT's: resized larger, then the centre cropped to the model's size; and a rescale factor of its own
    "resize-then-crop": {**IMAGENET, "size": {"height": SIZE + 7, "width": SIZE + 4}, "do_center_crop": True,
                         "crop_size": {"height": SIZE, "width": SIZE}},
    "own-rescale-factor": {**IMAGENET, "rescale_factor": 1 / 127.5},
    # no `resample`: the default of the processor class it names (DeiT's is bicubic, ViT's bilinear)
    "deit-default-resample": {**{k: v for k, v in IMAGENET.items() if k != "resample"},
                              "size": {"height": SIZE + 7, "width": SIZE + 4}, "do_center_crop": True,
                              "crop_size": {"height": SIZE, "width": SIZE}, "image_processor_type": "DeiTImageProcessor"},
    "vit-default-resample": {k: v for k, v in IMAGENET.items() if k != "resample"},
}
# the processor each config is a checkpoint's
PROCESSORS = {"resize-then-crop": transformers.DeiTImageProcessor,
              "deit-default-resample": transformers.DeiTImageProcessor}
MAX_IMAGE_PIXELS = 20 * 20


def png(pixels: np.ndarray, mode: str | None = None) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels, mode).save(buf, format="PNG")
    return buf.getvalue()


def noise(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, shape, dtype=np.uint8)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# An image exactly at --max-image-bytes and exactly at --max-image-pixels (20 x 20).
AT_LIMIT = png(noise(11, (20, 20, 3)))


def hf_processor(**cfg) -> transformers.ViTImageProcessor:  # noqa: ANN003 - a preprocessor config
    return transformers.ViTImageProcessor(**cfg)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A transformers ViT whose preprocessor config is ImageNet's (its own mean and std, bicubic)."""
    d = factories.hf_vit_dir(tmp_path_factory.mktemp("imagenet-vit"), seed=5)
    (d / "preprocessor_config.json").write_text(json.dumps(IMAGENET))
    return d


@pytest.fixture(scope="module")
def app(checkpoint):
    served = InProcessApp({"vit": checkpoint})
    yield served
    served.stop()


@pytest.fixture(scope="module")
def limited(checkpoint):
    """The same model with --max-image-bytes and --max-image-pixels at AT_LIMIT's size."""
    served = InProcessApp({"vit": checkpoint}, max_image_bytes=len(AT_LIMIT), max_image_pixels=MAX_IMAGE_PIXELS)
    yield served
    served.stop()


@pytest.fixture(scope="module")
def reference(checkpoint):
    """Image bytes -> transformers' class probabilities and final class token, from its own image processor."""
    model = transformers.AutoModelForImageClassification.from_pretrained(checkpoint).eval()
    processor = hf_processor(**IMAGENET)

    def run(blobs: list[bytes]) -> tuple[torch.Tensor, torch.Tensor]:
        pixels = processor([Image.open(io.BytesIO(b)).convert("RGB") for b in blobs], return_tensors="pt").pixel_values
        with torch.no_grad():
            return model(pixel_values=pixels).logits.softmax(-1), model.vit(pixel_values=pixels).last_hidden_state[:, 0]

    return run


def scores(item: dict, labels: list[str]) -> list[float]:
    by_label = {p["label"]: p["score"] for p in item["predictions"]}
    return [by_label[label] for label in labels]


# ------------------------------------------------------------------------------------------------------------
# A checkpoint's preprocessor config
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", CONFIGS)
def test_each_preprocessor_config_is_read_as_transformers_reads_it(name):
    """Mean, std, do_normalize and the resampling code of preprocessor_config.json give the pixels transformers'
    ViTImageProcessor gives, for a photo taller than wide (rows stay rows, columns stay columns)."""
    cfg = CONFIGS[name]
    image = Image.fromarray(noise(1, (37, 23, 3)))
    ours = ImagePreprocessing.from_hf(cfg, SIZE, 3)(image)
    theirs = PROCESSORS.get(name, hf_processor)(**cfg)(image, return_tensors="pt").pixel_values[0]
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("model_type", "resample"), [("vit", "bilinear"), ("deit", "bicubic")])
def test_a_config_without_resample_takes_its_model_familys_processor_default(tmp_path, model_type, resample):
    """A checkpoint's preprocessor config that names no `resample` and no processor class is read with the
    default of its family's processor in transformers: ViTImageProcessor's bilinear, DeiTImageProcessor's
    bicubic (what `AutoImageProcessor` builds for a DeiT checkpoint)."""
    from tserve.model.importers import deit, vit

    raw = {"model_type": model_type, "hidden_size": 8, "num_attention_heads": 2, "intermediate_size": 16,
           "num_hidden_layers": 1, "image_size": SIZE, "patch_size": 4, "id2label": {"0": "a", "1": "b"}}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {k: v for k, v in IMAGENET.items() if k != "resample"}))
    importer = deit if model_type == "deit" else vit
    assert importer.extras(raw, tmp_path, importer.config(raw, tmp_path))["preprocessing"].resample == resample


def test_served_classifications_and_embeddings_follow_the_checkpoints_preprocessing(app, checkpoint, reference):
    """Served on a checkpoint with ImageNet's preprocessing, images of other sizes than the model's (smaller,
    larger, not square) in one request each get transformers' own answer (processor and model), and each the
    answer it gets alone: a row of a batch does not depend on the other rows."""
    blobs = [png(noise(2, (9, 5, 3))), png(noise(3, (120, 70, 3))), png(noise(4, (SIZE, SIZE, 3)))]
    labels = json.loads((checkpoint / "config.json").read_text())["id2label"]
    labels = [labels[str(i)] for i in range(len(labels))]
    probs, states = reference(blobs)
    together = app.post("/v1/classifications", {"images": [b64(b) for b in blobs], "top_k": 100}).json()["data"]
    for item, p in zip(together, probs, strict=True):
        assert len(item["predictions"]) == len(labels)  # top_k beyond the label count: every label, once
        assert scores(item, labels) == pytest.approx(p.tolist(), abs=1e-5)
    for blob, item in zip(blobs, together, strict=True):
        (alone,) = app.post("/v1/classifications", {"image": b64(blob), "top_k": 100}).json()["data"]
        assert [p["label"] for p in alone["predictions"]] == [p["label"] for p in item["predictions"]]
        assert scores(alone, labels) == pytest.approx(scores(item, labels), abs=1e-6)
    embedded = app.post("/v1/embeddings", {"images": [b64(b) for b in blobs]}).json()["data"]
    got = np.array([d["embedding"] for d in embedded], dtype=np.float32)
    assert np.allclose(got, torch.nn.functional.normalize(states, dim=-1).numpy(), atol=1e-4)


def test_a_jpeg_data_url_is_the_jpeg_uploaded(app, reference):
    """A JPEG given as a data URL in JSON, as plain base64 and as a multipart file: one picture, one answer."""
    buf = io.BytesIO()
    Image.fromarray(noise(5, (18, 18, 3))).save(buf, format="JPEG", quality=90)
    jpeg = buf.getvalue()
    answers = [
        app.post("/v1/classifications", {"image": "data:image/jpeg;base64," + b64(jpeg), "top_k": 3}).json(),
        app.post("/v1/classifications", {"image": b64(jpeg), "top_k": 3}).json(),
        app.post("/v1/classifications", files=[("file", ("a.jpg", jpeg, "image/jpeg"))], data={"top_k": "3"}).json(),
    ]
    assert answers[0]["data"] == answers[1]["data"] == answers[2]["data"]
    top = reference([jpeg])[0][0].topk(3)
    assert [p["score"] for p in answers[0]["data"][0]["predictions"]] == pytest.approx(top.values.tolist(), abs=1e-5)


# ------------------------------------------------------------------------------------------------------------
# Image modes
# ------------------------------------------------------------------------------------------------------------
def test_a_greyscale_image_with_transparency_is_seen_as_its_rgba_twin(app):
    """A greyscale image with an alpha channel (mode LA) has its transparent pixels on the white background,
    as an RGBA image does: it embeds as its RGBA twin, not as the picture on black."""
    la = np.zeros((24, 24, 2), dtype=np.uint8)
    la[5:19, 7:15] = (40, 255)
    rgba = np.zeros((24, 24, 4), dtype=np.uint8)
    rgba[5:19, 7:15] = (40, 40, 40, 255)
    as_la = png(la, "LA")
    assert Image.open(io.BytesIO(as_la)).mode == "LA"
    on_black = png(np.where(rgba[..., 3:] > 0, rgba[..., :3], 0).astype(np.uint8))
    got = [np.asarray(d["embedding"]) for d in app.post(
        "/v1/embeddings", {"images": [b64(as_la), b64(png(rgba)), b64(on_black)]}).json()["data"]]
    assert np.allclose(got[0], got[1], atol=1e-6)
    assert not np.allclose(got[0], got[2], atol=1e-3), "the background must tell"


# ------------------------------------------------------------------------------------------------------------
# --max-image-bytes and --max-image-pixels
# ------------------------------------------------------------------------------------------------------------
IMAGE_ROUTES = {
    "classifications": ("/v1/classifications", lambda image: {"image": image}),
    "embeddings": ("/v1/embeddings", lambda image: {"image": image}),
    "attention": ("/v1/attention", lambda image: {"image": image, "layers": [0], "heads": [0]}),
}


@pytest.mark.parametrize("route", IMAGE_ROUTES)
def test_the_image_limits_hold_at_their_values_on_every_image_route(limited, route):
    """An image exactly --max-image-bytes long and exactly --max-image-pixels large is taken; one byte more
    (trailing data) is refused, and so is a smaller file one pixel row taller, each naming the limit it passed,
    whichever route reads it."""
    assert len(AT_LIMIT) > 1024  # the smallest --max-image-bytes
    path, body = IMAGE_ROUTES[route]
    limited.post(path, body(b64(AT_LIMIT)))
    too_long = limited.post(path, body(b64(AT_LIMIT + b"\0")), status=400).json()["error"]["message"]
    assert f"the limit is {len(AT_LIMIT)}" in too_long
    taller = png(np.full((21, 20, 3), 90, dtype=np.uint8))  # a flat picture: few bytes
    assert len(taller) < len(AT_LIMIT)
    too_large = limited.post(path, body(b64(taller)), status=400).json()["error"]["message"]
    assert "pixels" in too_large and f"the limit is {MAX_IMAGE_PIXELS} pixels" in too_large


# ------------------------------------------------------------------------------------------------------------
# --dtype bfloat16
# ------------------------------------------------------------------------------------------------------------
def test_a_bfloat16_classifier_classifies_and_embeds_as_float32_does(checkpoint, app):
    """Served in bfloat16, a ViT's classifications and image embeddings are float32's within bfloat16's
    rounding: the images reach the model in its own dtype on both routes."""
    blobs = [b64(png(noise(seed, (20 + seed, 30, 3)))) for seed in (6, 7)]
    halved = InProcessApp({"vit": checkpoint}, dtype="bfloat16")
    try:
        assert halved.registry.get("vit", None).loaded.dtype == torch.bfloat16
        pairs = [(a.post("/v1/classifications", {"images": blobs, "top_k": 100}).json()["data"],
                  a.post("/v1/embeddings", {"images": blobs}).json()["data"]) for a in (app, halved)]
    finally:
        halved.stop()
    (full_ranked, full_vectors), (half_ranked, half_vectors) = pairs
    labels = sorted(p["label"] for p in full_ranked[0]["predictions"])
    for full, half in zip(full_ranked, half_ranked, strict=True):
        assert scores(half, labels) == pytest.approx(scores(full, labels), abs=0.03)
    for full, half in zip(full_vectors, half_vectors, strict=True):
        assert float(np.dot(full["embedding"], half["embedding"])) > 0.99


def test_a_16_bit_greyscale_png_is_its_8_bit_image_scaled_not_clipped():
    """A 16-bit greyscale PNG (Pillow's mode I;16) holds values up to 65535: scaled to 8 bits it is the 8-bit image
    it was made from, not an image whose every value above 255 is white."""
    eight = noise(5, (SIZE + 3, SIZE + 1))
    sixteen = Image.open(io.BytesIO(png(eight.astype(np.uint16) * 257)))
    assert sixteen.mode.startswith("I")
    prep = ImagePreprocessing.from_hf(IMAGENET, SIZE, 3)
    torch.testing.assert_close(prep(sixteen), prep(Image.fromarray(eight)), atol=0, rtol=0)
