"""Documents through a real server on the bundled translator: a multi-paragraph text beyond the model's source
limit keeps its layout and is decoded with several rows at once; `n` alternatives are distinct, best first,
the hypotheses beam search ranks, in its order, with the scores it ranks by; documents stream sentence by sentence; a
short request sent while a long document runs finishes first."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import httpx
import pytest
import torch

from tests.helpers.server import ServerProcess
from tserve.model.checkpoint import load
from tserve.model.decoding import translate as translate_ids

ROOT = Path(__file__).resolve().parents[2]
BUNDLED = ROOT / "models" / "tserve-en-de"

PARAGRAPHS = [
    "Click Save to keep your changes. The document is stored in the current folder. If the folder is read-only, "
    "choose another one.",
    "Choose Tools - Options - Load/Save - General. Select the default file format for new documents. "
    "The settings apply to new documents only.\nPress Enter to close the dialog.",
    "To print the current document, choose File - Print. Select the printer and the number of copies. "
    "Then click OK.",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(["--model", f"mt={BUNDLED}", "--max-running-requests", "16"],
                        tmp_path_factory.mktemp("logs") / "server.log").wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def mt():
    return load(BUNDLED)


def translate(server: ServerProcess, body: dict) -> dict:
    resp = httpx.post(server.url + "/v1/translations", json={"model": "mt"} | body, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()


def layout(text: str) -> list[str]:
    return re.findall(r"\s*\n\s*", text)


def batches_over_one_row(server: ServerProcess) -> float:
    """How many engine batches (encoder and decoder) of the translator held more than one row so far."""
    count = one = 0.0
    for line in httpx.get(server.url + "/metrics", timeout=5).text.splitlines():
        if 'model="mt"' in line and line.startswith("tserve_batch_size_count"):
            count = float(line.split()[-1])
        elif 'model="mt"' in line and line.startswith("tserve_batch_size_bucket") and 'le="1.0"' in line:
            one = float(line.split()[-1])
    return count - one


def test_a_long_document_keeps_its_layout_and_decodes_in_parallel(server, mt):
    document = "\n\n".join(PARAGRAPHS * 4) + "\n"
    assert len(mt.tokenizer.encode(document)) > mt.config.max_source_len  # one request, beyond the limit
    before = batches_over_one_row(server)
    out = translate(server, {"input": document, "num_beams": 1})
    text = out["data"][0]["translation"]
    assert layout(text) == layout(document) and text.endswith("\n") and not text.startswith((" ", "\n"))
    assert len(text.split("\n\n")) == 12
    # The engine ran batches of more than one row for this request alone: its sentences side by side.
    assert batches_over_one_row(server) > before
    assert out["usage"]["prompt_tokens"] > mt.config.max_source_len


def test_a_sentence_beyond_the_source_limit_is_cut_not_refused(server, mt):
    sentence = " ".join(["the document and the folder"] * 80)  # no sentence end, no clause punctuation
    assert len(mt.tokenizer.encode(sentence)) > mt.config.max_source_len
    out = translate(server, {"input": sentence, "num_beams": 1, "max_tokens": 8})
    assert out["data"][0]["translation"].strip()


def teacher_forced_score(mt, source: str, ids: list[int]) -> float:  # noqa: ANN001
    """The length-normalised log-probability of the target `ids` (eos included where they end on it) given
    `source`."""
    src = torch.tensor([mt.tokenizer.encode(source)])
    dec = torch.tensor([[mt.config.decoder_start_token_id] + ids[:-1]])
    with torch.inference_mode():
        logits = mt.model(src, torch.tensor([src.size(1)]), dec)
    logp = torch.log_softmax(logits.float(), -1)[0].gather(1, torch.tensor(ids)[:, None]).sum().item()
    return logp / len(ids) ** mt.generation.length_penalty


def ranked_hypotheses(mt, source: str, num_beams: int) -> list[tuple[str, list[int]]]:  # noqa: ANN001
    """The distinct texts of a beam search alone, in its order, with the ids it generated for each."""
    seq = translate_ids(mt, [mt.tokenizer.encode(source)], num_beams)[0]
    hyps = seq.search.hypotheses(num_beams) if num_beams > 1 else [(seq.generated, 0.0)]
    distinct: dict[str, list[int]] = {}
    for ids, _ in hyps:
        distinct.setdefault(mt.tokenizer.decode(ids), ids)
    return list(distinct.items())


SENTENCES = ["Click Save to keep your changes.", "Choose Tools - Options.", "Select the printer.",
             "Good morning."]


def test_alternatives_are_the_beams_in_their_order_with_the_scores_they_are_ranked_by(server, mt):
    out = translate(server, {"input": SENTENCES, "num_beams": 4, "n": 4})
    for source, item in zip(SENTENCES, out["data"], strict=True):
        alts = item["alternatives"]
        texts, scores = [a["translation"] for a in alts], [a["score"] for a in alts]
        assert 2 <= len(alts) <= 4 and len(set(texts)) == len(texts)
        assert texts[0] == item["translation"] and scores[0] == item["score"]
        assert scores == sorted(scores, reverse=True)
        reference = ranked_hypotheses(mt, source, 4)
        assert texts == [text for text, _ in reference][: len(texts)]
        for (_, ids), score in zip(reference, scores, strict=False):
            assert teacher_forced_score(mt, source, ids) == pytest.approx(score, abs=1e-3)
    greedy = translate(server, {"input": SENTENCES[0], "num_beams": 1})["data"][0]
    assert "alternatives" not in greedy
    [(text, ids)] = ranked_hypotheses(mt, SENTENCES[0], 1)
    assert greedy["translation"] == text
    assert teacher_forced_score(mt, SENTENCES[0], ids) == pytest.approx(greedy["score"], abs=1e-3)


def test_a_documents_score_is_the_token_weighted_mean_and_alternatives_join_sentences(server, mt):
    document = " ".join(SENTENCES[:2])
    whole = translate(server, {"input": document, "n": 2})["data"][0]
    parts = translate(server, {"input": SENTENCES[:2], "n": 2})["data"]
    assert whole["translation"] == " ".join(p["translation"] for p in parts)
    lengths = [len(ranked_hypotheses(mt, s, mt.generation.num_beams)[0][1]) for s in SENTENCES[:2]]
    mean = sum(p["score"] * n for p, n in zip(parts, lengths, strict=True)) / sum(lengths)
    assert whole["score"] == pytest.approx(mean, abs=1e-3)
    second = " ".join(p["alternatives"][1]["translation"] for p in parts)
    assert whole["alternatives"][1]["translation"] == second


def test_a_document_streams_sentence_by_sentence(server):
    document = "\n\n".join(PARAGRAPHS)
    whole = translate(server, {"input": document})["data"][0]
    chunks = []
    with httpx.stream("POST", server.url + "/v1/translations", json={"model": "mt", "input": document,
                                                                     "stream": True}, timeout=300) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    items = [c["data"][0] for c in chunks]
    assert [i["segment"] for i in items] == list(range(len(items))) and len(items) >= 8
    assert "".join(i["delta"] for i in items) == whole["translation"] == items[-1]["translation"]
    assert chunks[-1]["finish_reason"] in ("stop", "length") and items[-1]["score"] == pytest.approx(whole["score"])


@pytest.mark.slow  # 8 s; its planted bug is caught in-process too (engine/test_documents.py, test_admission_policy.py)
def test_a_short_request_sent_while_a_long_document_runs_finishes_first(tmp_path):
    """Four rows, a document of 24 sentences with 4 beams (one sentence at a time), then a short request:
    its sentence takes its turn before the document's later sentences, so its answer comes back first."""
    srv = ServerProcess(["--model", f"mt={BUNDLED}", "--max-running-requests", "4"], tmp_path / "server.log",
                        step_delay_s=0.01).wait_ready()
    order: list[str] = []
    try:
        def send(name: str, body: dict) -> None:
            httpx.post(srv.url + "/v1/translations", json={"model": "mt"} | body, timeout=300).raise_for_status()
            order.append(name)

        document = threading.Thread(target=send, args=("document", {"input": " ".join(PARAGRAPHS * 2)}))
        document.start()
        while srv.metric("tserve_running_requests", "mt", 0) < 1:
            pass
        send("short", {"input": "Good morning."})
        document.join()
    finally:
        srv.stop()
    assert order == ["short", "document"]


