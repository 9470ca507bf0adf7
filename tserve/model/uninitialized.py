"""Building a model whose weights are about to be read from a checkpoint, without drawing random ones first.

`nn.Linear`, `nn.Embedding` and our models' `_init_weights` fill every new parameter from `torch.nn.init`:
random numbers that loading then overwrites. On a CPU that was two thirds of loading a small checkpoint (0.22 of
0.33 s for the bundled translator, whose weights are read in 0.05 s). Inside `uninitialized_weights()` the
initializers of `torch.nn.init` leave their tensor as it is, on this thread only: a model built for training or a
test in another thread at the same time (a server loads models beside serving) still draws its own. Every
parameter of a model built so must then be filled (`checkpoint.fill_weights` refuses a checkpoint that leaves
one out); buffers computed in a constructor (RoPE tables) are computed as always.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator

from torch.nn import init

# The initializers the library's layers and ours call; each is looked up in `torch.nn.init` when it is called.
INITIALIZERS = ("uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
                "xavier_normal_", "zeros_", "ones_", "constant_")

_skipping = threading.local()
_installed = threading.Lock()


def _unless_skipping(initializer: Callable) -> Callable:
    @functools.wraps(initializer)
    def initialize(tensor, *args, **kwargs):
        if getattr(_skipping, "active", False):
            return tensor
        return initializer(tensor, *args, **kwargs)

    initialize.tserve_wrapped = True
    return initialize


def _install() -> None:
    with _installed:
        for name in INITIALIZERS:
            current = getattr(init, name)
            if not getattr(current, "tserve_wrapped", False):
                setattr(init, name, _unless_skipping(current))


@contextlib.contextmanager
def uninitialized_weights() -> Iterator[None]:
    """Parameters created on this thread inside the block keep whatever their memory held."""
    _install()
    before = getattr(_skipping, "active", False)
    _skipping.active = True
    try:
        yield
    finally:
        _skipping.active = before
