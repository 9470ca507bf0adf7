"""Work done on request threads (image decoding and preprocessing) must start no OpenMP thread pool there: a
live thread that holds one makes every parallel region of the model's worker thread wake its helpers the slow
way (measured: ViT-S/16 at batch 1 took 43 ms per image in the server instead of 33). The check counts the
process's threads while a fresh thread that did the work is still alive."""

from __future__ import annotations

import io
import os
import threading

import numpy as np
import pytest
import torch
from PIL import Image

from tserve.model.preprocessing import ImagePreprocessing


def _threads() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def _extra_threads_while_alive(work) -> int:  # noqa: ANN001 - a callable
    """How many threads the process gains while a thread that ran `work` is alive (its OpenMP helpers): threads that
    were not there before, whatever other threads (an earlier test's server or engine) end meanwhile."""
    done, release = threading.Event(), threading.Event()

    def run() -> None:
        work()
        done.set()
        release.wait()

    t = threading.Thread(target=run)
    before = _threads()
    t.start()
    done.wait()
    gained = len(_threads() - before) - 1  # the thread itself
    release.set()
    t.join()
    return gained


needs_threads = pytest.mark.skipif(not os.path.isdir("/proc/self/task") or (os.cpu_count() or 1) < 2,
                                   reason="needs /proc and at least two cores")


@pytest.fixture(autouse=True)
def two_torch_threads():
    """Two torch threads, as a server has on two cores (a pytest-xdist worker runs with one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@needs_threads
def test_the_check_sees_a_pool_when_a_thread_runs_a_parallel_torch_op():
    x = torch.randn(3, 224, 224)
    assert _extra_threads_while_alive(lambda: (x * 2.0 + 1.0).sum()) >= 1


@needs_threads
@pytest.mark.parametrize("mode", ["RGB", "L"])
def test_image_preprocessing_starts_no_thread_pool(mode):
    pre = ImagePreprocessing(224, 3 if mode == "RGB" else 1, (0.5,) * 3 if mode == "RGB" else (0.5,),
                             (0.25,) * 3 if mode == "RGB" else (0.25,))
    rng = np.random.default_rng(0)
    shape = (300, 260, 3) if mode == "RGB" else (300, 260)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode).save(buf, "PNG")
    image = Image.open(io.BytesIO(buf.getvalue()))
    out = []
    assert _extra_threads_while_alive(lambda: out.append(pre(image))) == 0
    # And it computes what it did in torch: (pixel / 255 - mean) / std, channels first.
    pixels = torch.from_numpy(np.asarray(pre.to_image(image), dtype=np.float32)) / 255.0
    pixels = pixels[None] if pixels.ndim == 2 else pixels.permute(2, 0, 1)
    want = (pixels - torch.tensor(pre.mean)[:, None, None]) / torch.tensor(pre.std)[:, None, None]
    assert out[0].dtype == torch.float32 and out[0].shape == want.shape
    torch.testing.assert_close(out[0], want, rtol=0, atol=1e-6)
