"""Config helpers of the Hugging Face importers: activation names, field checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tserve.model.importers.base import CheckpointError

_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu",
                "swish": "silu", "silu": "silu"}


def activation(raw: dict[str, Any], key: str, default: str, path: Path) -> str:
    name = raw.get(key, default)
    if name not in _ACTIVATIONS:
        raise CheckpointError(f"{path / 'config.json'}: {key} {name!r} is not supported "
                              f"(supported: {', '.join(sorted(_ACTIVATIONS))})")
    return _ACTIVATIONS[name]


def unsupported(path: Path, key: str, value: Any, why: str) -> CheckpointError:
    """The error for a config field whose value we do not implement; it names the field."""
    return CheckpointError(f"{path / 'config.json'}: {key} = {value!r} is not supported ({why})")
