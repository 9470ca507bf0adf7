"""The image-classifier families over HTTP, each against transformers on the same weights: ViT, and DeiT with
its distillation token and (trained with a teacher) its second head. Classifications, embeddings (the final
class token) and the attention picture over the image (the patches come after both of DeiT's tokens)."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from tests.helpers import factories
from tests.helpers.server import ServerProcess
from tserve.model.checkpoint import load

# The outcome depends on the CPU's kernels (equality with transformers): `make test-avx2` runs it again.
pytestmark = pytest.mark.kernels

FAMILIES = ("vit", "deit-teacher", "deit")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("image-families")
    return {family: factories.hf_vit_dir(root / family, seed=3, family=family) for family in FAMILIES}


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    srv = ServerProcess(factories.model_flags(checkpoints), tmp_path_factory.mktemp("logs") / "server.log")
    yield srv.wait_ready()
    srv.stop()


def png(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (20, 24, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def post(server, path: str, body: dict) -> httpx.Response:
    resp = httpx.post(server.url + path, json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp


@pytest.mark.parametrize("family", FAMILIES)
def test_classifications_and_embeddings_are_transformers(family, server, checkpoints):
    images = [png(0), png(1), png(2)]
    ours = load(checkpoints[family])
    hf = transformers.AutoModelForImageClassification.from_pretrained(checkpoints[family]).eval()
    pixels = torch.stack([ours.preprocessing(Image.open(io.BytesIO(b))) for b in images])
    with torch.no_grad():
        probs = hf(pixel_values=pixels).logits.softmax(-1)
        states = getattr(hf, family.split("-")[0])(pixel_values=pixels).last_hidden_state[:, 0]
    encoded = [base64.b64encode(b).decode() for b in images]
    answer = post(server, "/v1/classifications", {"model": family, "images": encoded, "top_k": 3}).json()
    for item, p in zip(answer["data"], probs, strict=True):
        top = p.topk(3)
        assert [x["label"] for x in item["predictions"]] == [ours.labels[i] for i in top.indices.tolist()]
        assert [x["score"] for x in item["predictions"]] == pytest.approx(top.values.tolist(), abs=1e-5)
    embedded = post(server, "/v1/embeddings", {"model": family, "images": encoded}).json()
    got = np.array([d["embedding"] for d in embedded["data"]], dtype=np.float32)
    assert np.allclose(got, torch.nn.functional.normalize(states, dim=-1).numpy(), atol=1e-4)
    tokens = ours.config.n_patches + (1 if family == "vit" else 2)
    assert embedded["usage"]["prompt_tokens"] == len(images) * tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_the_attention_picture_reads_the_class_tokens_attention_to_the_patches(family, server, checkpoints):
    """JSON maps name DeiT's two tokens before the patches; the picture over the image (the class token's
    attention to the patches only, rolled out or not) is drawn for both families."""
    image = base64.b64encode(png(4)).decode()
    maps = post(server, "/v1/attention", {"model": family, "image": image, "layers": [1]}).json()["maps"]
    tokens = maps[0]["tokens"] if "tokens" in maps[0] else maps[0]["query_tokens"]
    assert tokens[:2] == (["[CLS]", "patch(0,0)"] if family == "vit" else ["[CLS]", "[DIST]"])
    for rollout in (False, True):
        picture = post(server, "/v1/attention", {"model": family, "image": image, "format": "png",
                                                 "rollout": rollout})
        assert picture.headers["content-type"] == "image/png"
        assert Image.open(io.BytesIO(picture.content)).size[0] > 0
