import numpy as np
import pytest
import torch

from pdserve.request import SamplingParams
from pdserve.runner.sampler import Sampler, SamplingMetadata

CPU = torch.device("cpu")


def make_md(params: list[SamplingParams], vocab_size: int, seeds: dict[int, int] | None = None):
    gens = {row: torch.Generator().manual_seed(seed) for row, seed in (seeds or {}).items()}
    return SamplingMetadata.from_params(params, gens, vocab_size, CPU)


def sample(logits: torch.Tensor, params: list[SamplingParams], seed: int = 0, seeds=None):
    md = make_md(params, logits.shape[-1], seeds)
    return Sampler(torch.Generator().manual_seed(seed))(logits, md)


def repeat_row(probs: list[float], n: int) -> torch.Tensor:
    return torch.tensor(probs).log().expand(n, -1).contiguous()


def sampled_set(out) -> set[int]:
    return set(out.token_ids.tolist())


def test_from_params_leaves_unused_options_none():
    md = make_md([SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, top_k=5, top_p=0.5)], 10)
    assert md.all_greedy
    assert md.top_k is None and md.top_p is None and md.min_p is None
    assert md.max_num_logprobs is None
    assert md.temperature.tolist() == [0.0, 0.0]

    md = make_md([SamplingParams(temperature=0.5), SamplingParams(top_k=-1), SamplingParams(top_k=100)], 10)
    assert not md.all_greedy
    assert md.top_k is None and md.top_p is None and md.min_p is None

    md = make_md(
        [
            SamplingParams(temperature=0.0, logprobs=2),
            SamplingParams(top_k=3, logprobs=5),
            SamplingParams(top_p=0.9, min_p=0.1),
            SamplingParams(temperature=1e-9),
        ],
        10,
    )
    assert not md.all_greedy
    assert md.top_k.tolist() == [10, 3, 10, 10] and md.top_k.dtype == torch.int64
    assert md.top_p.tolist() == pytest.approx([1.0, 1.0, 0.9, 1.0])
    assert md.min_p.tolist() == pytest.approx([0.0, 0.0, 0.1, 0.0])
    assert md.temperature.tolist() == [0.0, 1.0, 1.0, 0.0]  # a vanishing temperature is greedy
    assert md.max_num_logprobs == 5


def test_greedy_is_argmax():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(1))
    out = sample(logits, [SamplingParams(temperature=0.0)] * 8)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.token_ids.dtype == torch.int64
    assert out.logprobs is None and out.logprob_token_ids is None


def test_top_k_one_is_greedy():
    logits = torch.randn(64, 100, generator=torch.Generator().manual_seed(2))
    out = sample(logits, [SamplingParams(temperature=1.5, top_k=1)] * 64)
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_top_k_stays_in_top_k():
    k, n = 5, 4000
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(3)).expand(n, -1)
    out = sample(logits, [SamplingParams(temperature=2.0, top_k=k)] * n)
    assert sampled_set(out) == set(logits[0].topk(k).indices.tolist())


@pytest.mark.parametrize(
    "top_p, expected",
    [(0.3, {2}), (0.6, {2, 0}), (0.75, {2, 0, 4}), (0.9, {2, 0, 4, 1}), (1.0, {0, 1, 2, 3, 4})],
)
def test_top_p_keeps_smallest_set_reaching_p(top_p, expected):
    # Probabilities by rank: 0.4, 0.3, 0.15, 0.1, 0.05 (cumulative 0.4, 0.7, 0.85, 0.95, 1.0).
    logits = repeat_row([0.3, 0.1, 0.4, 0.05, 0.15], 4000)
    out = sample(logits, [SamplingParams(top_p=top_p)] * 4000)
    assert sampled_set(out) == expected


def test_top_p_applies_after_top_k():
    # top_k=3 leaves 0.4, 0.3, 0.15, renormalised to 0.47, 0.35, 0.18: the top two already reach 0.8,
    # whereas top_p=0.8 on the full distribution (0.4 + 0.3 = 0.7) would need the third.
    logits = repeat_row([0.3, 0.1, 0.4, 0.05, 0.15], 4000)
    out = sample(logits, [SamplingParams(top_k=3, top_p=0.8)] * 4000)
    assert sampled_set(out) == {2, 0}


