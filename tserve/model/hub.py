"""Hugging Face repo ids as checkpoints: `--model qwen=Qwen/Qwen2.5-0.5B-Instruct@main` serves the repo's
snapshot, as `vllm serve` does; `--model qwen=Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q8_0` (or `:FILE.gguf`) one GGUF
file of it, as llama.cpp's `-hf` does.

`resolve` downloads the snapshot into the standard Hugging Face cache (or finds it there) with
`huggingface_hub.snapshot_download`, which also reads HF_HOME / HF_HUB_CACHE, HF_TOKEN, HF_HUB_OFFLINE and
HF_ENDPOINT. Only weights in safetensors, JSON and tokenizer files are fetched: pickled weights can run code
when loaded, and `model.checkpoint.load` never reads them anyway. The hub's errors become `CheckpointError`s
that say what to do.
"""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path

from huggingface_hub import constants, hf_hub_download, snapshot_download
from huggingface_hub.utils import (
    EntryNotFoundError,
    GatedRepoError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from tserve.model.importers import CheckpointError

log = logging.getLogger(__name__)

ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.spm", "tokenizer*"]
# Pickled and foreign-framework weights, refused even where a name matches ALLOW_PATTERNS ("tokenizer.bin").
IGNORE_PATTERNS = ["*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl", "*.msgpack", "*.h5"]

_REPO_ID = re.compile(r"(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*)(?:@(?P<revision>[^\s:]+))?"
                      r"(?::(?P<gguf>[A-Za-z0-9][A-Za-z0-9._/-]*))?")


def is_repo_id(value: str) -> bool:
    """`ORG/NAME` or `ORG/NAME@REVISION` (a branch, tag or commit hash), either with `:FILE.gguf` or `:QUANT`
    (one GGUF file of the repo, as llama.cpp's `-hf` takes it)."""
    return _REPO_ID.fullmatch(value) is not None


def checkpoint_dir(spec: str | Path) -> Path:
    """The directory or file `spec` names where one exists (a local path wins over a repo id of the same
    name), else the snapshot (or the GGUF file) of the repo id it is; anything else unchanged, for the loader
    to report."""
    path = Path(spec)
    if path.exists() or not is_repo_id(str(spec)):
        return path
    return resolve(str(spec))


def resolve(value: str) -> Path:
    """The local snapshot directory of the repo `value` names (`ORG/NAME[@REVISION]`, default revision
    main), downloaded first unless the cache already holds it."""
    m = _REPO_ID.fullmatch(value)
    if m is None:
        raise CheckpointError(f"{value!r} is not a Hugging Face repo id (ORG/NAME[@REVISION])")
    repo_id, revision = m["repo"], m["revision"] or "main"
    log.info("downloading model", extra={"repo": repo_id, "revision": revision, "gguf": m["gguf"]})
    start = time.perf_counter()
    try:
        if m["gguf"]:
            return gguf_file(repo_id, revision, m["gguf"])
        path = Path(snapshot_download(repo_id, revision=revision, allow_patterns=ALLOW_PATTERNS,
                                      ignore_patterns=IGNORE_PATTERNS))
    except GatedRepoError as exc:  # before RepositoryNotFoundError, its base class
        raise CheckpointError(f"{repo_id}: the Hugging Face repo is gated: accept its licence on the hub, then "
                              f"set HF_TOKEN to a token of that account") from exc
    except RepositoryNotFoundError as exc:
        raise CheckpointError(f"{value}: not a local directory, and the Hugging Face repo {repo_id} was not "
                              f"found or is private (for a private repo, set HF_TOKEN)") from exc
    except RevisionNotFoundError as exc:
        raise CheckpointError(f"{repo_id}: revision {revision!r} not found on the Hugging Face hub") from exc
    except LocalEntryNotFoundError as exc:
        if constants.HF_HUB_OFFLINE:
            raise CheckpointError(f"{repo_id} (revision {revision!r}) is not in the Hugging Face cache at "
                                  f"{constants.HF_HUB_CACHE} (HF_HOME / HF_HUB_CACHE) and offline mode is on "
                                  f"(HF_HUB_OFFLINE=1)") from exc
        raise CheckpointError(f"{repo_id}: the Hugging Face hub ({constants.ENDPOINT}) could not be reached and "
                              f"the cache at {constants.HF_HUB_CACHE} does not hold revision {revision!r}: "
                              f"{exc.__cause__ or exc}") from exc
    except EntryNotFoundError as exc:
        raise CheckpointError(f"{repo_id}: no file {m['gguf']!r} in the Hugging Face repo (revision "
                              f"{revision!r})") from exc
    except OSError as exc:  # the hub's other HTTP errors, broken connections mid-download, a full disk
        raise CheckpointError(f"{repo_id}: download from the Hugging Face hub failed: {exc}") from exc
    files = [p for p in path.rglob("*") if p.is_file()]
    log.info("model downloaded", extra={"repo": repo_id, "revision": revision, "path": str(path),
                                        "seconds": round(time.perf_counter() - start, 3), "files": len(files),
                                        "bytes": sum(p.stat().st_size for p in files)})
    return path


def gguf_file(repo_id: str, revision: str, wanted: str) -> Path:
    """One GGUF file of a repo: `wanted` is its name (`model-Q4_K_M.gguf`), or a quantization's name (`Q4_K_M`,
    any case) that exactly one .gguf file of the repo has in its name, as llama.cpp's `-hf` takes it. Only that
    file is fetched (or found in the cache). Split files (`-00001-of-00003.gguf`) and projectors (`mmproj`)
    are not checkpoints of ours."""
    if wanted.lower().endswith(".gguf"):
        return Path(hf_hub_download(repo_id, wanted, revision=revision))
    quant = wanted.lower()
    patterns = [f"*{q}*.gguf" for q in {wanted, quant, wanted.upper()}]
    snapshot = Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
    found = sorted(p for p in snapshot.rglob("*.gguf")
                   if quant in p.name.lower() and "mmproj" not in p.name.lower())
    if len(found) != 1 or re.search(r"-\d{5}-of-\d{5}\.gguf$", found[0].name):
        names = [str(p.relative_to(snapshot)) for p in found]
        raise CheckpointError(f"{repo_id}: {len(found)} GGUF files of the repo name {wanted!r} "
                              f"({', '.join(names) or 'none'}); name one: {repo_id}:FILE.gguf"
                              + (" (split files are not read: merge them with llama-gguf-split)" if found else ""))
    return found[0]
