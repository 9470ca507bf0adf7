"""Importing tserve turns on PyTorch's huge pages for large tensors (`THP_MEM_ALLOC_ENABLE`, tserve/__init__.py):
a step's large temporaries (an output layer's logits) are new memory every step, and faulting them in 4 KiB at a
time took half of NLLB's output layer's time. The check reads the kernel's own account of a 64 MiB tensor's
mapping (`AnonHugePages` in /proc/self/smaps) in a fresh interpreter (the allocator reads the variable once)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

_PROBE = """
import os
import tserve, torch
t = torch.empty(64 << 20, dtype=torch.uint8).fill_(1)  # touched: its pages exist
inside = False
for line in open("/proc/self/smaps"):
    head = line.split()[0]
    if "-" in head and not head.endswith(":"):
        low, high = (int(x, 16) for x in head.split("-"))
        inside = low <= t.data_ptr() < high
    elif inside and head == "AnonHugePages:":
        print(os.environ.get("THP_MEM_ALLOC_ENABLE"), int(line.split()[1]))
        break
"""


def _kernel_thp_mode() -> str:
    """The kernel's transparent-huge-page mode: always, madvise or never (the bracketed word)."""
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    found = re.search(r"\[(\w+)\]", path.read_text()) if path.exists() else None
    return found.group(1) if found else "never"


def _probe(setting: str | None) -> tuple[str, int]:
    """(THP_MEM_ALLOC_ENABLE as the child sees it after importing tserve, KiB of its 64 MiB tensor in huge pages)."""
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if setting is not None:
        env["THP_MEM_ALLOC_ENABLE"] = setting
    done = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    value, kib = done.stdout.split()
    return value, int(kib)


@pytest.mark.parametrize("setting", [None, "0"])
def test_large_tensors_go_in_huge_pages_unless_the_environment_says_no(setting: str | None) -> None:
    value, huge_kib = _probe(setting)
    assert value == (setting or "1")  # the environment's own value wins
    mode = _kernel_thp_mode()
    if setting is None and mode != "never":  # asked for (madvise), or given to every mapping (always)
        assert huge_kib >= 32 << 10, f"{huge_kib} KiB of 64 MiB in huge pages (kernel THP mode {mode})"
    if setting == "0" and mode == "madvise":  # not asked for: none
        assert huge_kib == 0