GLOSSARY = {"printer": "Druckgerät", "changes": "Modifikationen", "folder": "Verzeichnis"}
CONSTRAINED = ["Select the printer.", "Click Save to keep your changes.", "The file is stored in the current folder.",
               "Select the Printer and the folder."]


def test_glossary_terms_appear_verbatim_also_beside_ten_other_requests(server):
    others = [f"Choose Tools - Options - {w}." for w in ("General", "View", "Print", "Paths", "Colors", "Fonts",
                                                          "Security", "Appearance", "Accessibility", "Advanced")]
    alone = [translate(server, {"input": text})["data"][0]["translation"] for text in others]
    results: dict[str, str] = {}

    def send(key: str, body: dict) -> None:
        results[key] = translate(server, body)["data"]

    threads = [threading.Thread(target=send, args=(f"o{i}", {"input": t})) for i, t in enumerate(others)]
    threads.append(threading.Thread(target=send, args=("g", {"input": CONSTRAINED, "glossary": GLOSSARY})))
    threads.append(threading.Thread(target=send, args=("greedy", {"input": CONSTRAINED[0], "num_beams": 1,
                                                                  "glossary": GLOSSARY})))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    glossed = [item["translation"] for item in results["g"]]
    assert "Druckgerät" in glossed[0] and "Modifikationen" in glossed[1] and "Verzeichnis" in glossed[2]
    assert "Druckgerät" in glossed[3] and "Verzeichnis" in glossed[3]  # any case in the source
    assert "Druckgerät" in results["greedy"][0]["translation"]
    assert [results[f"o{i}"][0]["translation"] for i in range(len(others))] == alone
    plain = translate(server, {"input": CONSTRAINED[0]})["data"][0]["translation"]
    assert "Druckgerät" not in plain  # the glossary made the difference


