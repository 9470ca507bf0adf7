"""Where a setting comes from: every server setting read from its `tserve serve` flag, from its TSERVE_* variable
alone, and from the variable through `tserve serve` without the flag gives one value (a boolean written 0 / false /
no / off, a comma-separated list, a size in every unit the docs name, a fraction of the free memory); an invalid
size or fraction is refused when the settings are read, not when a model loads; a Ray Serve replica that Ray gave
no GPU keeps its builder arguments and its environment; a model loaded at run time through the repository API is
built with the server's settings as a model loaded at start-up is. In this process, in seconds."""

from __future__ import annotations

import asyncio
import types
import typing
from pathlib import Path

import pytest

from tests.deploy.test_option_combinations_cli import clean_env, served  # noqa: F401 - fixtures
from tests.helpers.in_process import InProcessApp
from tserve.service.cli import build_parser, main, settings_from_args
from tserve.service.settings import Settings

TINY_LM = Path(__file__).resolve().parents[1] / "fixtures" / "tiny-lm"

# Values that a generic rule would get wrong (a range, a set of allowed values, a format), as written by an operator.
SPECIAL = {
    "host": "0.0.0.0", "port": "8123", "device": "cpu", "int4_group_size": "64", "max_model_len": "512",
    "kv_cache_memory": "2GiB", "max_model_memory": "512MiB", "draft_model": "org/draft", "pivot_language": "de",
    "file_dir": "/srv/files", "translation_memory": "/srv/memory.sqlite", "otlp_endpoint": "http://collector:4318",
    "models": "lm=/srv/lm, mt=org/mt@v1", "models_dir": "/srv/models", "model_repository": "/srv/repository",
    "api_keys": "k1, k2:3", "public_paths": "/healthz, /v1/models", "cors_origins": "https://a.example, https://b.example",
    "admin_keys": "admin1,admin2", "task_modules": "pkg.one, pkg.two",
}
TRUE_WORDS, FALSE_WORDS = ("1", "true", "yes", "on", "True"), ("0", "false", "no", "off", "FALSE")


def _default(name: str) -> object:
    field = Settings.model_fields[name]
    return field.default if field.default_factory is None else field.default_factory()


def _other_value(name: str, index: int) -> tuple[str, list[str]]:
    """(the variable's text, the flags) giving `name` a value other than its default."""
    field, default = Settings.model_fields[name], _default(name)
    flag = f"--{name.replace('_', '-')}"
    annotation = field.annotation
    if annotation is bool:  # each boolean in another of the spellings an environment file may use
        words = FALSE_WORDS if default else TRUE_WORDS
        return words[index % len(words)], [flag if not default else f"--no-{name.replace('_', '-')}"]
    if name in SPECIAL:
        text = SPECIAL[name]
        if name == "models":
            return text, [a for entry in text.split(",") for a in ("--model", entry.strip())]
        return text, [flag, text]
    if typing.get_origin(annotation) is typing.Literal:
        text = next(v for v in reversed(typing.get_args(annotation)) if v != default)
    elif annotation is int:
        text = str(default + 3)
    elif annotation is float:
        text = str(default * 2 + 0.5)
    else:
        raise AssertionError(f"no value to try for {name} ({annotation})")
    return text, [flag, text]


def test_every_setting_reads_the_same_from_its_flag_from_its_variable_and_from_the_variable_through_the_cli(
        clean_env):  # noqa: F811
    """For every setting, a value other than the default: `tserve serve --flag VALUE`, TSERVE_NAME=VALUE read by
    Settings() (what the in-process app and a Ray replica read) and TSERVE_NAME=VALUE under `tserve serve` without
    the flag (a container's environment) give one value. A boolean's variable in any of its spellings
    (0 / false / no / off) must win over a flag left out: the flag's absence is no value."""
    parser = build_parser()
    for index, name in enumerate(Settings.model_fields):
        text, flags = _other_value(name, index)
        env = f"TSERVE_{name.upper()}"
        from_flag = getattr(settings_from_args(parser.parse_args(["serve", *flags])), name)
        clean_env.setenv(env, text)
        from_variable = getattr(Settings(), name)
        through_cli = getattr(settings_from_args(parser.parse_args(["serve"])), name)
        clean_env.delenv(env)
        assert from_flag == from_variable == through_cli, (name, text, from_flag, from_variable, through_cli)
        assert from_flag != _default(name), (name, text)
        if typing.get_origin(Settings.model_fields[name].annotation) is list or isinstance(from_flag, list):
            assert from_flag == [v.strip() for v in text.split(",")], (name, from_flag)


