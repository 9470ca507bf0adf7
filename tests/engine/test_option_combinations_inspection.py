"""Image classification, embeddings and the inspection endpoints, each where it meets another option: a head
selection on a ViT's maps, in a ViT's BertViz shapes and in a language model's heatmap picture; the layer
the picture over an image is drawn from when several are selected; --max-attention-floats on a ViT and on a
DeiT (two tokens before the patches); multipart uploads with `top_k` or `encoding_format`; palette images with
a transparent background and photos turned by their EXIF orientation; Open Inference Protocol parameters given
both for the request and for its tensor. Every app runs in this process (`httpx.ASGITransport`) on tiny models,
so that the tests take seconds."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image

from tests.helpers import factories
from tests.helpers.in_process import InProcessApp
from tserve.model.attention_maps import AttentionMap
from tserve.service.vision.attention_png import heatmap_grid

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels

# The tiny ViT (28x28 pixels in 7x7 patches) has 16 patches and its class token: 17 x 17 weights a map per
# head; the DeiT (16x16 in 4x4) has 16 patches, its class and its distillation token: 18 x 18. The limit lets
# two ViT heads through (578) but not two DeiT heads (648) nor three ViT heads (867).
VIT_TOKENS, DEIT_TOKENS = 17, 18
MAX_ATTENTION_FLOATS = 600
LM_TEXT = "Hello world"


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    root = tmp_path_factory.mktemp("inspection")
    served = InProcessApp({"vit": factories.tiny_vit_dir(root / "vit"),
                        "deit": factories.hf_vit_dir(root / "deit", seed=3, family="deit"),
                        "lm": factories.tiny_lm_dir(root / "lm")},
                       max_attention_floats=MAX_ATTENTION_FLOATS)
    yield served
    served.registry.stop()


def png(pixels: np.ndarray | Image.Image, **save) -> bytes:  # noqa: ANN003 - Pillow's save options
    image = pixels if isinstance(pixels, Image.Image) else Image.fromarray(pixels)
    buf = io.BytesIO()
    image.save(buf, format="PNG", **save)
    return buf.getvalue()


def noise(seed: int, size: tuple[int, int] = (30, 36)) -> bytes:
    return png(np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8))


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def embedding(app: InProcessApp, data: bytes, model: str = "vit") -> np.ndarray:
    (item,) = app.post("/v1/embeddings", {"model": model, "image": b64(data)}).json()["data"]
    return np.asarray(item["embedding"], dtype=np.float32)


# ------------------------------------------------------------------------------------------------------------
# Attention maps: selections meet each model kind and each format
# ------------------------------------------------------------------------------------------------------------
def test_a_vits_maps_hold_only_the_heads_asked_for(app):
    """A head selection on an image model: one head asked for is one head answered, and it is that head of the
    maps of a wider selection (the JSON and the picture's average read the same selection)."""
    image = b64(noise(1))
    (one,) = app.post("/v1/attention", {"model": "vit", "image": image, "layers": [1], "heads": [2]}).json()["maps"]
    (two,) = app.post("/v1/attention", {"model": "vit", "image": image, "layers": [1], "heads": [1, 2]}).json()["maps"]
    assert np.asarray(one["weights"]).shape == (1, VIT_TOKENS, VIT_TOKENS)
    assert np.asarray(two["weights"]).shape == (2, VIT_TOKENS, VIT_TOKENS)
    assert np.allclose(one["weights"][0], two["weights"][1], atol=1e-6)
    assert not np.allclose(two["weights"][0], two["weights"][1], atol=1e-3), "the heads must differ to tell"


def test_a_vits_bertviz_shapes_are_its_encoders_layers(app):
    """BertViz's shapes of an encoder-only model: one [1][head][query][key] entry per selected layer and the
    image's token names ([CLS] then the patches), the same weights as the JSON maps."""
    body = {"model": "vit", "image": b64(noise(2)), "layers": [0, 1], "heads": [3]}
    got = app.post("/v1/attention", body | {"format": "bertviz"}).json()
    maps = app.post("/v1/attention", body).json()["maps"]
    assert len(got["attention"]) == 2
    assert np.asarray(got["attention"]).shape == (2, 1, 1, VIT_TOKENS, VIT_TOKENS)
    assert got["tokens"][:2] == ["[CLS]", "patch(0,0)"] and len(got["tokens"]) == VIT_TOKENS
    assert np.allclose(got["attention"][1][0], maps[1]["weights"], atol=1e-6)


def test_a_language_models_heatmap_picture_draws_the_selected_heads(app):
    """A picture of heads that do not start at 0: each panel is drawn from its own head's weights, so the
    picture is the one the JSON maps of the same selection make."""
    body = {"model": "lm", "input": LM_TEXT, "layers": [1], "heads": [2, 3]}
    maps = app.post("/v1/attention", body).json()["maps"]
    picture = app.post("/v1/attention", body | {"format": "png"})
    assert picture.headers["content-type"] == "image/png"
    want = [AttentionMap(m["module"], m["layer"], m["query_tokens"], m["key_tokens"], torch.tensor(m["weights"]))
            for m in maps]
    assert picture.content == heatmap_grid(want, [2, 3])


def test_the_picture_over_an_image_is_the_deepest_selected_layers(app):
    """Without rollout the picture over the image is the class token's attention in the deepest layer selected
    (its title says so): selecting an earlier layer as well, before or after it, changes nothing."""
    image = b64(noise(3))
    both = app.post("/v1/attention", {"model": "vit", "image": image, "layers": [0, 1], "heads": [0],
                                      "format": "png"}).content
    reversed_ = app.post("/v1/attention", {"model": "vit", "image": image, "layers": [1, 0], "heads": [0],
                                           "format": "png"}).content
    last = app.post("/v1/attention", {"model": "vit", "image": image, "layers": [1], "heads": [0],
                                      "format": "png"}).content
    first = app.post("/v1/attention", {"model": "vit", "image": image, "layers": [0], "heads": [0],
                                       "format": "png"}).content
    assert both == last == reversed_
    assert first != last, "the two layers must draw different pictures to tell"


@pytest.mark.parametrize(("model", "tokens"), [("vit", VIT_TOKENS), ("deit", DEIT_TOKENS)])
def test_max_attention_floats_bounds_image_models_by_their_token_count(app, model, tokens):
    """--max-attention-floats holds for image models too, counting every token a map holds (DeiT's
    distillation token as well): what is let through answers exactly the weights counted, and one head more
    than the limit holds is refused before the model runs."""
    image = b64(noise(4))
    fits = MAX_ATTENTION_FLOATS // (tokens * tokens)
    (m,) = app.post("/v1/attention", {"model": model, "image": image, "layers": [0],
                                      "heads": list(range(fits))}).json()["maps"]
    assert np.asarray(m["weights"]).size == fits * tokens * tokens
    refused = app.post("/v1/attention", {"model": model, "image": image, "layers": [0],
                                         "heads": list(range(fits + 1))}, status=400).json()["error"]
    assert refused["code"] == "too_many_weights"
    assert f"this selection has {(fits + 1) * tokens * tokens} attention weights" in refused["message"]


# ------------------------------------------------------------------------------------------------------------
# Multipart uploads read the same options as JSON
# ------------------------------------------------------------------------------------------------------------
def test_a_multipart_classification_reads_top_k(app):
    """top_k sent as a form field beside uploaded files cuts the ranking as it does in JSON."""
    images = [noise(5), noise(6)]
    form = app.post("/v1/classifications", files=[("file", ("a.png", images[0])), ("file", ("b.png", images[1]))],
                    data={"model": "vit", "top_k": "2"}).json()
    as_json = app.post("/v1/classifications", {"model": "vit", "images": [b64(b) for b in images],
                                               "top_k": 2}).json()
    assert [len(d["predictions"]) for d in form["data"]] == [2, 2]
    assert form["data"] == as_json["data"]


def test_a_multipart_embedding_reads_the_encoding_format(app):
    """encoding_format=base64 sent as a form field: the vector comes as the float32 bytes, equal to the JSON
    request's floats."""
    data = noise(7)
    form = app.post("/v1/embeddings", files=[("file", ("a.png", data))],
                    data={"model": "vit", "encoding_format": "base64"}).json()
    packed = form["data"][0]["embedding"]
    assert isinstance(packed, str)
    assert np.array_equal(np.frombuffer(base64.b64decode(packed), dtype="<f4"), embedding(app, data))


# ------------------------------------------------------------------------------------------------------------
# Image formats: what the model sees does not depend on how the picture was stored
# ------------------------------------------------------------------------------------------------------------
def test_a_transparent_palette_image_is_seen_as_its_rgba_twin(app):
    """Transparent pixels become the white background whatever the image mode: a palette PNG whose
    background index is transparent (and black in the palette) embeds and classifies as the same picture
    stored as RGBA."""
    index = np.zeros((24, 24), dtype=np.uint8)
    index[6:18, 8:16] = 1
    palette = Image.fromarray(index, "P")
    palette.putpalette([0, 0, 0, 30, 30, 30] + [0, 0, 0] * 254)
    rgba = np.zeros((24, 24, 4), dtype=np.uint8)
    rgba[6:18, 8:16] = (30, 30, 30, 255)
    as_palette, as_rgba = png(palette, transparency=0), png(rgba)
    assert Image.open(io.BytesIO(as_palette)).mode == "P"
    assert np.array_equal(embedding(app, as_palette), embedding(app, as_rgba))
    opaque = png(np.where(rgba[..., 3:] > 0, rgba[..., :3], 0).astype(np.uint8))  # black background
    assert not np.allclose(embedding(app, as_rgba), embedding(app, opaque), atol=1e-3), "the background must tell"
    ranked = app.post("/v1/classifications", {"model": "vit", "images": [b64(as_palette), b64(as_rgba)],
                                              "top_k": 4}).json()["data"]
    # Two rows of one batch: the same labels, the scores within a float's rounding (rows of a batch may sum apart).
    assert [p["label"] for p in ranked[0]["predictions"]] == [p["label"] for p in ranked[1]["predictions"]]
    assert [p["score"] for p in ranked[0]["predictions"]] == pytest.approx([p["score"] for p in ranked[1]["predictions"]],
                                                                           abs=1e-6)


def test_an_exif_orientation_turns_the_picture_upright_for_every_image_route(app):
    """A photo stored sideways with an EXIF orientation tag is the upright picture for classification,
    embeddings and the attention maps alike."""
    upright = np.random.default_rng(8).integers(0, 255, (24, 40, 3), dtype=np.uint8)
    exif = Image.Exif()
    exif[0x0112] = 6  # the stored pixels are turned 90 degrees anticlockwise: display them turned back
    sideways = png(Image.fromarray(upright).transpose(Image.Transpose.ROTATE_90), exif=exif.tobytes())
    plain = png(upright)
    assert np.array_equal(embedding(app, sideways), embedding(app, plain))
    assert not np.allclose(embedding(app, png(np.rot90(upright).copy())), embedding(app, plain), atol=1e-3)
    ranked = app.post("/v1/classifications", {"model": "vit", "images": [b64(sideways), b64(plain)],
                                              "top_k": 4}).json()["data"]
    # Two rows of one batch: the same labels, the scores within a float's rounding (rows of a batch may sum apart).
    assert [p["label"] for p in ranked[0]["predictions"]] == [p["label"] for p in ranked[1]["predictions"]]
    assert [p["score"] for p in ranked[0]["predictions"]] == pytest.approx([p["score"] for p in ranked[1]["predictions"]],
                                                                           abs=1e-6)
    maps = [app.post("/v1/attention", {"model": "vit", "image": b64(b), "layers": [1], "heads": [0]}).json()["maps"]
            for b in (sideways, plain)]
    assert maps[0] == maps[1]
    # The picture under the maps too: drawn on the upright image the model saw, not on the stored pixels.
    pictures = [app.post("/v1/attention", {"model": "vit", "image": b64(b), "layers": [1], "heads": [0],
                                           "format": "png"}).content for b in (sideways, plain)]
    assert pictures[0] == pictures[1]


# ------------------------------------------------------------------------------------------------------------
# Open Inference Protocol parameters
# ------------------------------------------------------------------------------------------------------------
def test_a_tensors_own_parameters_override_the_requests(app):
    """Parameters given for the request and for its input tensor: the tensor's win where both name one."""

    def infer(parameters: dict, tensor_parameters: dict | None = None) -> list[str]:
        tensor = {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": [LM_TEXT]}
        if tensor_parameters is not None:
            tensor["parameters"] = tensor_parameters
        outputs = app.post("/v2/models/lm/infer", {"inputs": [tensor], "parameters": parameters}).json()["outputs"]
        return next(o for o in outputs if o["name"] == "text_output")["data"]

    shared = {"temperature": 0, "ignore_eos": True}
    short, long = infer(shared | {"max_tokens": 2}), infer(shared | {"max_tokens": 8})
    assert short != long
    assert infer(shared | {"max_tokens": 8}, {"max_tokens": 2}) == short
    assert infer({"max_tokens": 2}, shared | {"max_tokens": 8}) == long
