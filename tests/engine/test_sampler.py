"""Sampler: greedy, penalties, truncation (top-k / top-p / min-p), distributions, seeds, logprobs."""
from __future__ import annotations

import math

import pytest
import torch

from engine.layers.sampler import Sampler, SamplingBatch, apply_top_k_top_p
from engine.request import Request
from engine.sampling_params import SamplingParams

V = 32
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))]


@pytest.fixture(params=DEVICES)
def dev(request):
    return request.param


def _req(rid="r", prompt=(1, 2, 3), out=(), eos=(0,), **kw):
    r = Request(rid, list(prompt), SamplingParams(max_tokens=100, **kw), eos_token_ids=eos)
    r.output_token_ids = list(out)
    return r


def _sample(logits, reqs, dev="cpu"):
    return Sampler()(logits.to(dev), SamplingBatch.from_requests(reqs, logits.shape[1], dev))


def _draws(logits_row, n, dev="cpu", **kw):
    """n independent samples of one distribution, as n rows of one batch."""
    reqs = [_req(f"r{i}", **kw) for i in range(n)]
    return _sample(logits_row.unsqueeze(0).expand(n, -1).contiguous(), reqs, dev).token_ids


def test_greedy_is_exact_argmax(dev):
    torch.manual_seed(0)
    logits = torch.randn(6, V)
    out = _sample(logits, [_req(f"r{i}", temperature=0.0, top_k=3, top_p=0.5) for i in range(6)], dev)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 6


def test_mixed_batch_greedy_rows_unaffected(dev):
    torch.manual_seed(1)
    logits = torch.randn(4, V)
    reqs = [_req("a", temperature=0.0), _req("b", temperature=1.0),
            _req("c", temperature=0.0), _req("d", temperature=0.7, seed=3)]
    out = _sample(logits, reqs, dev)
    am = logits.argmax(-1).tolist()
    assert out.token_ids[0] == am[0] and out.token_ids[2] == am[2]


def test_repetition_penalty_matches_hf_rule(dev):
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5, 3.0]])
    r = _req(prompt=[0], out=[1, 1], temperature=0.0, repetition_penalty=2.0)
    b = SamplingBatch.from_requests([r], 6, dev)
    from engine.layers.sampler import apply_penalties
    got = apply_penalties(logits.to(dev), b).cpu()
    assert torch.allclose(got, torch.tensor([[1.0, -4.0, 1.0, -1.0, 0.5, 3.0]]))
    # greedy follows the penalized logits: 0 was best among {0, 2} until penalized
    logits2 = torch.tensor([[2.0, 0.0, 1.5, 0.0, 0.0, 0.0]])
    assert _sample(logits2, [r], dev).token_ids == [2]


def test_presence_and_frequency_penalties_on_output_only(dev):
    logits = torch.zeros(1, 6)
    r = _req(prompt=[5, 5], out=[1, 1, 1, 2], temperature=0.0,
             presence_penalty=0.5, frequency_penalty=0.25)
    from engine.layers.sampler import apply_penalties
    got = apply_penalties(logits.to(dev), SamplingBatch.from_requests([r], 6, dev)).cpu()
    want = torch.tensor([[0.0, -(0.5 + 0.75), -(0.5 + 0.25), 0.0, 0.0, 0.0]])
    assert torch.allclose(got, want)  # prompt token 5 untouched


def test_penalties_stay_in_their_rows(dev):
    from engine.layers.sampler import apply_penalties
    logits = torch.ones(3, 6)
    reqs = [_req("a", prompt=[0], out=[1], temperature=0.0, repetition_penalty=2.0),
            _req("b", prompt=[2, 2], out=[], temperature=0.0),  # no penalties
            _req("c", prompt=[3], out=[4, 4, 99], temperature=0.0, frequency_penalty=1.0)]
    got = apply_penalties(logits.to(dev), SamplingBatch.from_requests(reqs, 6, dev)).cpu()
    want = torch.tensor([[0.5, 0.5, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [1, 1, 1, 1, -1, 1.0]])
    assert torch.allclose(got, want)  # out-of-vocab id 99 ignored


def test_min_tokens_bans_eos_and_stop_ids(dev):
    logits = torch.zeros(2, V)
    logits[:, 0] = 10.0  # eos
    logits[:, 7] = 9.0  # stop token
    logits[:, 4] = 1.0
    early = _req("a", out=[3], temperature=0.0, min_tokens=3, stop_token_ids=(7,))
    done = _req("b", out=[3, 3, 3], temperature=0.0, min_tokens=3, stop_token_ids=(7,))
    assert _sample(logits, [early, done], dev).token_ids == [4, 0]


def test_top_k_never_outside_top_k(dev):
    torch.manual_seed(2)
    row = torch.randn(V) * 2
    allowed = set(row.topk(5).indices.tolist())
    toks = _draws(row, 3000, dev, temperature=1.5, top_k=5)
    assert set(toks) <= allowed and len(set(toks)) == 5


def test_top_p_keeps_minimal_nucleus(dev):
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    logits = probs.log().unsqueeze(0).repeat(3, 1)
    # ascending cumsum .04 .10 .20 .35 .60 1.0; boundaries kept away from the thresholds
    p = torch.tensor([0.6, 0.7, 0.85])  # -> {0,1} (.65), {0,1,2} (.8), {0,1,2,3} (.9)
    kept = torch.isfinite(apply_top_k_top_p(logits.to(dev), None, p.to(dev))).cpu()
    assert kept.tolist() == [[True, True, False, False, False, False],
                             [True, True, True, False, False, False],
                             [True, True, True, True, False, False]]
    toks = _draws(probs.log(), 2000, dev, top_p=0.7)
    assert set(toks) == {0, 1, 2}


def test_min_p_threshold(dev):
    probs = torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04])
    toks = _draws(probs.log(), 3000, dev, min_p=0.15)  # threshold 0.075: keeps {0,1,2}
    assert set(toks) == {0, 1, 2}


