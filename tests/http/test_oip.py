"""Open Inference Protocol (v2) endpoints for the classifier and the translator, with the protocol's JSON
(the language models': tests/http/test_llama_family_http.py)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import shutil

import httpx
import pytest
import torch
from PIL import Image

from tests.helpers import factories
from tests.helpers.fixture_training import sentences_where_beams_matter
from tests.helpers.polling import until
from tests.helpers.server import ServerProcess
from tserve.model import checkpoint
from tserve.model.decoding import translate


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    models = factories.tiny_model_set(tmp_path_factory.mktemp("oip"))
    # The same translator with greedy decoding as its default (the protocol has no num_beams): both paths.
    greedy = tmp_path_factory.mktemp("oip-mt-greedy")
    shutil.copytree(models["mt"], greedy, dirs_exist_ok=True)
    generation = json.loads((greedy / "generation.json").read_text())
    (greedy / "generation.json").write_text(json.dumps({**generation, "num_beams": 1}))
    return {**models, "mt-greedy": greedy}


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    args = factories.model_flags(models)
    srv = ServerProcess([*args, "--max-input-chars", "500"], tmp_path_factory.mktemp("oip-logs") / "server.log"
                        ).wait_ready()
    yield srv
    srv.stop()


def png(color) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), color).save(buf, format="PNG")
    return buf.getvalue()


def test_health_and_metadata(server):
    assert httpx.get(server.url + "/v2/health/live").json() == {"live": True}
    assert httpx.get(server.url + "/v2/health/ready").json() == {"ready": True}
    assert httpx.get(server.url + "/v2/models/vit/ready").json() == {"name": "vit", "ready": True}
    meta = httpx.get(server.url + "/v2/models/vit").json()
    assert meta["name"] == "vit" and {i["name"] for i in meta["inputs"]} == {"image", "pixels"}
    pixels = next(i for i in meta["inputs"] if i["name"] == "pixels")
    assert pixels == {"name": "pixels", "datatype": "FP32", "shape": [-1, 1, 28, 28]}
    meta = httpx.get(server.url + "/v2/models/mt").json()
    assert meta["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1]}]


def test_classify_bytes_and_pixels(server, models):
    vit = checkpoint.load(models["vit"], device="cpu")
    images = [png((200, 20, 20)), png((250, 250, 250))]
    encoded = [base64.b64encode(b).decode() for b in images]
    encoded[1] = "data:image/png;base64," + encoded[1]  # a data URL, as /v1 takes it too
    body = {"id": "req-1", "inputs": [{"name": "image", "datatype": "BYTES", "shape": [2], "data": encoded}]}
    resp = httpx.post(server.url + "/v2/models/vit/infer", json=body).json()
    assert resp["model_name"] == "vit" and resp["id"] == "req-1"
    outputs = {o["name"]: o for o in resp["outputs"]}
    assert outputs["probabilities"]["shape"] == [2, len(vit.labels)]
    pixels = torch.stack([vit.preprocessing(Image.open(io.BytesIO(b))) for b in images])
    with torch.no_grad():
        ref = torch.softmax(vit.model(pixels), -1)
    got = torch.tensor(outputs["probabilities"]["data"]).reshape(2, -1)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
    assert outputs["label"]["data"] == [vit.labels[int(i)] for i in ref.argmax(-1)]

    body = {"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [2, 1, 28, 28],
                        "data": pixels.flatten().tolist()}], "outputs": [{"name": "label"}]}
    resp = httpx.post(server.url + "/v2/models/vit/infer", json=body).json()
    assert [o["name"] for o in resp["outputs"]] == ["label"]
    assert resp["outputs"][0]["data"] == outputs["label"]["data"]


@pytest.mark.parametrize(("name", "num_beams"), [("mt-greedy", 1), ("mt", 2)])
def test_translate_bytes(server, models, name, num_beams):
    mt = checkpoint.load(models[name], device="cpu")
    g = mt.generation
    assert g.num_beams == num_beams
    # The last one is a lexicon sentence whose greedy and 2-beam translations differ.
    texts = ["Good morning.", "Where is the station?", *sentences_where_beams_matter(
        mt, 1, num_beams=2, max_new_tokens=min(g.max_new_tokens, mt.config.max_target_len))]
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [3], "data": texts}]}
    resp = httpx.post(server.url + f"/v2/models/{name}/infer", json=body).json()
    outputs = {o["name"]: o for o in resp["outputs"]}
    assert list(outputs) == ["translation", "score"]  # "alternatives" only with n > 1
    out = outputs["translation"]
    assert out["shape"] == [3] and outputs["score"]["shape"] == [3]
    sources = [mt.tokenizer.encode(t) for t in texts]
    greedy, beams = ([s.output_ids for s in translate(mt, sources, n)] for n in (1, 2))
    assert greedy != beams, "the inputs must tell greedy decoding and beam search apart"
    ref = greedy if num_beams == 1 else beams
    assert out["data"] == [mt.tokenizer.decode(r) for r in ref]
    same = httpx.post(server.url + "/v1/translations", json={"model": name, "input": texts}).json()
    assert out["data"] == [d["translation"] for d in same["data"]]
    assert outputs["score"]["data"] == pytest.approx([d["score"] for d in same["data"]])


@pytest.mark.parametrize(("path", "body", "status"), [
    ("/v2/models/nope/infer", {"inputs": []}, 404),
    ("/v2/models/lm/infer", {"inputs": []}, 400),
    ("/v2/models/vit/infer", {"inputs": []}, 400),
    ("/v2/models/vit/infer", {"inputs": [{"name": "other", "datatype": "BYTES", "shape": [1], "data": ["x"]}]}, 400),
    ("/v2/models/vit/infer", {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [2], "data": ["x"]}]}, 400),
    ("/v2/models/vit/infer", {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1],
                                          "data": ["bm90IGFuIGltYWdl"]}]}, 400),
    ("/v2/models/vit/infer", {"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1, 3, 28, 28],
                                          "data": [0.0] * (3 * 28 * 28)}]}, 400),
    ("/v2/models/mt/infer", {"inputs": [{"name": "text", "datatype": "FP32", "shape": [1], "data": [1.0]}]}, 400),
    ("/v2/models/mt/infer", [1, 2], 400),
])
def test_errors_are_protocol_shaped(server, path, body, status):
    resp = httpx.post(server.url + path, json=body)
    assert resp.status_code == status
    assert set(resp.json()) == {"error"} and resp.json()["error"]


@pytest.mark.parametrize(("texts", "message"), [(["Good morning.", "  "], "input 1 is empty"),
                                                 (["a" * 501], "input 0 has 501 characters; the limit is 500")])
def test_translation_inputs_have_the_limits_of_v1(server, texts, message):
    """The same input checks as /v1/translations: no empty input, --max-input-chars."""
    resp = httpx.post(server.url + "/v2/models/mt/infer", json={"inputs": [
        {"name": "text", "datatype": "BYTES", "shape": [len(texts)], "data": texts}]})
    assert resp.status_code == 400 and resp.json() == {"error": message}
    v1 = httpx.post(server.url + "/v1/translations", json={"model": "mt", "input": texts})
    assert v1.status_code == 400 and v1.json()["error"]["message"] == message


@pytest.mark.slow  # 4-8 s: a server of its own, slowed down until full
def test_a_full_server_answers_429_with_retry_after_on_both_protocols(models, tmp_path):
    """One error map: with no waiting room (--max-queue 0), 2 decoder rows held by a slow 2-beam
    translation and the classifier busy with a slow batch, `/v1` and `/v2` both refuse with 429 and
    Retry-After, each in its own error shape."""
    args = factories.model_flags({k: models[k] for k in ("mt", "vit")}) + [
        "--max-queue", "0", "--max-running-requests", "2", "--batch-max-wait-ms", "0"]
    srv = ServerProcess(args, tmp_path / "server.log", step_delay_s=0.1,
                        hooks={"TSERVE_TEST_BATCH_DELAY_S": "1.0"}).wait_ready()
    image = base64.b64encode(png((10, 200, 30))).decode()
    text = "good morning where is the station the house is small"
    refused = {
        "/v1/translations": {"model": "mt", "input": "hello", "num_beams": 1},
        "/v2/models/mt/infer": {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["hello"]}]},
        "/v1/classifications": {"model": "vit", "image": image},
        "/v2/models/vit/infer": {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1], "data": [image]}]},
    }

    async def go() -> dict[str, httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            holders = [asyncio.create_task(client.post(srv.url + "/v1/translations",
                                                       json={"model": "mt", "input": text, "num_beams": 2})),
                       asyncio.create_task(client.post(srv.url + "/v1/classifications",
                                                       json={"model": "vit", "image": image}))]
            # Both held: the rows by the translation, the worker by its batch.
            await until(lambda: srv.metric("tserve_kv_slots_in_use", "mt", 0) == 2
                        and srv.metric("tserve_running_requests", "vit", 0) >= 1, timeout=30)
            out = {path: await client.post(srv.url + path, json=body) for path, body in refused.items()}
            assert [(await h).status_code for h in holders] == [200, 200]
            return out

    try:
        answers = asyncio.run(go())
    finally:
        srv.stop()
    for path, resp in answers.items():
        assert resp.status_code == 429 and int(resp.headers["retry-after"]) >= 1, (path, resp.text)
        error = resp.json()["error"]
        if path.startswith("/v2/"):
            assert isinstance(error, str) and error, (path, error)
        else:
            assert error["code"] == "rate_limit_exceeded" and error["message"], (path, error)