@pytest.mark.parametrize("min_p, expected", [(0.25, {0, 1, 2}), (0.35, {0, 1}), (0.05, {0, 1, 2, 3, 4})])
def test_min_p_drops_tokens_below_fraction_of_max(min_p, expected):
    logits = repeat_row([0.5, 0.2, 0.15, 0.1, 0.05], 4000)
    out = sample(logits, [SamplingParams(min_p=min_p)] * 4000)
    assert sampled_set(out) == expected


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_matches_tempered_softmax(temperature):
    n = 20000
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.5, 2.0])
    out = sample(logits.expand(n, -1), [SamplingParams(temperature=temperature)] * n, seed=7)
    counts = torch.bincount(out.token_ids, minlength=logits.numel()).double()
    expected = torch.softmax(logits.double() / temperature, -1) * n
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 25.0  # 5 degrees of freedom: p ~ 1e-4 under the right law; a wrong law is far off


def seeded_tokens(position: int, others: list[SamplingParams], steps: int = 30) -> list[int]:
    """Tokens a seed-1234 row draws over `steps` steps, placed at `position` among `others`."""
    target = torch.randn(1000, generator=torch.Generator().manual_seed(4))
    params = list(others)
    params.insert(position, SamplingParams(temperature=0.8, top_p=0.95, seed=1234))
    gens = {position: torch.Generator().manual_seed(1234)}
    md = SamplingMetadata.from_params(params, gens, 1000, CPU)
    sampler = Sampler(torch.Generator().manual_seed(len(others)))
    noise = torch.Generator().manual_seed(99 + position)
    tokens = []
    for _ in range(steps):
        logits = torch.randn(len(params), 1000, generator=noise)
        logits[position] = target
        tokens.append(sampler(logits, md).token_ids[position].item())
    return tokens


def test_seeded_row_independent_of_batch():
    alone = seeded_tokens(0, [])
    assert len(set(alone)) > 5  # really random, not stuck on one token
    assert seeded_tokens(1, [SamplingParams(), SamplingParams(temperature=0.0)]) == alone
    assert seeded_tokens(3, [SamplingParams(top_k=4)] * 3 + [SamplingParams(seed=5)]) == alone


def test_different_seeds_differ():
    logits = torch.zeros(2, 1000)
    params = [SamplingParams(seed=1), SamplingParams(seed=2)]
    md = make_md(params, 1000, {0: 1, 1: 2})
    sampler = Sampler()
    draws = torch.stack([sampler(logits, md).token_ids for _ in range(10)])
    assert not torch.equal(draws[:, 0], draws[:, 1])


def test_engine_generator_makes_runs_reproducible():
    logits = torch.randn(16, 200, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(temperature=1.0)] * 16
    first = sample(logits, params, seed=11).token_ids
    assert torch.equal(sample(logits, params, seed=11).token_ids, first)
    assert not torch.equal(sample(logits, params, seed=12).token_ids, first)


def test_logprobs_are_raw_log_softmax():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(6))
    params = [
        SamplingParams(temperature=0.0, logprobs=1),
        SamplingParams(temperature=0.3, logprobs=3),
        SamplingParams(temperature=2.0, top_k=5, logprobs=0),
        SamplingParams(temperature=1.0),
    ]
    out = sample(logits, params)
    raw = torch.log_softmax(logits, -1)
    top = raw.topk(3, dim=-1)
    assert out.logprobs.shape == (4, 4) and out.logprobs.dtype == torch.float32
    assert out.logprob_token_ids.shape == (4, 4) and out.logprob_token_ids.dtype == torch.int64
    assert torch.equal(out.logprob_token_ids[:, 0], out.token_ids)
    torch.testing.assert_close(out.logprobs[:, 0], raw.gather(-1, out.token_ids[:, None]).squeeze(-1))
    assert torch.equal(out.logprob_token_ids[:, 1:], top.indices)
    torch.testing.assert_close(out.logprobs[:, 1:], top.values)