def _chi2(counts: dict[int, int], probs: torch.Tensor, n: int) -> float:
    return sum((counts.get(i, 0) - n * p) ** 2 / (n * p) for i, p in enumerate(probs.tolist()))


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_frequencies_match_softmax(temperature, dev):
    torch.manual_seed(3)
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 0.25])
    n = 6000
    toks = _draws(row, n, dev, temperature=temperature)
    counts = {i: toks.count(i) for i in set(toks)}
    probs = (row / temperature).softmax(-1)
    # 5 degrees of freedom: P(chi2 > 25) ~ 1e-4; a wrong temperature gives hundreds
    assert _chi2(counts, probs, n) < 25
    wrong = (row / (temperature * 1.5)).softmax(-1)
    assert _chi2(counts, wrong, n) > 25


def test_top_k_top_p_frequencies_renormalized(dev):
    torch.manual_seed(4)
    row = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, -2.0])
    n = 6000
    toks = _draws(row, n, dev, top_k=3)
    probs = row[:3].softmax(-1)
    counts = {i: toks.count(i) for i in range(3)}
    assert set(toks) <= {0, 1, 2} and _chi2(counts, probs, n) < 20


def test_same_seed_same_tokens_whatever_the_batch(dev):
    torch.manual_seed(5)
    logits = torch.randn(5, V)
    target = logits[2].clone()
    a = _sample(logits, [_req(f"x{i}", seed=(42 if i == 2 else None)) for i in range(5)], dev).token_ids[2]
    other = torch.randn(3, V)
    other[0] = target
    b = _sample(other, [_req("y", seed=42), _req("z"), _req("w", seed=7)], dev).token_ids[0]
    c = _sample(target.unsqueeze(0), [_req("solo", seed=42)], dev).token_ids[0]
    assert a == b == c
    # the stream advances per output token: later positions are not all the same draw
    seq = [_sample(torch.zeros(1, V), [_req("s", seed=42, out=[1] * k)], dev).token_ids[0] for k in range(8)]
    assert len(set(seq)) > 1
    seq2 = [_sample(torch.zeros(1, V), [_req("t", seed=42, out=[1] * k)], dev).token_ids[0] for k in range(8)]
    assert seq == seq2
    assert seq != [_sample(torch.zeros(1, V), [_req("u", seed=43, out=[1] * k)], dev).token_ids[0]
                   for k in range(8)]


def test_logprobs_are_raw_model_distribution(dev):
    torch.manual_seed(6)
    logits = torch.randn(3, V)
    reqs = [_req("a", temperature=0.0, logprobs=3, repetition_penalty=1.5, out=[int(logits[0].argmax())]),
            _req("b", temperature=0.8, top_k=4, logprobs=0),
            _req("c", temperature=1.0)]
    out = _sample(logits, reqs, dev)
    lp = logits.log_softmax(-1)
    chosen, top = out.logprobs[0]
    assert math.isclose(chosen, lp[0, out.token_ids[0]].item(), rel_tol=1e-5)
    want = lp[0].topk(3)
    assert [t for t, _ in top] == want.indices.tolist()
    assert all(math.isclose(v, w, rel_tol=1e-5) for (_, v), w in zip(top, want.values.tolist()))
    chosen_b, top_b = out.logprobs[1]
    assert top_b == [] and math.isclose(chosen_b, lp[1, out.token_ids[1]].item(), rel_tol=1e-5)
    assert out.logprobs[2] is None


def test_bad_shapes_raise():
    b = SamplingBatch.from_requests([_req()], V, "cpu")
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, V), b)
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(1, V + 1), b)
    with pytest.raises(ValueError):
        SamplingBatch.from_requests([], V, "cpu")
