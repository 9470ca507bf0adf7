"""The commands beside `serve` and how a model is found, where their options meet: `tserve models` against a server
with API and admin keys and a model repository (each row's reason, the server's own error message, a command
without the model's name), `tserve half` over several checkpoints and over one stored in bfloat16, `tserve align`'s
languages and --no-write reaching the chooser, `python -m tserve.service` keeping the command's exit status, a Hugging
Face repo's chat_template.jinja fetched with its weights, and `continue_final_message` where the final message's
text also occurs earlier or comes in content parts. All in this process, on the tiny fixture checkpoints, in
seconds."""

from __future__ import annotations

import json
import runpy
import shutil
import sys
import warnings
from pathlib import Path

import httpx
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.helpers.in_process import InProcessApp
from tests.model.test_hub import FakeHub, hf_env, tiny_qwen2  # noqa: F401 - fixtures
from tserve.model import hub
from tserve.model.chat_template import continued
from tserve.model.tokenizer import load_tokenizer
from tserve.service.cli import main

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TINY_LM, TINY_MT = FIXTURES / "tiny-lm", FIXTURES / "tiny-mt"
ADMIN, USER = "adm-0123456789", "usr-0123456789"


# ------------------------------------------------------------------------------------------------------------
# `tserve models` against a server with keys
# ------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def keyed_app(tmp_path_factory):
    """A server with API keys and an admin key, serving "lm" and holding "mt" in its model repository (not
    loaded)."""
    repository = tmp_path_factory.mktemp("commands-repository")
    (repository / "mt").symlink_to(TINY_MT, target_is_directory=True)
    served = InProcessApp({"lm": TINY_LM}, model_repository=str(repository), api_keys=[USER], admin_keys=[ADMIN],
                          warmup=False, gc_freeze=False)
    yield served
    served.stop()


@pytest.fixture
def through_app(keyed_app, monkeypatch):
    """`tserve models`'s HTTP calls answered by the in-process app; every call recorded."""
    sent: list[tuple[str, dict]] = []

    def post(url: str, json: dict, headers: dict, timeout: float | None) -> httpx.Response:
        sent.append((url, json))
        return keyed_app.request("POST", url.removeprefix("http://srv:1"), json=json, headers=headers)

    monkeypatch.setattr(httpx, "post", post)
    monkeypatch.delenv("TSERVE_ADMIN_KEY", raising=False)
    monkeypatch.setenv("TSERVE_URL", "http://srv:1")
    return sent