def test_mixed_batch():
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(8))
    logits[3, 17] = 10.0
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, top_k=3),
        SamplingParams(temperature=0.7, top_p=0.5, seed=42),
        SamplingParams(temperature=1.0, min_p=0.9),
        SamplingParams(temperature=0.0, top_k=2, seed=7),
    ]
    out = sample(logits, params, seeds={2: 42, 4: 7})
    assert out.token_ids.shape == (5,)
    ids = out.token_ids.tolist()
    argmax = logits.argmax(-1).tolist()
    assert ids[0] == argmax[0] and ids[4] == argmax[4]
    assert ids[1] in logits[1].topk(3).indices.tolist()
    assert ids[3] == 17  # min_p=0.9 of a peaked random row leaves only its top token
    again = sample(logits, params, seed=123, seeds={2: 42, 4: 7})
    assert again.token_ids[2] == out.token_ids[2]


def test_bfloat16_logits():
    logits = torch.randn(6, 128, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    params = [SamplingParams(temperature=0.0)] * 3 + [SamplingParams(top_k=10, top_p=0.9, logprobs=2)] * 3
    out = sample(logits, params)
    assert out.token_ids.dtype == torch.int64
    assert torch.equal(out.token_ids[:3], logits.float().argmax(-1)[:3])
    assert out.logprobs.dtype == torch.float32
    assert torch.isfinite(out.logprobs).all()
    for row in range(3, 6):
        assert out.token_ids[row].item() in logits[row].float().topk(10).indices.tolist()


def test_masked_vocab_never_sampled():
    # -inf logits (padding past the real vocabulary) must stay unreachable, also under top-p and min-p.
    logits = torch.randn(2000, 64, generator=torch.Generator().manual_seed(10))
    logits[:, 40:] = float("-inf")
    params = [SamplingParams(temperature=3.0, top_p=0.99, min_p=0.001)] * 1000 + [SamplingParams()] * 1000
    out = sample(logits, params)
    assert out.token_ids.max().item() < 40


def test_greedy_is_argmax_on_ties_and_nans():
    from pdserve.runner.kernels import greedy

    g = torch.Generator().manual_seed(0)
    for trial in range(100):
        x = torch.randint(0, 3, (5, 300), generator=g).float()  # many equal maxima per row
        if trial % 3 == 1:
            x[:, 7::11] = float("nan")
        if trial % 3 == 2:
            x[1] = float("-inf")
        assert torch.equal(greedy(x), x.argmax(dim=-1)), trial
        assert torch.equal(greedy(x.bfloat16()), x.bfloat16().argmax(dim=-1)), trial


def test_all_greedy_bfloat16_batch_matches_float32():
    """An all-greedy batch without logprobs takes the argmax of bf16 logits as they are (the runner no
    longer widens them): the same ids as widening first, on ties, NaNs and -inf rows too."""
    g = torch.Generator().manual_seed(1)
    greedy_params = [SamplingParams(temperature=0.0)] * 5
    for trial in range(30):
        x = torch.randint(0, 4, (5, 300), generator=g).to(torch.bfloat16)
        if trial % 3 == 1:
            x[:, 5::13] = float("nan")
        if trial % 3 == 2:
            x[2] = float("-inf")
        out = sample(x, greedy_params)
        assert out.logprobs is None
        assert torch.equal(out.token_ids, sample(x.float(), greedy_params).token_ids), trial
        assert torch.equal(out.token_ids, x.float().argmax(dim=-1)), trial


# ---- penalties and logit bias ---------------------------------------------------------------------------


def penalised_by_hand(
    logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int], stop_ids: tuple[int, ...] = ()
) -> torch.Tensor:
    """vLLM's min_tokens, penalties and OpenAI's bias, one token at a time: the independent reference."""
    row = logits.clone()
    if len(output) < p.min_tokens:
        for t in stop_ids:
            row[t] = float("-inf")
    for t, b in (p.logit_bias or {}).items():
        row[t] += b
    for t in set(prompt) | set(output):
        row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
    for t in set(output):
        row[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return row


def test_penalties_equal_a_token_by_token_reference():
    g = torch.Generator().manual_seed(3)
    vocab = 40
    logits = torch.randn(5, vocab, generator=g) * 3
    params = [
        SamplingParams(temperature=0, repetition_penalty=1.4, frequency_penalty=0.7, presence_penalty=-0.3),
        SamplingParams(temperature=0),  # no penalty, in the same batch
        SamplingParams(temperature=0.8, frequency_penalty=1.5, logit_bias={0: 4.0, 39: -100.0}),
        SamplingParams(temperature=0, repetition_penalty=0.6),  # < 1 favours tokens already seen
        SamplingParams(temperature=0, presence_penalty=2.0, logit_bias={7: 0.5}),
    ]
    histories = [([1, 2, 3], (3, 3, 9, 1)), None, ([5], (0, 0, 0, 39)), ([6, 7], (8,)), ([], (7, 7, 11))]
    md = SamplingMetadata.from_params(params, {}, vocab, CPU, histories)
    assert md.penalties is not None
    got = md.penalties.apply_(logits.clone())
    for i, (p, h) in enumerate(zip(params, histories)):
        prompt, output = h or ([], ())
        want = penalised_by_hand(logits[i], p, list(prompt), list(output))
        torch.testing.assert_close(got[i], want, rtol=0, atol=1e-6)
    assert torch.equal(got[1], logits[1])
    assert not torch.equal(got[0], logits[0])


def test_repetition_penalty_equals_transformers():
    transformers = pytest.importorskip("transformers")
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 30, generator=g) * 2
    seqs = [[4, 5, 6, 4, 20], [1, 29, 0]]
    params = [SamplingParams(temperature=0, repetition_penalty=1.3)] * 2
    md = SamplingMetadata.from_params(params, {}, 30, CPU, [(s[:2], tuple(s[2:])) for s in seqs])
    assert md.penalties is not None
    hf = transformers.RepetitionPenaltyLogitsProcessor(1.3)
    for i, s in enumerate(seqs):
        want = hf(torch.tensor([s]), logits[i : i + 1].clone())[0]
        torch.testing.assert_close(md.penalties.apply_(logits.clone())[i], want)