def test_a_flag_wins_over_a_variable_of_every_kind(clean_env):  # noqa: F811
    """Flags win over TSERVE_*: for a boolean whose flag turns it back to its default, a list, a size, a path, a
    number, a choice and an optional setting alike."""
    env = {"TSERVE_WARMUP": "false", "TSERVE_COMPILE": "true", "TSERVE_API_KEYS": "env-key",
           "TSERVE_KV_CACHE_MEMORY": "1GiB", "TSERVE_MODEL_REPOSITORY": "/env/repo", "TSERVE_MAX_QUEUE": "9",
           "TSERVE_DTYPE": "float16", "TSERVE_MAX_MODEL_LEN": "300", "TSERVE_MODELS": "env=/env/lm"}
    for key, value in env.items():
        clean_env.setenv(key, value)
    s = settings_from_args(build_parser().parse_args([
        "serve", "--warmup", "--no-compile", "--api-keys", "flag-key", "--kv-cache-memory", "0.25",
        "--model-repository", "/flag/repo", "--max-queue", "0", "--dtype", "float32", "--max-model-len", "64",
        "--model", "flag=/flag/lm"]))
    assert (s.warmup, s.compile, s.api_keys, s.kv_cache_budget, s.model_repository, s.max_queue, s.dtype,
            s.max_model_len, s.model_specs()) == (True, False, ["flag-key"], (None, 0.25), Path("/flag/repo"), 0,
                                                  "float32", 64, {"flag": Path("/flag/lm")})
    assert Settings().warmup is False and Settings().compile is True  # the variables alone still read


# ------------------------------------------------------------------------------------------------------------
# Sizes and fractions
# ------------------------------------------------------------------------------------------------------------
SIZES = [("3", 3), ("3b", 3), ("3kb", 3_000), ("3KB", 3_000), ("3k", 3_000), ("3KiB", 3 * 2**10),
         ("3mb", 3 * 10**6), ("3M", 3 * 10**6), ("3MiB", 3 * 2**20), ("3gb", 3 * 10**9), ("3GiB", 3 * 2**30),
         ("1.5g", 1_500_000_000), ("3tb", 3 * 10**12), ("3T", 3 * 10**12), ("3TiB", 3 * 2**40), (" 7 MiB ", 7 * 2**20)]


def test_every_size_unit_reads_as_documented_from_flags_and_from_the_environment(clean_env):  # noqa: F811
    """--max-model-memory and --kv-cache-memory: decimal units (kB, MB, GB, TB and their one-letter forms) are
    powers of 1000 and binary ones (KiB, MiB, GiB, TiB) powers of 1024, in any case, from either source."""
    parser = build_parser()
    for text, expected in SIZES:
        flagged = settings_from_args(parser.parse_args(["serve", "--max-model-memory", text,
                                                        "--kv-cache-memory", text]))
        clean_env.setenv("TSERVE_MAX_MODEL_MEMORY", text)
        clean_env.setenv("TSERVE_KV_CACHE_MEMORY", text)
        for settings in (flagged, Settings()):
            assert settings.max_model_memory_bytes == expected, (text, settings.max_model_memory_bytes)
            assert settings.kv_cache_budget == (expected, None), (text, settings.kv_cache_budget)


