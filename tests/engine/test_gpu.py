"""CUDA-only checks (`pytest -m gpu`; skipped without a GPU): CUDA-graph decode equals eager decode, the
engine on the GPU gives every request what it gets alone, and every attention backend agrees with `math`
in bfloat16 and float32. (test_flash_kernels.py runs its kernel checks on the GPU too when one is present.)"""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.helpers import factories
from tests.helpers.fixture_training import CYCLE_TEXT
from tests.helpers.kv_rows import advance_if_real_rows_equal, eager_multi_token_step, row_keys
from tests.helpers.one_request import job_tokens, lm_tokens
from tests.helpers.sampling_options import events, option_jobs
from tserve.model import checkpoint
from tserve.model.attention import math_attention, resolve_backend, sdpa_attention
from tserve.model.config import DecoderConfig
from tserve.model.cuda_graphs import BucketedDecode, DecodeAhead, default_buckets
from tserve.model.decoder import Decoder
from tserve.model.decoding import SamplingParams, Speculation, TextSequence
from tserve.service.engine import GenerationEngine
from tserve.service.metrics import Metrics

pytestmark = pytest.mark.gpu
CUDA = "cuda"


async def token_ids(engine, reqs) -> list[list[int]]:
    """Every request's streamed token ids, in submission order."""
    out = []
    for r in reqs:
        ids = []
        async for event in engine.stream(r):
            ids += event.token_ids
        out.append(ids)
    return out


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory):
    return factories.tiny_lm_dir(tmp_path_factory.mktemp("lm-gpu"))


@pytest.mark.parametrize("backend", ["sdpa", "flash"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("T,D,causal", [(1, 64, False), (77, 64, True), (300, 128, True), (513, 80, False)])
def test_backends_match_math(backend, dtype, T, D, causal):
    assert resolve_backend("auto", CUDA) == "flash-decode"  # Triton is there wherever CUDA torch is
    from tserve.model.kernels.flash import flash_attention  # noqa: PLC0415

    fn = {"sdpa": sdpa_attention, "flash": flash_attention}[backend]
    g = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(3, 4, T, D, generator=g).to(CUDA, dtype) for _ in range(3))
    out, _ = fn(q, k, v, None, causal)
    ref, _ = math_attention(q.float(), k.float(), v.float(), None, causal)
    err = float((out.float() - ref).norm() / ref.norm())
    assert err <= (1e-5 if dtype == torch.float32 else 1e-2)


GROUPED = dict(n_heads=8, n_kv_heads=2, head_dim=32, qk_norm=True, positions="rope", norm="rmsnorm",
               activation="swiglu", bias=False)  # a Qwen3-like layer: grouped-query attention


@pytest.mark.parametrize("shape", [{}, GROUPED], ids=["mha", "gqa"])
@pytest.mark.parametrize("backend", ["sdpa", "flash", "flash-decode"])
def test_cuda_graph_decode_equals_eager_decode(backend, shape):
    torch.manual_seed(0)
    cfg = DecoderConfig(**{"vocab_size": 512, "d_model": 128, "n_heads": 4, "d_ff": 512, "n_layers": 3,
                           "max_seq_len": 256} | shape)
    model = Decoder(cfg, backend=backend).to(CUDA).eval()
    n, scratch = 5, 16
    caches = [model.new_cache(scratch + 1, 256) for _ in range(2)]
    prompts = torch.randint(0, 512, (n, 30), device=CUDA)
    lengths = torch.tensor([30, 3, 17, 1, 22], device=CUDA)
    slots = torch.tensor([9, 0, 4, 15, 2], device=CUDA)
    for cache in caches:
        model.prefill(prompts, lengths, cache, slots)
    graphed = BucketedDecode(lambda t, p, s: model.decode_step(t, p, caches[1], s), pad_values=(0, 0, scratch),
                             buckets=default_buckets(scratch), device=CUDA, use_graphs=True)
    graphed.capture()
    tokens, positions = prompts[torch.arange(n), lengths - 1], lengths.clone()
    for _ in range(20):
        eager = model.decode_step(tokens, positions, caches[0], slots)
        replay = graphed(tokens, positions, slots)
        torch.testing.assert_close(replay, eager, atol=1e-4, rtol=1e-4)
        tokens, positions = eager.argmax(-1), positions + 1
    torch.testing.assert_close(row_keys(caches[1], slots), row_keys(caches[0], slots), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("device", "graphs"), [(CUDA, True), (CUDA, False), ("cuda:0", True)])
def test_engine_on_gpu_concurrent_equals_alone(lm_dir, device, graphs):
    """Also with the device index given (`--device cuda:0`): the loader and the engine thread select it."""
    lm = checkpoint.load(lm_dir, device=device, dtype="float32")
    prompts = [lm.tokenizer.encode(f"prompt {i} " + "word " * (i % 5)) for i in range(24)]
    greedy = SamplingParams(max_tokens=20, temperature=0.0)
    alone = [lm_tokens(lm, p, greedy, with_eos=False) for p in prompts]
    engine = GenerationEngine("lm", lm, max_slots=8, max_queue=64, max_model_len=None, timeout_s=60.0,
                              metrics=Metrics(), cuda_graphs=graphs)
    assert (engine.runner.graphed is not None) == graphs
    engine.start()

    async def run(params_for):
        return await token_ids(engine, [engine.submit(p, params_for(i)) for i, p in enumerate(prompts)])

    try:
        assert asyncio.run(run(lambda i: greedy)) == alone
        seeded = lambda i: SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=i)  # noqa: E731
        first, second = asyncio.run(run(seeded)), asyncio.run(run(seeded))
        assert first == second  # per-request generators on the GPU: reproducible whatever the neighbours
    finally:
        engine.stop()