def test_models_list_shows_each_models_state_and_the_reason_it_is_not_serving(through_app, capsys):
    """`tserve models list` prints one tab-separated row per model: a served one as NAME, READY (no trailing
    reason), a repository model not loaded with the reason the server gives, which says why it does not answer."""
    assert main(["models", "list", "--key", ADMIN]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows == ["lm\tREADY", "mt\tUNAVAILABLE\tnot loaded (in the model repository)"]


def test_models_with_a_wrong_key_prints_the_servers_message_and_exits_1(through_app, capsys):
    """A refused call (a user's key where the admin key is needed) exits 1 with the status and the server's message
    (the text of its `{"error": "..."}` body), not the raw JSON."""
    assert main(["models", "list", "--key", USER]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "tserve models list: 401 the model repository API needs an admin key (TSERVE_ADMIN_KEYS)"
    assert main(["models", "load", "nope", "--key", ADMIN]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tserve models load: 404 ") and "{" not in err


@pytest.mark.parametrize("action", ["load", "unload"])
def test_models_load_or_unload_without_a_name_is_a_usage_error_and_calls_nothing(through_app, capsys, action):
    """Both `load` and `unload` name their model: without one the command exits 2 with what to give, before
    asking the server anything (and never with a traceback)."""
    assert main(["models", action, "--key", ADMIN]) == 2
    assert capsys.readouterr().err.strip() == f"tserve models {action}: give the model's name"
    assert through_app == []


def test_python_m_tserve_service_exits_with_the_commands_status(monkeypatch, capsys):
    """`python -m tserve.service ...` is `tserve ...`, exit status included: a usage error is 2, for scripts
    (and `make`) to see, like `python -m tserve`."""
    for module in ("tserve.service", "tserve"):
        monkeypatch.setattr(sys, "argv", [module, "models", "unload"])
        with pytest.raises(SystemExit) as info:
            runpy.run_module(module, run_name="__main__", alter_sys=False)
        assert info.value.code == 2, module
        assert "give the model's name" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------------------
# `tserve half`
# ------------------------------------------------------------------------------------------------------------
def _dtypes(directory: Path) -> dict[str, torch.dtype]:
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k).dtype for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__


def test_half_converts_every_checkpoint_it_is_given_and_counts_each_ones_tensors(tmp_path, capsys):
    """`tserve half A B`: each checkpoint's float32 tensors stored as float16, its card re-rendered, one line per
    checkpoint saying how many tensors it converted (all of them here), exit 0."""
    dirs = [Path(shutil.copytree(src, tmp_path / src.name)) for src in (TINY_LM, TINY_MT)]
    counts = [len(_dtypes(d)) for d in dirs]
    assert all(set(_dtypes(d).values()) == {torch.float32} for d in dirs)
    assert main(["half", *map(str, dirs)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"{d / 'model.safetensors'}: {n} tensors now float16" for d, n in zip(dirs, counts, strict=True)]
    for d in dirs:
        assert set(_dtypes(d).values()) == {torch.float16}, d
        assert "(float16)" in (d / "MODEL_CARD.md").read_text()


def test_half_leaves_tensors_that_are_not_float32_as_they_are(tmp_path, capsys):
    """Only float32 tensors are halved: a checkpoint stored in bfloat16 keeps bfloat16 (its range; float16 would
    overflow where bfloat16 does not), and an integer tensor keeps its dtype and values; the count names the
    float32 ones only."""
    d = Path(shutil.copytree(TINY_LM, tmp_path / "lm"))
    tensors = load_file(str(d / "model.safetensors"))
    names = sorted(tensors)
    kept = {k: v.bfloat16() for k, v in tensors.items() if k != names[0]}
    counts = torch.arange(5, dtype=torch.int64) * 70000  # past float16's range
    save_file({names[0]: tensors[names[0]], **kept, "counts": counts}, str(d / "model.safetensors"),
              metadata={"format": "pt", "producer": "tserve"})
    assert main(["half", str(d)]) == 0
    assert capsys.readouterr().out.strip() == f"{d / 'model.safetensors'}: 1 tensors now float16"
    after = load_file(str(d / "model.safetensors"))
    assert after[names[0]].dtype == torch.float16
    assert {after[k].dtype for k in kept} == {torch.bfloat16}
    assert all(torch.equal(after[k], v) for k, v in kept.items())
    assert after["counts"].dtype == torch.int64 and torch.equal(after["counts"], counts)


def test_half_of_a_sharded_checkpoint_halves_each_shard_and_a_bad_one_is_a_one_line_error(tmp_path, capsys):
    """A checkpoint in shards (`model.safetensors.index.json`) has each shard halved. A directory that is no
    checkpoint is an `error:` line naming it and exit 1, not a traceback, and the good checkpoints given beside it
    are still converted."""
    d = tmp_path / "sharded"
    shutil.copytree(TINY_LM, d)
    tensors = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(d / file), metadata={"format": "pt"})
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: file for file, keys in shards.items() for k in keys}}))
    assert main(["half", str(tmp_path / "missing"), str(d)]) == 1
    out, err = capsys.readouterr()
    assert err.startswith(f"error: {tmp_path / 'missing'}: ") and "Traceback" not in err, err
    assert out.splitlines() == [f"{d / file}: {len(keys)} tensors now float16" for file, keys in shards.items()]
    for file in shards:
        with safe_open(str(d / file), "pt") as f:
            assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float16}  # noqa: SIM118