def test_glossary_terms_that_cannot_fit_are_a_422_naming_them(server):
    resp = httpx.post(server.url + "/v1/translations", json={
        "model": "mt", "input": "Select the printer.", "max_tokens": 3,
        "glossary": {"printer": "Hochleistungslaserdruckgerät mit Netzwerkanschluss"}}, timeout=60)
    assert resp.status_code == 422, resp.text
    assert "Hochleistungslaserdruckgerät mit Netzwerkanschluss" in resp.json()["error"]["message"]


@pytest.mark.parametrize("glossary, reason", [
    ({f"term{i}": "x" for i in range(65)}, "65 entries; the limit is 64"),
    ({"printer": ""}, "not blank"),
    ({"": "Drucker"}, "not blank"),
    ({"printer": "x" * 101}, "1 to 100 characters"),
])
def test_bad_glossaries_are_400(server, glossary, reason):
    resp = httpx.post(server.url + "/v1/translations", json={"model": "mt", "input": "Select the printer.",
                                                             "glossary": glossary}, timeout=60)
    assert resp.status_code == 400 and reason in resp.json()["error"]["message"], resp.text


def test_oip_takes_n_and_a_glossary(server):
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2], "data": CONSTRAINED[:2]}],
            "parameters": {"n": 2, "glossary": json.dumps(GLOSSARY)}}
    resp = httpx.post(server.url + "/v2/models/mt/infer", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    out = {o["name"]: o for o in resp.json()["outputs"]}
    assert "Druckgerät" in out["translation"]["data"][0] and "Modifikationen" in out["translation"]["data"][1]
    assert out["alternatives"]["shape"] == [2, 2] and out["alternatives"]["data"][0] == out["translation"]["data"][0]
    assert len(out["score"]["data"]) == 2
    bad = httpx.post(server.url + "/v2/models/mt/infer", json=body | {"parameters": {"glossary": {"a": "b"}}},
                     timeout=60)
    assert bad.status_code == 400
