"""`/v1/embeddings` through a real server, on Hugging Face checkpoints so that `transformers` is the reference:
GPT-2 (mean of the final hidden states), Marian (mean of the encoder output) and ViT (the final class token).
OpenAI's shape, float and base64, batched equals alone, inputs bounded, the metric counts inputs."""

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

# The outcome depends on the CPU's kernels: `make test-avx2` runs this module again on AVX2-only ones.
pytestmark = pytest.mark.kernels

TEXTS = ["Good morning, my friend.", "Where is the station?", "the cat sat on the mat", "Hello"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return factories.hf_model_set(tmp_path_factory.mktemp("embedding-models"))


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    srv = ServerProcess([*factories.model_flags(models), "--max-prompts", "6"],
                        tmp_path_factory.mktemp("logs") / "server.log").wait_ready()
    yield srv
    srv.stop()


def embed(server: ServerProcess, body: dict, status: int = 200) -> dict:
    resp = httpx.post(server.url + "/v1/embeddings", json=body, timeout=60)
    assert resp.status_code == status, resp.text
    return resp.json()


def vectors(answer: dict) -> np.ndarray:
    return np.array([d["embedding"] for d in answer["data"]], dtype=np.float32)


def normalised(x: torch.Tensor) -> np.ndarray:
    return torch.nn.functional.normalize(x.float(), dim=-1).numpy()


def png(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (20, 24, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def test_language_model_embeddings_are_transformers_mean_final_hidden_states(server, models):
    answer = embed(server, {"model": "gpt2", "input": TEXTS})
    assert answer["object"] == "list" and answer["model"] == "gpt2"
    assert [d["object"] for d in answer["data"]] == ["embedding"] * 4 and [d["index"] for d in answer["data"]] == [0, 1, 2, 3]
    got = vectors(answer)
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    ours = load(models["gpt2"])
    hf = transformers.GPT2Model.from_pretrained(models["gpt2"]).eval()
    ref, tokens = [], 0
    for text in TEXTS:
        ids = ours.tokenizer.encode(text)
        tokens += len(ids)
        with torch.no_grad():
            ref.append(normalised(hf(torch.tensor([ids])).last_hidden_state[0].mean(0)))
    assert np.allclose(got, np.stack(ref), atol=1e-4)
    assert answer["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    assert not np.allclose(got[0], got[1], atol=1e-2)  # the inputs matter


def test_translator_embeddings_are_transformers_mean_encoder_output(server, models):
    got = vectors(embed(server, {"model": "marian", "input": TEXTS}))
    ours = load(models["marian"])
    encoder = transformers.MarianMTModel.from_pretrained(models["marian"]).eval().get_encoder()
    for text, vector in zip(TEXTS, got, strict=True):
        with torch.no_grad():
            ref = encoder(input_ids=torch.tensor([ours.tokenizer.encode(text)])).last_hidden_state[0].mean(0)
        assert np.allclose(vector, normalised(ref), atol=1e-4)


def test_image_embeddings_are_transformers_final_class_token(server, models):
    images = [png(0), png(1)]
    answer = embed(server, {"model": "vit", "images": [base64.b64encode(b).decode() for b in images]})
    ours = load(models["vit"])
    hf = transformers.ViTForImageClassification.from_pretrained(models["vit"]).eval()
    pixels = torch.stack([ours.preprocessing(Image.open(io.BytesIO(b))) for b in images])
    with torch.no_grad():
        ref = hf.vit(pixel_values=pixels).last_hidden_state[:, 0]
    assert np.allclose(vectors(answer), normalised(ref), atol=1e-4)
    patches = (ours.config.image_size // ours.config.patch_size) ** 2
    assert answer["usage"]["prompt_tokens"] == 2 * (patches + 1)
    upload = httpx.post(server.url + "/v1/embeddings", data={"model": "vit"},
                        files=[("file", ("a.png", images[0], "image/png"))], timeout=60)
    assert upload.status_code == 200 and np.allclose(vectors(upload.json())[0], vectors(answer)[0], atol=1e-6)


def test_base64_is_the_float32_bytes_and_batched_equals_alone(server):
    floats = vectors(embed(server, {"model": "gpt2", "input": TEXTS}))
    packed = embed(server, {"model": "gpt2", "input": TEXTS, "encoding_format": "base64", "user": "u1"})
    decoded = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in packed["data"]])
    assert np.array_equal(decoded, floats)
    for i, text in enumerate(TEXTS):
        alone = vectors(embed(server, {"model": "gpt2", "input": text}))[0]
        assert np.allclose(alone, floats[i], atol=1e-5)


def test_inputs_are_bounded_and_the_metric_counts_them(server, models):
    before = server.metric("tserve_embeddings_total", "marian", 0)
    embed(server, {"model": "marian", "input": TEXTS[:3]})
    assert server.metric("tserve_embeddings_total", "marian") == before + 3
    limit = load(models["marian"]).config.max_source_len
    too_long = embed(server, {"model": "marian", "input": ["fine", "word " * (limit + 5)]}, 400)
    assert "input 1" in too_long["error"]["message"] and str(limit) in too_long["error"]["message"]
    embed(server, {"model": "gpt2", "input": ["x"] * 7}, 400)  # --max-prompts 6
    embed(server, {"model": "gpt2", "input": []}, 400)
    embed(server, {"model": "gpt2", "input": ["fine", "  "]}, 400)
    embed(server, {"model": "gpt2", "input": "hi", "encoding_format": "int8"}, 400)
    embed(server, {"model": "vit", "input": "hi"}, 400)  # an image model takes images
    embed(server, {"input": "hi"}, 400)  # two text models are served: say which
    embed(server, {"model": "gpt2", "image": base64.b64encode(png(0)).decode()}, 400)
    embed(server, {"model": "nope", "input": "hi"}, 404)


@pytest.mark.parametrize("model", ["gpt2", "marian"])
def test_the_official_openai_client_gets_the_same_vectors(server, model):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    result = client.embeddings.create(model=model, input=TEXTS[:2])  # it asks for base64 and decodes it
    got = np.array([d.embedding for d in result.data], dtype=np.float32)
    assert np.array_equal(got, vectors(embed(server, {"model": model, "input": TEXTS[:2]})))
    assert result.model == model and result.usage.prompt_tokens == result.usage.total_tokens > 0
