"""The architectures people bring, each on a tiny random-weight model made by tests/arch_models.py
(Llama 3 rope factors with linear scaling, YaRN, qwen3, gemma2, phi3, and the mixtures of experts
qwen3moe, Mixtral-style llama and olmoe), against llama.cpp's logits on
the same file (tests/fixtures/llamacpp_arch_<name>.npz, tests/tools/make_arch_fixtures.py) on every
kernel path (AVX-512 also through the SIMDe build), and layer by layer against the numpy reference
(tests/reference.py). Then the machinery every model gets: the KV cache one token at a time, the f16
and f32 caches, the R16 repack (phi3's fused tensors as slices of one repacked matrix) and
speculative decoding."""
from __future__ import annotations

import numpy as np
import pytest

from engine.model import MATMUL_FIELDS, Model
from engine.params import SamplingParams
from engine.speculative import MAX_DRAFT
from tests import arch_models as A
from tests import reference as R
from tests.conftest import SIMDE_PATH

PATHS = ["scalar", "avx2", "avx512", SIMDE_PATH]


@pytest.fixture(scope="module", params=A.ARCH_NAMES)
def arch(request, smollm2_path):
    """(name, model path, llama.cpp's fixture)."""
    path = A.arch_model(request.param, smollm2_path)
    return request.param, path, A.arch_fixture(request.param, path)


@pytest.fixture(scope="module", autouse=True)
def _one_blas_thread():
    with R.blas_threads(1):
        yield


@pytest.fixture
def on_path(request, monkeypatch):
    """on_path(name): the following Model.loads run on that kernel path (SIMDE_PATH: the SIMDe
    build's AVX-512 kernels, the R16 repack made as the product's AVX2 path makes it)."""
    from engine.kernels import _kernels

    before = _kernels.kernel_path()

    def switch(path: str) -> None:
        product = "avx2" if path == SIMDE_PATH else path
        if path == SIMDE_PATH:
            simde = request.getfixturevalue("kernels_simde")
            simde.set_path("avx512")
            monkeypatch.setattr(_kernels, "ForwardModel", simde.ForwardModel)
        try:
            _kernels.set_path(product)
        except ValueError:
            pytest.skip(f"this CPU cannot run the {product} path")

    yield switch
    _kernels.set_path(before)


def load(path, **kw) -> Model:
    kw.setdefault("threads", 1)
    kw.setdefault("kv_budget", "8MiB")
    return Model.load(str(path), **kw)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def check_against_llamacpp(logits: np.ndarray, fx: dict) -> tuple[float, float]:
    ours = logits[:, fx["vocab_ids"]]
    cos = cosines(ours, fx["logits"])
    top1 = float((logits.argmax(-1) == fx["top1"]).mean())
    assert cos.min() >= 0.999, f"cosine to llama.cpp {cos.min():.5f} at position {int(cos.argmin())}"
    assert top1 >= 0.9, f"same top-1 as llama.cpp at {top1:.0%} of positions"
    return float(cos.min()), top1


@pytest.mark.parametrize("path", PATHS)
def test_logits_match_llamacpp_on_every_path(arch, path, on_path):
    name, model_path, fx = arch
    on_path(path)
    model = load(model_path)
    assert model.capacity > fx["n_ctx"] or name != "phi3"  # both take LongRoPE's long factors
    check_against_llamacpp(model.forward_all(fx["ids"]), fx)


def test_simd_paths_give_the_same_logits(arch, on_path):
    """AVX2, AVX-512 and AVX-512 through SIMDe: bit for bit (the new ops included)."""
    _, model_path, fx = arch
    got = {}
    for path in ("avx2", "avx512", SIMDE_PATH):
        on_path(path)
        got[path] = load(model_path).forward_all(fx["ids"])
    np.testing.assert_array_equal(got["avx512"], got["avx2"])
    np.testing.assert_array_equal(got[SIMDE_PATH], got["avx2"])


def test_every_layer_matches_the_reference(arch):
    _, model_path, fx = arch
    ids = [int(t) for t in fx["ids"]]
    model = load(model_path)
    ours_layers, ours = model.forward_layers(ids)
    ref_layers, theirs = R.ReferenceModel(model_path, n_ctx=model.capacity).forward_layers(ids)
    for layer, (a, b) in enumerate(zip(ours_layers, ref_layers)):
        rel = float(np.linalg.norm(a - b) / np.linalg.norm(b))
        assert rel <= 0.05, f"layer {layer}: relative L2 {rel:.4f}"
    assert cosines(ours, theirs).min() >= 0.999