def test_a_home_directory_in_a_path_setting_is_expanded_from_flags_and_from_the_environment(
        clean_env, monkeypatch, tmp_path):  # noqa: F811
    """Environment files (compose, Kubernetes, Ray) pass `~` as it is, where a shell would expand it: every path
    setting reads it as the user's home, as `--model` paths are read, and a draft named by a repo id is left as
    it is."""
    monkeypatch.setenv("HOME", str(tmp_path))
    paths = {"models_dir": "~/models", "model_repository": "~/repository", "file_dir": "~/files",
             "translation_memory": "~/memory.sqlite", "draft_model": "~/draft"}
    for name, text in paths.items():
        monkeypatch.setenv(f"TSERVE_{name.upper()}", text)
    from_env = Settings()
    flags = [a for name, text in paths.items() if name != "draft_model" for a in (f"--{name.replace('_', '-')}", text)]
    from_flags = settings_from_args(build_parser().parse_args(["serve", *flags, "--model", "lm=~/lm"]))
    for name, text in paths.items():
        assert str(getattr(from_env, name)) == str(tmp_path / text[2:]), name
        if name != "draft_model":
            assert str(getattr(from_flags, name)) == str(tmp_path / text[2:]), name
    assert from_flags.model_specs() == {"lm": tmp_path / "lm"}
    monkeypatch.setenv("TSERVE_DRAFT_MODEL", "org/draft")
    assert Settings().draft_model == "org/draft"


@pytest.mark.parametrize(("text", "budget"), [("1.0", (None, 1.0)), ("0.25", (None, 0.25)), (".5", (None, 0.5)),
                                              ("1", (1, None))], ids=["1.0", "0.25", ".5", "1"])
def test_a_fraction_up_to_the_whole_free_memory_is_a_kv_cache_share(clean_env, text, budget):  # noqa: F811
    """--kv-cache-memory 1.0 (all the free memory: the range is (0, 1]) and .5 are fractions; 1, without a
    point, is a byte count."""
    clean_env.setenv("TSERVE_KV_CACHE_MEMORY", text)
    assert Settings().kv_cache_budget == budget
    clean_env.delenv("TSERVE_KV_CACHE_MEMORY")
    assert settings_from_args(build_parser().parse_args(["serve", "--kv-cache-memory", text])).kv_cache_budget == budget


@pytest.mark.parametrize(("name", "text"), [("kv_cache_memory", "1.5"), ("kv_cache_memory", "0.0"),
                                            ("kv_cache_memory", "8 gigs"), ("max_model_memory", "8 gigs"),
                                            ("max_model_memory", "-1GB")],
                         ids=["kv-fraction-above-one", "kv-fraction-zero", "kv-no-unit", "memory-no-unit",
                              "memory-negative"])
def test_an_invalid_size_is_refused_when_the_settings_are_read(clean_env, served, tmp_path, capsys, name, text):  # noqa: F811
    """A size or a fraction the server cannot use ends `tserve serve` at once (exit 2, the reason on stderr),
    before a server starts: not when the first model loads, nor only when one is loaded at run time. The same
    value from the environment is refused by Settings()."""
    flag = f"--{name.replace('_', '-')}"
    assert main(["serve", "--model", f"lm={tmp_path / 'lm'}", f"{flag}={text}"]) == 2
    assert not served and text.strip() in capsys.readouterr().err
    clean_env.setenv(f"TSERVE_{name.upper()}", text)
    with pytest.raises(ValueError, match=name):
        Settings()


