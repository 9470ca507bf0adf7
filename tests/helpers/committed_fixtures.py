"""The trained test fixtures, committed under tests/fixtures/ and copied into each test's directory.

Training a fixture in the test process made its weights follow that machine's kernels: a fixture trained
on a CPU with AVX-512 learnt other near-ties than one trained on an AVX2-only CPU, and a test that passed on
one failed on the other. The weights are therefore trained once, by the recipes in `factories.RECIPES`,
and committed (float32 safetensors with the tokenizer files they were trained with, a few hundred KB
each): every machine tests the same numbers, and no test process trains a fixture.

    python -m tests.helpers.committed_fixtures            # retrain every fixture and overwrite its files
    python -m tests.helpers.committed_fixtures tiny-lm    # one of them

`tests/training/test_fixture_recipes.py` runs the recipes again and checks that what they yield still
behaves as the tests need; the tests that compare exact words check the committed files' margins
(`fixture_training.assert_greedy_margins`)."""

from __future__ import annotations

import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

from tests.helpers.factories import RECIPES
from tests.helpers.fixture_files import FIXTURES_DIR, PROVENANCE


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def regenerate(names: list[str]) -> None:
    """Run each fixture's recipe in a scratch directory and replace the committed files with its output."""
    import torch

    unknown = sorted(set(names) - set(RECIPES))
    if unknown:
        raise SystemExit(f"unknown fixtures {unknown}; known: {sorted(RECIPES)}")
    torch.set_num_threads(2)
    for name in names or list(RECIPES):
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            built = RECIPES[name](Path(tmp) / name)
            target = FIXTURES_DIR / name
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(built, target)
        (target / PROVENANCE).write_text(json.dumps({
            "recipe": f"tests.helpers.factories.RECIPES[{name!r}]", "torch": torch.__version__,
            "cpu": _cpu_name(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        }, indent=2) + "\n")
        size = sum(f.stat().st_size for f in target.iterdir())
        print(f"{name}: {size / 1024:.0f} KB in {time.perf_counter() - t0:.0f} s -> {target}", flush=True)


if __name__ == "__main__":
    regenerate(sys.argv[1:])