@pytest.mark.parametrize("graphs", [True, False])
def test_engine_on_gpu_with_drafts_and_a_small_pool_equals_alone(lm_dir, graphs):
    """Prompt-lookup drafts (scored outside the captured decode graphs) and a block pool small enough that
    requests are preempted while drafting, on the GPU: each request gets the tokens it gets alone, and every
    block comes back."""
    lm = checkpoint.load(lm_dir, device=CUDA, dtype="float32")
    words = CYCLE_TEXT.split()
    prompts = [lm.tokenizer.encode(" ".join(words[a:a + 16] + words[a:a + 10])) for a in (0, 8, 16, 24, 36)]
    jobs = [(p, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)) for p in prompts]
    expected = [lm_tokens(lm, p, sp) for p, sp in jobs]
    cfg = lm.config
    block_bytes = 4 * 2 * cfg.n_layers * cfg.kv_heads * cfg.d_head * 4
    blocks = sum(-(-len(p) // 4) for p in prompts) + 2  # all admitted, then short of blocks as they grow
    engine = GenerationEngine("lm", lm, max_slots=len(prompts), max_queue=8, max_model_len=128, timeout_s=60.0,
                              metrics=Metrics(), cuda_graphs=graphs, kv_block_size=4,
                              kv_cache_budget=(blocks * block_bytes, None), speculation=Speculation(num_tokens=4))
    engine.start()

    async def run():
        return await token_ids(engine, [engine.submit(p, sp) for p, sp in jobs])

    try:
        assert asyncio.run(run()) == expected
    finally:
        engine.stop()
    assert engine.m.spec_accepted._value.get() > 0
    assert engine.m.preemptions._value.get() > 0
    assert engine.runner.blocks.num_in_use == 0


@pytest.mark.parametrize("shape", [{}, GROUPED], ids=["mha", "gqa"])
@pytest.mark.parametrize("backend", ["sdpa", "flash"])
def test_cuda_graph_speculative_step_equals_eager_step(backend, shape):
    """`DecodeAhead` replayed: each real row's logits at its real positions (rows padded to 5 positions, 3 rows
    to a bucket of 4) equal the unpadded eager step's, and the rows' cache positions hold the same keys."""
    torch.manual_seed(0)
    cfg = DecoderConfig(**{"vocab_size": 512, "d_model": 128, "n_heads": 4, "d_ff": 512, "n_layers": 3,
                           "max_seq_len": 256} | shape)
    model = Decoder(cfg, backend=backend).to(CUDA).eval()
    scratch = 4
    caches = [model.new_cache(scratch, 256) for _ in range(2)]
    prompts = torch.randint(0, 512, (3, 30), device=CUDA)
    lengths, rows = torch.tensor([30, 3, 17], device=CUDA), [3, 0, 2]
    for cache in caches:
        model.prefill(prompts, lengths, cache, torch.tensor(rows, device=CUDA))
    graphed = DecodeAhead(model, caches[1], width=5, max_rows=scratch, max_positions=256, use_graphs=True)
    graphed.capture()
    computed, next_tokens = lengths.tolist(), prompts[torch.arange(3), lengths - 1].tolist()
    g = torch.Generator().manual_seed(1)
    for _ in range(12):
        fed = [[t, *torch.randint(0, 512, (int(torch.randint(0, 5, (), generator=g)),), generator=g).tolist()]
               for t in next_tokens]
        eager = eager_multi_token_step(model, fed, computed, caches[0], rows, CUDA)
        computed, next_tokens = advance_if_real_rows_equal(graphed(fed, computed, rows), eager, fed, computed, 1e-4)
    for r, n in zip(rows, computed, strict=True):
        keys = [row_keys(cache, torch.tensor([r], device=CUDA))[:, :, :n] for cache in caches]
        torch.testing.assert_close(keys[1], keys[0], atol=1e-5, rtol=1e-5)


class CountedCalls:
    """Counts the calls of a graphed step (its replays), passing everything through."""

    def __init__(self, inner) -> None:  # noqa: ANN001
        self.inner, self.calls = inner, 0

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.inner, name)

    def __call__(self, *inputs):  # noqa: ANN002, ANN204
        self.calls += 1
        return self.inner(*inputs)


@pytest.mark.parametrize("drafts", ["ngram", "draft-model"])
def test_speculative_requests_with_graphs_equal_them_without(lm_dir, drafts):
    """Greedy requests drafting (prompt lookup, or a draft model: the target's weights with noise) with CUDA graphs
    (the speculative steps, and the draft model's own, replayed) give the tokens they give without graphs."""
    lm = checkpoint.load(lm_dir, device=CUDA, dtype="float32")
    draft = None
    if drafts == "draft-model":
        draft = checkpoint.load(lm_dir, device=CUDA, dtype="float32")
        g = torch.Generator(device=CUDA).manual_seed(0)
        with torch.no_grad():
            for p in draft.model.parameters():
                p.add_(torch.randn(p.shape, generator=g, device=CUDA) * p.std() * 0.3)
    words = CYCLE_TEXT.split()
    prompts = [lm.tokenizer.encode(" ".join(words[a:a + 12] + words[a + 20:a + 26] + words[a:a + 6]))
               for a in (0, 7, 19, 30, 41)]
    jobs = [(p, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)) for p in prompts]
    outputs, counted = [], {}
    for graphs in (True, False):
        engine = GenerationEngine("lm", lm, max_slots=3, max_queue=8, max_model_len=128, timeout_s=60.0,
                                  metrics=Metrics(), cuda_graphs=graphs, speculation=Speculation(num_tokens=4),
                                  draft=draft)
        runner = engine.runner
        assert (runner.graphed_ahead is not None) == graphs
        if graphs:
            runner.graphed_ahead = counted["ahead"] = CountedCalls(runner.graphed_ahead)
            if draft is not None:
                runner.drafter.graphed = counted["draft"] = CountedCalls(runner.drafter.graphed)
        engine.start()

        async def run(engine=engine):  # noqa: ANN001
            return await token_ids(engine, [engine.submit(p, sp) for p, sp in jobs])

        try:
            outputs.append(asyncio.run(run()))
        finally:
            engine.stop()
        assert engine.m.spec_accepted._value.get() > 0
    assert outputs[0] == outputs[1]
    assert all(c.calls > 0 for c in counted.values()), {k: c.calls for k, c in counted.items()}