def test_models_load_sends_a_path_as_this_shell_means_it(through_app, monkeypatch, tmp_path):
    """`tserve models load NAME --path P` on the server's machine: a relative path is this directory's and `~` is
    this user's home (the shell leaves `--path=~/x` as it is), so the server is sent the absolute path."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for given, sent in (("models/x", tmp_path / "models" / "x"), ("~/x", tmp_path / "home" / "x")):
        main(["models", "load", "x", "--path", given, "--key", ADMIN])
        assert through_app[-1][1] == {"parameters": {"path": str(sent)}}


def test_align_without_a_checkpoint_is_a_one_line_error(tmp_path, capsys):
    """`tserve align` on a directory that holds no translator says why in one line and exits 1, as `train` and
    `eval` do, not with a traceback."""
    assert main(["align", str(tmp_path / "none")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err, err


# ------------------------------------------------------------------------------------------------------------
# `tserve align`
# ------------------------------------------------------------------------------------------------------------
def test_align_hands_its_languages_and_no_write_to_the_chooser(monkeypatch, capsys, tmp_path):
    """`tserve align DIR --source-lang de --target-lang en --no-write --limit 50`: a multilingual translator read
    German to English, the choice only printed; without the flags English to German, written."""
    from tserve.training import alignment  # noqa: PLC0415

    calls = []

    def choose(*args):  # noqa: ANN002, ANN202
        calls.append(args)
        return {"heads": [[0, 1]], "offset": 0}

    monkeypatch.setattr(alignment, "choose", choose)
    assert main(["align", str(tmp_path), "--source-lang", "de", "--target-lang", "en", "--no-write",
                 "--limit", "50", "--data-dir", "/d"]) == 0
    assert json.loads(capsys.readouterr().out) == {"heads": [[0, 1]], "offset": 0}
    assert main(["align", str(tmp_path)]) == 0
    assert calls == [(str(tmp_path), 50, False, "/d", "de", "en"), (str(tmp_path), 400, True, None, "en", "de")]


# ------------------------------------------------------------------------------------------------------------
# A Hugging Face repo's chat template file
# ------------------------------------------------------------------------------------------------------------
def test_a_repos_chat_template_file_is_fetched_and_the_tokenizer_renders_with_it(hf_env, tiny_qwen2):  # noqa: F811
    """Newer repos keep their chat template in chat_template.jinja, not tokenizer_config.json: downloading the repo
    fetches it with the weights, so that the served model renders chats with it (it wins over the config's)."""
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    files = {p.name: p.read_bytes() for p in tiny_qwen2.iterdir()} | {"chat_template.jinja": template.encode()}
    fake = FakeHub({"org/tiny-qwen2": files})
    try:
        hf_env(HF_ENDPOINT=fake.url)
        path = hub.resolve("org/tiny-qwen2")
    finally:
        fake.close()
    assert (path / "chat_template.jinja").read_text() == template
    chat = [{"role": "user", "content": "Where is the station?"}]
    assert load_tokenizer(path).apply_chat_template(chat, add_generation_prompt=False) == \
        "[user] Where is the station?\n"


# ------------------------------------------------------------------------------------------------------------
# continue_final_message
# ------------------------------------------------------------------------------------------------------------
def test_a_continued_reply_whose_text_the_user_also_wrote_is_cut_in_the_reply(tmp_path):
    """The user asks for a sentence and the reply starts with the same words: the chat is cut after the reply's
    text (its last occurrence), not after the user's, as transformers cuts it."""
    transformers = pytest.importorskip("transformers")
    chat = [{"role": "user", "content": "Finish this: The station is"}, {"role": "assistant", "content": "The station is"}]
    for layout in ("hf-qwen2", "hf-llama"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = transformers.AutoTokenizer.from_pretrained(str(FIXTURES / layout))
        expected = theirs.apply_chat_template(chat, tokenize=False, continue_final_message=True)
        ours = load_tokenizer(FIXTURES / layout).apply_chat_template(chat, add_generation_prompt=False,
                                                                     continue_final_message=True)
        assert ours == expected and ours.count("The station is") == 2, layout


def test_a_continued_reply_in_content_parts_is_cut_after_its_last_text_part():
    """A final message given as content parts goes on from its last text part (transformers' rule), so that the
    earlier parts stay in the prompt rather than everything after the first part being cut off."""
    rendered = "<|user|>Hi<|end|><|assistant|>The station is near the bridge<|end|>\n"
    parts = [{"type": "text", "text": "The station is"}, {"type": "text", "text": "near the bridge"}]
    message = {"role": "assistant", "content": parts}
    assert continued(rendered, [message]) == "<|user|>Hi<|end|><|assistant|>The station is near the bridge"