def test_penalties_change_greedy_and_random_choices():
    logits = torch.tensor([[5.0, 4.0, 0.0, -1.0]]).expand(4, -1).contiguous()
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, frequency_penalty=1.0),  # token 0 seen twice: 5 - 2 < 4
        SamplingParams(temperature=0, logit_bias={3: 10.0}),
        SamplingParams(temperature=1.0, logit_bias={0: -100.0, 1: -100.0}),  # only 2 and 3 can be drawn
    ]
    histories = [None, ([], (0, 0)), ([], ()), ([], ())]
    md = SamplingMetadata.from_params(params, {}, 4, CPU, histories)
    given = logits.clone()
    assert Sampler(torch.Generator().manual_seed(0))(logits, md).token_ids[:3].tolist() == [0, 1, 3]
    assert torch.equal(logits, given)  # float32 logits are penalised in a copy
    drawn = {Sampler(torch.Generator().manual_seed(s))(logits, md).token_ids[3].item() for s in range(200)}
    assert drawn == {2, 3}


def test_logprobs_stay_those_of_the_raw_model_with_penalties():
    logits = torch.randn(1, 12, generator=torch.Generator().manual_seed(5))
    p = SamplingParams(temperature=0, logprobs=3, logit_bias={int(logits[0].argmin()): 100.0})
    md = SamplingMetadata.from_params([p], {}, 12, CPU, [([], ())])
    out = Sampler()(logits, md)
    assert out.token_ids.item() == int(logits[0].argmin())  # the bias picked it
    assert out.logprobs is not None
    torch.testing.assert_close(out.logprobs[0, 0], torch.log_softmax(logits[0], -1).min())


def test_no_penalties_no_penalty_work():
    md = SamplingMetadata.from_params([SamplingParams(temperature=0), SamplingParams()], {}, 8, CPU, [None, None])
    assert md.penalties is None
    md = SamplingMetadata.from_params([SamplingParams(temperature=0, logit_bias={1: 1.0})], {}, 8, CPU, [([], ())])
    assert md.penalties is not None and md.penalties.repetition is None and md.penalties.subtract is None