@pytest.mark.parametrize("graphs", [True, False])
def test_translation_engine_on_gpu_equals_one_at_a_time(tmp_path, graphs):
    from tserve.service.engine import TranslationEngine

    mt = checkpoint.load(factories.tiny_mt_dir(tmp_path / "mt"), device=CUDA, dtype="float32")
    engine = TranslationEngine("mt", mt, max_rows=16, max_queue=64, timeout_s=60.0, metrics=Metrics(),
                               cuda_graphs=graphs)
    assert (engine.runner.graphed is not None) == graphs
    texts = ["hello world", "good morning to you", "the house is small", "where is the station"] * 3
    jobs = [engine.translator.job(t, num_beams=(1, 2, 4)[i % 3], max_tokens=12) for i, t in enumerate(texts)]
    alone = [job_tokens(mt, j) for j in jobs]
    engine.start()

    async def run():
        return await token_ids(engine, [engine.submit(j) for j in jobs])

    try:
        assert asyncio.run(run()) == alone
    finally:
        engine.stop()


@pytest.mark.parametrize("backend", ["sdpa", "flash"])
def test_vit_on_gpu_matches_cpu(tmp_path, backend):
    d = factories.tiny_vit_dir(tmp_path / "vit")
    cpu = checkpoint.load(d, device="cpu", dtype="float32")
    gpu = checkpoint.load(d, device=CUDA, dtype="bfloat16", backend=backend)
    x = torch.randn(64, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ref = cpu.model(x)
        out = gpu.model(x.to(CUDA, torch.bfloat16)).float().cpu()
    assert float((out - ref).norm() / ref.norm()) <= 2e-2
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.95


def test_t5_on_flash_equals_math(tmp_path):
    """T5's self-attention carries a position bias the Triton kernels do not take: those layers run on SDPA,
    cross-attention on the kernels, and the translations are `math`'s (float32)."""
    from tserve.model.decoding import translate  # noqa: PLC0415

    d = factories.hf_t5_dir(tmp_path / "t5")
    flash = checkpoint.load(d, device=CUDA, dtype="float32", backend="flash")
    math = checkpoint.load(d, device=CUDA, dtype="float32", backend="math")
    tok = flash.tokenizer
    sources = [tok.encode_with_language(t, "<2de>") for t in ("the quick brown fox", "good morning where is the station")]
    for beams in (1, 4):
        assert [s.output_ids for s in translate(flash, sources, beams, 16)] == \
            [s.output_ids for s in translate(math, sources, beams, 16)]


@pytest.mark.parametrize("graphs", [True, False])
def test_async_engine_on_gpu_streams_what_the_synchronous_engine_streams(lm_dir, graphs):
    """Every sampling and stopping option (grammars too where llguidance is installed), 18 or more rows in a batch
    of 8, on the GPU where each step runs beside the host: the overlapped engine's events are the synchronous one's,
    and its steps were launched with the step before unread."""
    from tserve.model.decoding import structured  # noqa: PLC0415 - whether grammars can run here

    lm = checkpoint.load(lm_dir, device=CUDA, dtype="float32")

    def engine(mode: str) -> GenerationEngine:
        e = GenerationEngine("lm", lm, max_slots=8, max_queue=64, max_model_len=128, timeout_s=60.0,
                             metrics=Metrics(), cuda_graphs=graphs, kv_block_size=4, async_scheduling=mode)
        e.start()
        return e

    sync, overlapped = engine("off"), engine("on")
    jobs = option_jobs(lm, sync, grammars=structured.llguidance is not None)
    launched_unread = []
    decode = overlapped.runner.decode

    def counted(seqs):  # noqa: ANN001, ANN202
        launched_unread.append(bool(overlapped._in_flight))
        return decode(seqs)

    overlapped.runner.decode = counted
    assert events(overlapped, jobs) == events(sync, jobs)
    assert any(launched_unread)
    assert overlapped.runner.blocks.num_in_use == 0


@pytest.mark.parametrize("graphs", [True, False])
def test_an_overlapped_decode_step_never_waits_for_the_device(lm_dir, graphs):
    """Launching a decode step fed from the last step's tokens on the device, with sampled, seeded, filtered,
    biased and logprob rows and a row growing into a new block, makes no synchronizing CUDA call (PyTorch's sync
    debug mode raises on one): the host is free to do the last step's work while it runs."""
    lm = checkpoint.load(lm_dir, device=CUDA, dtype="float32")
    engine = GenerationEngine("lm", lm, max_slots=8, max_queue=8, max_model_len=128, timeout_s=60.0,
                              metrics=Metrics(), cuda_graphs=graphs, kv_block_size=4, async_scheduling="on")
    runner = engine.runner
    eos = lm.tokenizer.eos_id
    params = [SamplingParams(max_tokens=40, temperature=0.0), SamplingParams(max_tokens=40, temperature=0.9, seed=1),
              SamplingParams(max_tokens=40, temperature=1.1, top_k=5, top_p=0.8, seed=2, logprobs=3),
              SamplingParams(max_tokens=40, temperature=0.0, min_tokens=30, logit_bias={eos: 5.0})]
    seqs = [TextSequence(lm.tokenizer.encode(f"{i} {CYCLE_TEXT[9 * i:9 * i + 30]}"), sp, runner.device)
            for i, sp in enumerate(params)]
    for s in seqs:
        assert runner.admit(s)
    chosen = runner.choose_later(seqs, runner.prefill(seqs))
    for _ in range(6):  # past a block boundary for every row (blocks of 4)
        torch.cuda.set_sync_debug_mode("error")
        try:
            for s in seqs:
                assert runner.grow(s)
            later = runner.choose_later(seqs, runner.decode(seqs))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        runner.resolve(chosen)
        chosen = later
    tokens, logprobs = runner.resolve(chosen)
    assert len(tokens) == len(seqs) and logprobs is not None
    for s in seqs:
        runner.release(s)