# ------------------------------------------------------------------------------------------------------------
# A Ray Serve replica
# ------------------------------------------------------------------------------------------------------------
def test_a_ray_replica_without_a_gpu_keeps_its_builder_arguments_and_its_environment(clean_env):  # noqa: F811
    """A replica whose device is `auto` and that Ray reserved no GPU for runs on the CPU: only the device
    changes. The builder's arguments (the config file's `args:`) and the replica's TSERVE_* variables
    (`runtime_env.env_vars`) reach the app it builds as they do on a replica given a GPU."""
    pytest.importorskip("ray.serve")
    import deploy.ray_serve as ray_serve

    built: list[Settings] = []

    class Registry:
        ready, error = True, None

        def start_loading(self) -> None:
            pass

        def wait_loaded(self, timeout: float | None = None) -> None:
            pass

        def stop(self) -> None:
            pass

    def build_app(settings: Settings, load_models: bool = True) -> types.SimpleNamespace:
        built.append(settings)
        return types.SimpleNamespace(state=types.SimpleNamespace(registry=Registry()))

    class Replica(ray_serve.TServeDeployment.func_or_class):
        def __del__(self) -> None:
            pass

    gpus: list[str] = []
    context = types.SimpleNamespace(get_accelerator_ids=lambda: {"GPU": gpus})
    clean_env.setattr(ray_serve, "build_app", build_app)
    clean_env.setattr(ray_serve.ray, "get_runtime_context", lambda: context)
    clean_env.setenv("TSERVE_MAX_RUNNING_REQUESTS", "3")
    clean_env.setenv("TSERVE_PREFIX_CACHE", "off")
    args = {"models": "lm=/srv/lm", "max_queue": 5, "quantize": "int8", "kv_cache_memory": "1GiB"}
    for reserved in ([], ["0"]):
        gpus[:] = reserved
        asyncio.run(object.__new__(Replica).__init__(dict(args)))
    on_cpu, on_gpu = built
    assert on_cpu.device == "cpu" and on_gpu.device == "auto"
    assert on_cpu.model_dump(exclude={"device"}) == on_gpu.model_dump(exclude={"device"}) \
        == Settings(**args).model_dump(exclude={"device"})
    assert (on_cpu.max_running_requests, on_cpu.prefix_cache, on_cpu.max_queue, on_cpu.quantize) == (3, False, 5, "int8")
    assert on_cpu.model_specs() == {"lm": Path("/srv/lm")}


# ------------------------------------------------------------------------------------------------------------
# A model loaded at run time
# ------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def repository_app(tmp_path_factory):
    """A language model served from start-up and the same checkpoint in the model repository, with settings
    other than the defaults for what a model is built with: the math attention kernels, int8 weights, a shorter
    context, smaller KV blocks, fewer rows and a byte budget for the KV cache."""
    root = tmp_path_factory.mktemp("setting-sources")
    repository = root / "repository"
    repository.mkdir()
    (repository / "later").symlink_to(TINY_LM, target_is_directory=True)
    app = InProcessApp({"lm": TINY_LM}, gc_freeze=False, model_repository=str(repository), attention_backend="math",
                       quantize="int8", max_model_len=40, kv_block_size=8, max_running_requests=3,
                       kv_cache_memory="96KiB", prefix_cache=False, warmup=False)
    yield app
    app.stop()


def _built_with(model) -> dict:  # noqa: ANN001 - a ServedModel
    engine = model.engine
    return {"backends": sorted({m.backend for m in model.loaded.model.modules() if hasattr(m, "backend")}),
            "quantization": model.loaded.quantization, "dtype": str(model.loaded.dtype),
            "card": model.card_fields(), "rows": engine.capacity, "max_len": engine.max_len,
            "blocks": engine.runner.cache.num_blocks if hasattr(engine.runner.cache, "num_blocks") else None,
            "block_size": getattr(engine.runner.cache, "block_size", None),
            "prefix_caching": getattr(engine, "prefix_caching", None)}


def test_a_model_loaded_at_run_time_is_built_with_the_servers_settings(repository_app):
    """`POST /v2/repository/models/later/load` builds the model with the server's settings, as the model loaded
    at start-up was: its attention kernels, quantization, dtype, context, rows and KV cache are the start-up
    model's, and a greedy completion of the same prompt is the same text."""
    app = repository_app
    app.post("/v2/repository/models/later/load", {})
    startup, later = app.registry.models["lm"], app.registry.models["later"]
    want = _built_with(startup)
    assert want["backends"] == ["math"] and want["quantization"] == "int8" and want["max_len"] == 40, want
    assert _built_with(later) == want
    body = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}
    texts = [app.post("/v1/completions", body | {"model": m}).json()["choices"][0]["text"] for m in ("lm", "later")]
    assert texts[0] == texts[1]