def test_min_tokens_bans_the_stop_ids_until_reached():
    logits = torch.zeros(3, 6)
    logits[:, 2] = 5.0  # the stop id is everyone's favourite
    p = SamplingParams(temperature=0, min_tokens=2, max_tokens=4, frequency_penalty=0.1)
    histories = [([1], (), (2, 4)), ([1], (3,), (2, 4)), ([1], (3, 3), (2, 4))]  # 0, 1, 2 output tokens
    md = SamplingMetadata.from_params([p] * 3, {}, 6, CPU, histories)
    assert md.penalties is not None
    got = md.penalties.apply_(logits.clone())
    for i, (prompt, output, stop) in enumerate(histories):
        torch.testing.assert_close(got[i], penalised_by_hand(logits[i], p, prompt, list(output), stop))
    assert got[:2, [2, 4]].isneginf().all() and got[2, 2] == 5.0
    assert Sampler()(logits, md).token_ids.tolist() == [0, 0, 2]


@pytest.mark.parametrize(
    "kw",
    [
        dict(min_tokens=5, max_tokens=4),
        dict(min_tokens=-1),
        dict(presence_penalty=2.5),
        dict(frequency_penalty=float("nan")),
        dict(frequency_penalty=True),
        dict(repetition_penalty=0.0),
        dict(repetition_penalty=float("inf")),
        dict(logit_bias={-1: 1.0}),
        dict(logit_bias={"5": 1.0}),
        dict(logit_bias={5: 101.0}),
        dict(logit_bias={5: float("nan")}),
        dict(logit_bias={i: 1.0 for i in range(1025)}),
    ],
)
def test_bad_penalties_are_refused(kw):
    from pdserve.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError):
        SamplingParams(**kw)


def test_logit_bias_outside_the_vocabulary_is_refused():
    from pdserve.errors import InvalidRequestError

    p = SamplingParams(logit_bias={95: 1.0})
    p.check_vocab(96)
    with pytest.raises(InvalidRequestError, match=r"\[0, 96\)"):
        SamplingParams(logit_bias={96: 1.0}).check_vocab(96)


# ---- structured outputs: the grammar rows' allowed-token masks ---------------------------------------


