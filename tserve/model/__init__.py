"""The model library: pure PyTorch, no web code.

    from tserve import model
    loaded = model.load("models/gpt2-tiny", device="cpu", dtype="float32")
    from tserve.model.decoding import SamplingParams, generate
    out = generate(loaded, [loaded.tokenizer.encode("Hello")], SamplingParams(max_tokens=20, temperature=0))
"""

from tserve.model.checkpoint import CheckpointError, LoadedModel, load

__all__ = ["CheckpointError", "LoadedModel", "load"]
