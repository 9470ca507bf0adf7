"""What every importer shares: the checkpoint error, generation defaults, and the weights of a directory read
one tensor at a time (one `model.safetensors`, or shards named by `model.safetensors.index.json`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open


class CheckpointError(ValueError):
    """A checkpoint directory is missing, unsupported or corrupt; the message names the file."""


@dataclass
class GenerationDefaults:
    """Decoding defaults a checkpoint ships with (Marian's generation_config.json, for instance)."""

    num_beams: int = 1
    max_new_tokens: int = 128
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    banned_token_ids: list[int] = field(default_factory=list)
    force_eos_at_max: bool = False
    # Language models: every id that ends a sequence (generation_config.json's eos_token_id, a list or one id);
    # empty: the tokenizer's eos.
    eos_token_ids: list[int] = field(default_factory=list)
    # Translators: the cross-attention heads that align target tokens to source tokens (tserve/model/alignment.py).
    alignment_heads: list[list[int]] = field(default_factory=list)  # [[decoder layer, head], ...]
    alignment_offset: int = 0

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GenerationDefaults:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def read_json(file: Path, required: bool = True) -> Any:
    if not file.is_file():
        if required:
            raise CheckpointError(f"{file}: missing")
        return None
    try:
        return json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file}: not valid JSON ({exc})") from exc


def hf_generation(path: Path, raw: dict[str, Any]) -> dict[str, Any]:
    """Hugging Face decoding settings: config.json's, overridden by generation_config.json's (newer)."""
    return dict(raw) | (read_json(path / "generation_config.json", required=False) or {})


def eos_ids(value: Any) -> list[int]:
    """generation_config.json's eos_token_id: one id, a list of ids, or absent."""
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


class WeightSource:
    """The tensors of a checkpoint directory, loaded one at a time when asked for (in their stored dtype):
    `model.safetensors`, or the shards `model.safetensors.index.json`'s `weight_map` names. Pickled weights
    (`*.bin`, `*.pt`) are never read."""

    def __init__(self, directory: Path) -> None:
        files = self.files(directory)
        self.file = files[0] if len(files) == 1 else directory / "model.safetensors.index.json"
        self._handles: dict[Path, Any] = {}
        self._where: dict[str, tuple[Path, str]] = {}
        for file in files:
            try:
                handle = self._handles[file] = safe_open(str(file), framework="pt")
            except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
                raise CheckpointError(f"{file}: corrupt or unreadable safetensors file ({exc})") from exc
            for name in handle.keys():  # noqa: SIM118 (a safe_open handle is not a mapping)
                self._where[name] = (file, name)

    @classmethod
    def files(cls, directory: Path) -> list[Path]:
        """The checkpoint's safetensors files: `model.safetensors`, or the shards its index names (checked)."""
        single, index = directory / "model.safetensors", directory / "model.safetensors.index.json"
        if single.is_file():
            return [single]
        if index.is_file():
            return cls._shards(directory, index)
        pickled = sorted(p.name for p in [*directory.glob("*.bin"), *directory.glob("*.pt")])
        hint = f" ({', '.join(pickled)} found: pickled weights are not loaded; convert them to safetensors)" \
            if pickled else ""
        raise CheckpointError(f"{single}: missing{hint}")

    @staticmethod
    def _shards(directory: Path, index: Path) -> list[Path]:
        weight_map = (read_json(index) or {}).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: no weight_map")
        files = []
        for name in sorted(set(weight_map.values())):
            # The index comes with the download: a shard is a plain file name in this directory, nothing else.
            if not isinstance(name, str) or Path(name).name != name or not name.endswith(".safetensors"):
                raise CheckpointError(f"{index}: shard {name!r} is not a .safetensors file in this directory")
            if not (directory / name).is_file():
                raise CheckpointError(f"{directory / name}: missing shard named by {index.name}")
            files.append(directory / name)
        return files

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __getitem__(self, name: str) -> torch.Tensor:
        """One tensor; KeyError (which the loader reports with the file) when the checkpoint lacks it."""
        file, stored = self._where[name]
        try:
            return self._handles[file].get_tensor(stored)
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise CheckpointError(f"{file}: corrupt tensor {stored!r} ({exc})") from exc

    def get(self, name: str) -> torch.Tensor | None:
        return self[name] if name in self else None

    def strip_prefix(self, prefix: str) -> WeightSource:
        """Names without a leading `prefix` (`transformer.`, `model.`, `vit.`) where the checkpoint has one."""
        if any(n.startswith(prefix) for n in self._where):
            self._where = {(n[len(prefix):] if n.startswith(prefix) else n): w for n, w in self._where.items()}
        return self