def pack(allowed: list[int], vocab_size: int) -> bytes:
    """llguidance's layout: 32-bit little-endian words, token t at bit t % 32 of word t // 32."""
    words = [0] * ((vocab_size + 31) // 32)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return b"".join(w.to_bytes(4, "little") for w in words)


def test_token_masks_read_the_packed_bits():
    from pdserve.runner.kernels import TokenMasks

    v = 70
    got = TokenMasks.from_rows([None, pack([0, 31, 32, 33, 69], v), None, pack([5], v)[:4]], v, torch.device("cpu"))
    assert got is not None
    assert got.rows.tolist() == [1, 3]
    assert got.packed.shape == (2, 3) and got.packed.dtype == torch.int32
    bias = got.bias(v)
    assert bias.shape == (2, v) and bias.dtype == torch.float32
    assert set(bias.unique().tolist()) == {0.0, float("-inf")}
    mask = bias == 0
    assert mask[0].nonzero().flatten().tolist() == [0, 31, 32, 33, 69]
    assert mask[1].nonzero().flatten().tolist() == [5]  # past a short mask's end: not allowed
    assert TokenMasks.from_rows([None, None], v, torch.device("cpu")) is None


def cpp_kernels(isa: str):
    """The C++ sampling kernels in one instruction set, or a skip where this build lacks it."""
    from pdserve.runner.kernels import SamplingKernels, load_kernels

    ext = load_kernels()
    if ext is None or isa not in ext.isas():
        pytest.skip(f"no {isa} sampling kernels here (they need a C++ compiler and a CPU with {isa})")
    return SamplingKernels(ext, isa, isa, isa)


@pytest.fixture(params=["torch", "avx512", "avx2"])
def sampling_kernels(request):
    from pdserve.runner.kernels import SamplingKernels

    return SamplingKernels(None) if request.param == "torch" else cpp_kernels(request.param)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("logprobs", [None, 2])
def test_grammar_rows_take_only_allowed_tokens(dtype, temperature, logprobs, sampling_kernels):
    """Greedy rows take the best allowed token, random rows draw only allowed ones, on the all-greedy
    fast path and the general one; other rows and the logprobs are untouched."""
    v = 300
    logits = torch.randn(4, v, generator=torch.Generator().manual_seed(3)).to(dtype)
    before = logits.clone()
    allowed = [5, 77, 150, 299]
    params = [SamplingParams(temperature=temperature, logprobs=logprobs, seed=s) for s in range(4)]
    md = SamplingMetadata.from_params(
        params, {}, v, torch.device("cpu"), allowed=[pack(allowed, v), None, pack([9], v), None]
    )
    plain = Sampler(torch.Generator().manual_seed(0))(logits, SamplingMetadata.from_params(params, {}, v, torch.device("cpu")))
    for _ in range(20 if temperature else 1):
        out = Sampler(torch.Generator().manual_seed(_), sampling_kernels)(logits, md)
        ids = out.token_ids.tolist()
        assert ids[0] in allowed and ids[2] == 9
        if temperature == 0.0:
            assert ids[0] == max(allowed, key=lambda t: float(logits[0, t]))
            assert ids[1] == plain.token_ids[1] and ids[3] == plain.token_ids[3]
    assert torch.equal(logits, before)  # never modified
    if logprobs is not None:
        raw = torch.log_softmax(logits.float(), dim=-1)
        assert out.logprobs is not None and out.logprob_token_ids is not None
        assert float(out.logprobs[0, 0]) == pytest.approx(float(raw[0, ids[0]]), abs=1e-5)
        assert out.logprob_token_ids[0, 1:].tolist() == raw[0].topk(2).indices.tolist()


def test_verify_masks_the_grammar_rows(sampling_kernels):
    v = 50
    logits = torch.randn(3, v, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(temperature=0)] * 3
    md = SamplingMetadata.from_params(params, {}, v, torch.device("cpu"), allowed=[None, pack([7, 8], v), None])
    tokens, _ = Sampler(kernels=sampling_kernels).verify(logits, md, [0, 0, 0], [], {})
    assert tokens[1] == [max((7, 8), key=lambda t: float(logits[1, t]))]
    assert tokens[0] == [int(logits[0].argmax())] and tokens[2] == [int(logits[2].argmax())]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_batch_all_under_grammars_takes_the_best_allowed_tokens(dtype, sampling_kernels):
    v = 100
    logits = torch.randn(3, v, generator=torch.Generator().manual_seed(5)).to(dtype)
    before = logits.clone()
    allowed = [[1, 2, 3], [50], list(range(0, 100, 7))]
    md = SamplingMetadata.from_params([SamplingParams(temperature=0)] * 3, {}, v, CPU, allowed=[pack(a, v) for a in allowed])
    ids = Sampler(kernels=sampling_kernels)(logits, md).token_ids.tolist()
    assert ids == [max(a, key=lambda t: float(logits[i, t])) for i, a in enumerate(allowed)]
    assert torch.equal(logits, before)


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("v", [7, 16, 31, 100, 1000, 49_157])
def test_sampling_kernels_equal_torchs_ops(isa, dtype, v):
    """The C++ kernels against torch's ops: random and sparse masks, ties, NaN, an empty mask, vocabularies
    that are no multiple of 8, 16 or 32, rows in any order."""
    from pdserve.runner.kernels import SamplingKernels, TokenMasks

    cpp = cpp_kernels(isa)
    g = torch.Generator().manual_seed(v)
    n = 9
    logits = torch.randn(n, v, generator=g).to(dtype)
    logits[2, : v // 2] = 1.0  # ties: the first allowed one wins
    logits[5, v // 3] = float("nan")
    allowed = [
        torch.randint(0, v, (v // 2,), generator=g).tolist(),
        [v - 1],
        list(range(v)),
        list(range(v // 3, v, 5)),
        [],  # nothing allowed: index 0, as torch's max over -inf
        list(range(v)),  # a NaN among the allowed
        [0, v - 1],
        torch.randint(0, v, (3,), generator=g).tolist(),
    ]
    rows = [7, 0, 2, 3, 8, 5, 1, 4]
    masks = TokenMasks(torch.tensor(rows), torch.tensor(
        [list(np.frombuffer(pack(a, v), dtype=np.int32)) for a in allowed], dtype=torch.int32))
    ref = SamplingKernels(None)
    assert cpp.argmax(logits, masks).tolist() == ref.argmax(logits, masks).tolist()
    # greedy without masks: torch's max(dim=-1).indices on ties (row 2), a NaN (row 5), an all -inf row
    # (index 0) and an all -inf row but its last token (the tail chunk)
    logits[2, v // 2 :] = logits[2, v // 2 :].clamp(max=0.5)  # the tie at 1.0 is the row's max
    logits[6] = float("-inf")
    logits[7] = float("-inf")
    logits[7, v - 1] = -1e30
    assert cpp.greedy(logits).tolist() == ref.greedy(logits).tolist() == logits.float().max(dim=-1).indices.tolist()
    assert cpp.greedy(logits)[[2, 5, 6, 7]].tolist() == [0, v // 3, 0, v - 1]
    a, b = logits.float(), logits.float()
    cpp.apply_(a, masks)
    ref.apply_(b, masks)
    assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("v", [7, 50, 1000])
def test_temperature_draws_follow_the_tempered_softmax(sampling_kernels, dtype, v):
    """Each kernel's inverse-CDF draw: for u on a fine grid, the share of u landing on each token is its
    probability (the draw is a step function of u), and u -> token is monotone; masked (-inf) tokens are
    never drawn."""
    g = torch.Generator().manual_seed(v)
    row = (torch.randn(v, generator=g) * 3).to(dtype)
    row[v // 2] = float("-inf")
    n = 4000
    for temperature in (0.5, 1.0, 2.0):
        u = (torch.arange(n, dtype=torch.float32) + 0.5) / n
        logits = row.expand(n, v).contiguous()
        ids = sampling_kernels.draw(logits, torch.full((n,), temperature), u)
        assert (ids[1:] >= ids[:-1]).all()
        want = torch.softmax(row.float() / temperature, dim=-1)
        got = torch.bincount(ids, minlength=v).float() / n
        assert got[v // 2] == 0
        assert (got - want).abs().max() < 2.0 / n + 1e-4


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_draw_kernel_edge_rows(isa):
    """NaN: the first NaN; all -inf: token 0; u near 1 never runs past the last possible token, in the
    first block of tokens or a later one (the kernels sum blocks of 256 / 128 tokens, then open one);
    equal logits split exactly (integer sums): u = 0.5 of 700 tokens is token 350, in the second block."""
    k = cpp_kernels(isa)
    v = 700
    logits = torch.zeros(5, v)
    logits[0, 5] = float("nan")
    logits[1] = float("-inf")
    logits[2, 30:] = float("-inf")
    logits[3, 400:] = float("-inf")
    ids = k.draw(logits, torch.ones(5), torch.tensor([0.3, 0.3, 1.0 - 1e-7, 1.0 - 1e-7, 0.5])).tolist()
    assert ids == [5, 0, 29, 399, 350]


def test_the_kernel_choice_never_takes_a_kernel_that_disagrees_with_torch():
    """A kernel that answers wrongly is not used however fast it is; the real build's choice is one of its
    own instruction sets or torch's ops, per op."""
    from pdserve.runner.kernels import choose_sampling_kernels, load_kernels

    class Wrong:
        def isas(self) -> list[str]:
            return ["avx2"]

        def masked_argmax(self, logits, rows, packed, isa):
            return torch.full((len(rows),), 3)

        def argmax(self, logits, isa):
            return torch.full((logits.shape[0],), 3)

        def sample_temperature(self, logits, temperature, u, isa):
            return torch.full((logits.shape[0],), 3)

    k = choose_sampling_kernels(1000, torch.float32, CPU, ext=Wrong())
    assert k.masks_isa is None and k.draws_isa is None and k.greedy_isa is None
    assert k.name == "greedy torch, masks torch, temperature draws torch"
    ext = load_kernels()
    if ext is not None:
        k = choose_sampling_kernels(1000, torch.bfloat16, CPU, rows=8)
        assert k.masks_isa in (None, *ext.isas()) and k.draws_isa in (None, *ext.isas())
        assert k.greedy_isa in (None, *ext.isas())


def test_sampling_kernels_refuse_an_instruction_set_the_build_lacks():
    from pdserve.runner.kernels import SamplingKernels

    class Avx2Only:
        def isas(self) -> list[str]:
            return ["avx2"]

    assert SamplingKernels(Avx2Only()).draws_isa == "avx2"
    with pytest.raises(ValueError, match="no avx512"):
        SamplingKernels(Avx2Only(), masks="avx512")
    assert SamplingKernels(None).masks_isa is None