def test_one_token_at_a_time_equals_the_batch_on_both_caches(arch):
    """The KV cache (gemma2's sliding rings, 8 positions here, wrap) gives the batch's logits bit for
    bit; the f32 cache stays as close to llama.cpp as the f16 default."""
    _, model_path, fx = arch
    ids = [int(t) for t in fx["ids"]]
    for kv_type in ("f16", "f32"):
        batch = load(model_path, kv_type=kv_type).forward_all(ids)
        model = load(model_path, kv_type=kv_type)
        model.forward(ids[:5], 0)
        for i in range(5, len(ids)):
            np.testing.assert_array_equal(model.forward([ids[i]], i), batch[i], err_msg=f"{kv_type} position {i}")
        check_against_llamacpp(batch, fx)


def test_every_matmul_runs_on_the_repacked_layout(arch, on_path):
    """The R16 cache covers the new tensors too; phi3's q|k|v and gate|up are slices of one repacked
    matrix each, and the GGUF layout gives the same logits."""
    name, model_path, fx = arch
    on_path("avx2")
    repacked = load(model_path)
    assert repacked.repacked is not None
    in_cache = {t.name for t in repacked.repacked.plan.tensors}  # the K-quant matrices (R16 skips F16)
    on_r16 = set()
    for il, (layer, sources) in enumerate(zip(repacked.weights.layers, repacked.weights.sources)):
        for field in MATMUL_FIELDS:
            if field in sources and sources[field][0] in in_cache:
                assert len(layer[field]) == 5 and layer[field][4], (name, il, field)
                on_r16.add((il, field))
    assert on_r16
    if name == "phi3":  # layer 1's attn_qkv is Q4_K, layer 0's gate|up Q6_K
        assert {(1, "wq"), (1, "wk"), (1, "wv"), (0, "ffn_gate"), (0, "ffn_up")} <= on_r16
    if name in A.MOE_NAMES:  # the last layer's expert stacks (Q4_K gate, Q6_K down), expert by expert
        assert {(1, "ffn_gate_exps"), (1, "ffn_down_exps")} <= on_r16
    plain = load(model_path, repack=False)
    np.testing.assert_array_equal(repacked.forward_all(fx["ids"]), plain.forward_all(fx["ids"]))


def test_speculative_greedy_is_plain_greedy(arch):
    """Prompt lookup and a draft model (the same file: its guesses are mostly kept, and checked in
    multi-token passes) give plain greedy's tokens."""
    from engine.engine import Engine

    _, model_path, fx = arch
    eng = Engine(str(model_path), threads=1, kv_budget="8MiB", draft=str(model_path))
    # Each pass costs its size: guesses are made whenever they can be, so they are checked and rolled back.
    eng.set_speculation_costs([0.0] + [1.0] * (MAX_DRAFT + 1), 1e-3)
    prompt = [int(t) for t in fx["ids"][:24]] * 2  # repeated text: prompt lookup finds guesses
    plain = eng.generate(prompt_ids=prompt, params=SamplingParams(max_tokens=24, speculative="off"))
    for mode in ("prompt_lookup", "draft"):
        spec = eng.generate(prompt_ids=prompt, params=SamplingParams(max_tokens=24, speculative=mode))
        assert spec.ids == plain.ids, mode
    assert spec.draft_tokens > 0


@pytest.mark.parametrize("name", ["qwen3moe", "mixtral"])
def test_experts_run_prompts_in_passes_of_moe_ubatch(name, smollm2_path):
    """A mixture of experts runs MOE_UBATCH tokens a pass (its experts then see more tokens each); a
    prompt longer than that gives the logits of any other split into passes, bit for bit."""
    from engine.model import MAX_UBATCH, MOE_UBATCH

    path = A.arch_model(name, smollm2_path)
    model = load(path, kv_budget="64MiB")
    assert model.cfg.ubatch == MOE_UBATCH > MAX_UBATCH
    assert load(A.arch_model("qwen3", smollm2_path)).cfg.ubatch == MAX_UBATCH
    rng = np.random.default_rng(9)
    ids = [int(t) for t in rng.integers(10, model.cfg.n_vocab, size=MOE_UBATCH + 40)]
    whole = model.forward_all(ids)   # passes of 512 and 40
    split = load(path, kv_budget="64MiB")
    split.forward(ids[:100], 0)
    last = split.forward(ids[100:], 100)   # passes of 100, 452
    np.testing.assert_array_equal(last, whole[-1])
    assert np.isfinite(whole).all()
