"""`tserve` command line: `serve` (the HTTP server), plus `train` / `eval` from the `training` package.

Every server setting is a flag of `tserve serve` and a `TSERVE_*` environment variable; flags win.
The flags are generated from `service.settings.Settings`, so the two can never drift apart.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic.fields import FieldInfo

from tserve.service.settings import Settings

_STD_ATTRS = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and every `extra=` field."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {"time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"), "level": record.levelname,
                                 "logger": record.name, "message": record.getMessage()}
        entry.update({k: v for k, v in vars(record).items() if k not in _STD_ATTRS})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


def configure_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    logging.getLogger("uvicorn.access").disabled = True  # our middleware logs each request


def _flag_type(field: FieldInfo) -> dict[str, Any]:
    annotation = field.annotation
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        annotation = args[0]
    if typing.get_origin(annotation) is typing.Literal:
        values = typing.get_args(annotation)
        return {"choices": list(values), "type": type(values[0])}  # Literal[32, 64]: "64" read as 64
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(annotation) is list:  # comma-separated, as in the environment
        return {"type": str, "metavar": "A,B,..."}
    return {"type": annotation}


def add_settings_flags(parser: argparse.ArgumentParser) -> None:
    for name, field in Settings.model_fields.items():
        if name == "models":
            parser.add_argument("--model", dest="models", action="append", metavar="NAME=PATH",
                                help="serve the checkpoint at PATH as NAME (repeatable; default: the bundled "
                                     "models). PATH: a tserve checkpoint or a Hugging Face GPT-2/Marian/ViT/"
                                     "Llama/Mistral/Qwen2/Qwen3 directory, or a Hugging Face repo id "
                                     "ORG/NAME[@REVISION] (downloaded into the Hugging Face cache; safetensors "
                                     "only). Env: TSERVE_MODELS=a=/x,b=org/y@main")
            continue
        env = f"TSERVE_{name.upper()}"
        default = field.default if field.default_factory is None else field.default_factory()
        text = (field.description or "").rstrip(".")
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, default=None, **_flag_type(field),
                            help=f"{text + '; ' if text else ''}default {default!r}; env {env}")


def settings_from_args(args: argparse.Namespace) -> Settings:
    given = {name: getattr(args, name) for name in Settings.model_fields if getattr(args, name, None) is not None}
    return Settings(**given)


def serve(args: argparse.Namespace) -> int:
    import uvicorn  # noqa: PLC0415 - only the server needs it

    from tserve.service.app import build_app  # noqa: PLC0415

    try:
        settings = settings_from_args(args)
        specs = settings.model_specs()
    except ValueError as exc:
        print(f"tserve: {exc}", file=sys.stderr)
        return 2
    if not specs and settings.model_repository is None:
        print("tserve: no models to serve: the bundled models are not in models/ (train them with "
              "`tserve train ...`) and no --model NAME=PATH was given", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    app = build_app(settings)
    from tserve.service.shutdown import DrainingServer  # noqa: PLC0415

    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_config=None,
                            log_level=settings.log_level, timeout_graceful_shutdown=math.ceil(settings.request_timeout_s),
                            timeout_keep_alive=settings.keep_alive_s)
    # uvicorn raises a signal it handled again once it has shut down, with the handler found at start-up
    # restored. A no-op handler makes that a clean exit 0 instead of death by signal.
    signal.signal(signal.SIGTERM, lambda *_: None)
    registry = app.state.registry
    server = DrainingServer(config, registry, settings.request_timeout_s)
    registry.on_load_failure = lambda: server.handle_exit(signal.SIGTERM, None)
    server.run()
    if registry.error is not None:
        print(f"tserve: models failed to load: {registry.error}", file=sys.stderr)
        return 1
    return 0


def models_command(args: argparse.Namespace) -> int:
    import httpx  # noqa: PLC0415

    if args.action != "list" and not args.name:
        print(f"tserve models {args.action}: give the model's name", file=sys.stderr)
        return 2
    headers = {"Authorization": f"Bearer {args.key}"} if args.key else {}
    base = args.url.rstrip("/") + "/v2/repository"
    if args.action == "list":
        url, body = f"{base}/index", {}
    else:
        from urllib.parse import quote  # noqa: PLC0415

        url = f"{base}/models/{quote(args.name, safe='')}/{args.action}"
        # a path as this shell means it (`~`, relative to here), for a server on this machine
        body = {"parameters": {"path": str(Path(args.path).expanduser().resolve())}} if args.path else {}
    try:
        resp = httpx.post(url, json=body, headers=headers, timeout=None)
    except httpx.HTTPError as exc:
        print(f"tserve models: {args.url} did not answer ({exc})", file=sys.stderr)
        return 1
    if resp.status_code != 200:
        try:
            message = resp.json().get("error", resp.text)
        except (ValueError, AttributeError):  # not JSON, or not an object
            message = resp.text
        print(f"tserve models {args.action}: {resp.status_code} {message}", file=sys.stderr)
        return 1
    if args.action == "list":
        for m in resp.json():
            print(f"{m['name']}\t{m['state']}\t{m['reason']}".rstrip())
    else:
        print(f"{args.name}\t{resp.json()['state']}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tserve", description="Transformer inference server.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser = sub.add_parser("serve", help="start the HTTP server")
    add_settings_flags(serve_parser)
    serve_parser.set_defaults(func=serve)
    models = sub.add_parser("models", help="list, load or unload a running server's models (its repository API)",
                            description="The model repository API of a running `tserve serve` (/v2/repository).")
    models.add_argument("action", choices=("list", "load", "unload"))
    models.add_argument("name", nargs="?", help="the model (load, unload)")
    models.add_argument("--path", default=None, help="load: a checkpoint directory on this machine (the server needs "
                                                     "--allow-load-paths); default: NAME in its --model-repository")
    models.add_argument("--url", default=os.environ.get("TSERVE_URL", "http://127.0.0.1:8000"),
                        help="the server (default $TSERVE_URL or http://127.0.0.1:8000)")
    models.add_argument("--key", default=os.environ.get("TSERVE_ADMIN_KEY"),
                        help="an admin key (default $TSERVE_ADMIN_KEY)")
    models.set_defaults(func=models_command)
    from tserve.training.cli import register  # noqa: PLC0415 - keeps `serve` start-up light

    register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
