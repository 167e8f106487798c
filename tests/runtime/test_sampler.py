"""Sampler: greedy is argmax, seeded draws are reproducible, top-k / top-p / temperature behave."""

import pytest
import torch

from autodeploy.runtime.sampler import SamplingParams, filter_logits, make_generator, sample

VOCAB = 16


def _logits(seed=0, rows=3):
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def _draws(row, params, n=2000, seed=0):
    gen = make_generator(seed)
    return [sample(row[None], [params], [gen])[0] for _ in range(n)]


def test_greedy_is_argmax():
    logits = _logits()
    params = [SamplingParams(temperature=0.0)] * 3
    assert sample(logits, params, [None] * 3) == logits.argmax(-1).tolist()
    # top_k=1 is greedy whatever the temperature
    assert sample(logits, [SamplingParams(temperature=5.0, top_k=1)] * 3, [make_generator(1)] * 3) == \
        logits.argmax(-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_ties_and_nan_pick_the_first_like_torch(dtype):
    """Ties take the lowest token id and a NaN wins, as torch's argmax does (float32 rows take numpy's
    argmax; other dtypes torch's), also for rows that are a strided view."""
    logits = torch.zeros(3, 2 * VOCAB)
    logits[0, [4, 10]] = 5.0  # columns 2 and 5 of the strided view
    logits[1, 4] = float("nan")
    logits[1, 6] = 1e30
    logits = logits.to(dtype)[:, ::2]
    picked = sample(logits, [SamplingParams(temperature=0.0)] * 3, [None] * 3)
    assert picked == logits.float().argmax(-1).tolist() == [2, 2, 0]


def test_seeded_sampling_is_reproducible_and_independent_of_batch():
    logits = _logits(rows=4)
    p = SamplingParams(temperature=1.3, top_p=0.9, seed=7)
    a = [sample(logits[1:2], [p], [g])[0] for g in [make_generator(7)] for _ in range(50)]
    gen = make_generator(7)
    b = [sample(logits[1:2], [p], [gen])[0] for _ in range(50)]
    assert a == b and len(set(a)) > 1
    # the same request batched with others (own generators) draws the same tokens
    gens = [make_generator(s) for s in (1, 7, 3, 4)]
    c = [sample(logits, [SamplingParams(temperature=1.3, top_p=0.9)] * 4, gens)[1] for _ in range(50)]
    assert c == a


def test_top_k_never_leaves_the_top_k():
    row = _logits()[0]
    top2 = set(torch.topk(row, 2).indices.tolist())
    draws = _draws(row, SamplingParams(temperature=2.0, top_k=2))
    assert set(draws) == top2  # both are drawn, nothing else


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    row = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05] + [1e-9] * (VOCAB - 4)))
    probs = filter_logits(row, 1.0, top_p=0.7)
    assert probs[:2].sum().item() == pytest.approx(1.0) and probs[2:].sum() == 0
    torch.testing.assert_close(probs[:2], torch.tensor([0.625, 0.375]))
    draws = _draws(row, SamplingParams(temperature=1.0, top_p=0.7), n=4000)
    assert set(draws) == {0, 1}
    assert draws.count(0) / len(draws) == pytest.approx(0.625, abs=0.04)
    # a tiny top_p keeps only the most likely token
    assert set(_draws(row, SamplingParams(temperature=1.0, top_p=1e-3), n=200)) == {0}


def test_temperature_shapes_the_distribution():
    row = _logits()[0]
    best = int(row.argmax())
    cold = _draws(row, SamplingParams(temperature=0.05), n=500)
    hot = _draws(row, SamplingParams(temperature=1.0), n=2000)
    assert cold.count(best) / len(cold) > 0.99
    assert len(set(hot)) > len(set(cold))
    # temperature 1: frequencies follow softmax(logits)
    expected = torch.softmax(row, -1)
    freq = torch.bincount(torch.tensor(hot), minlength=VOCAB).float() / len(hot)
    assert (freq - expected).abs().max() < 0.05


def test_invalid_values_are_named():
    assert SamplingParams().problem() is None
    for bad, field in [(dict(temperature=-1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
                       (dict(top_k=-1), "top_k"), (dict(max_tokens=0), "max_tokens"),
                       (dict(stop_token_ids=["a"]), "stop_token_ids")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**bad).validate()
