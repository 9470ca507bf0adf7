"""The GPU benchmark script runs end to end (small shapes on CPU), so that it is ready for a GPU machine."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu.py"


@pytest.mark.slow
def test_gpu_benchmark_runs_on_tiny_shapes(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_gpu", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "rows.json"
    rows = bench.main(["--tiny", "--device", "cpu", "--out", str(out)])
    assert json.loads(out.read_text()) == rows
    what = {(r["section"], r["what"]) for r in rows}
    assert {("lm", "decode step, batch 1"), ("lm", "1 requests at once"), ("lm", "4 requests at once"),
            ("translation", "4 sentences, 1 beam"), ("translation", "4 sentences, 4 beams"),
            ("vit", "batch 1"), ("vit", "batch 8")} <= what
    for r in rows:
        assert r["tserve"] > 0 and r["baseline_value"] > 0
        # The speed-up is >1 when tserve is faster: a ratio of rates, or the inverse ratio of times.
        faster = r["tserve"] / r["baseline_value"] if r["unit"].endswith("/s") else r["baseline_value"] / r["tserve"]
        assert r["speedup"] == pytest.approx(faster), r
    table = capsys.readouterr().out
    assert "| section | what | baseline | tserve | unit | speed-up |" in table
    assert "kernels | skipped" in table
