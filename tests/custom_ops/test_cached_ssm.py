"""The cached state-space ops against the uncached ones: prefill then decode steps in mixed batches, chunked
prefill, slots reset on admission, padding sequences that leave their slot alone."""

import torch

import autodeploy.custom_ops  # noqa: F401  (registers the ops)

ops = torch.ops.auto_deploy
CHANNELS, STATE, KERNEL, SLOTS = 6, 4, 4, 3


def _params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return dict(weight=torch.randn(CHANNELS, 1, KERNEL, generator=gen), bias=torch.randn(CHANNELS, generator=gen),
                A=-torch.rand(CHANNELS, STATE, generator=gen) - 0.1, D=torch.randn(CHANNELS, generator=gen),
                dt_bias=torch.randn(CHANNELS, generator=gen))


def _inputs(length, seed):
    """One sequence's inputs to the conv (x) and the scan (dt, B, C, z), [1, length, ...] each."""
    gen = torch.Generator().manual_seed(100 + seed)
    return dict(x=torch.randn(1, length, CHANNELS, generator=gen), dt=torch.randn(1, length, CHANNELS, generator=gen),
                B=torch.randn(1, length, STATE, generator=gen), C=torch.randn(1, length, STATE, generator=gen),
                z=torch.randn(1, length, CHANNELS, generator=gen))


def _uncached(p, seq):
    conv = ops.torch_causal_conv1d(seq["x"], p["weight"], p["bias"])
    scan = ops.torch_selective_scan(seq["x"], seq["dt"], p["A"], seq["B"], seq["C"], p["D"], seq["z"], p["dt_bias"],
                                    True)
    return conv, scan


class States:
    """The two state caches, filled with garbage: a fresh sequence must never read what a slot held."""

    def __init__(self):
        self.conv = torch.randn(SLOTS, CHANNELS, KERNEL - 1) * 100
        self.ssm = torch.randn(SLOTS, CHANNELS, STATE) * 100

    def step(self, p, chunks):
        """One forward over ``chunks``: (sequence inputs, positions [start, end), input_pos, slot) each."""
        cat = {k: torch.cat([seq[k][:, a:b] for seq, (a, b), _, _ in chunks], dim=1) for k in chunks[0][0]}
        seq_lens = torch.tensor([b - a for _, (a, b), _, _ in chunks], dtype=torch.int32)
        input_pos = torch.tensor([pos for _, _, pos, _ in chunks], dtype=torch.int32)
        slots = torch.tensor([slot for *_, slot in chunks], dtype=torch.int32)
        conv = ops.torch_cached_causal_conv1d(cat["x"], p["weight"], p["bias"], self.conv, seq_lens, input_pos, slots)
        scan = ops.torch_cached_selective_scan(cat["x"], cat["dt"], p["A"], cat["B"], cat["C"], p["D"], cat["z"],
                                               p["dt_bias"], True, self.ssm, seq_lens, input_pos, slots)
        return conv.split(seq_lens.tolist(), dim=1), scan.split(seq_lens.tolist(), dim=1)


def _close(got, want):
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_prefill_then_decode_steps_match_the_uncached_ops():
    p, states = _params(), States()
    seqs = [_inputs(9, 0), _inputs(9, 1)]
    want = [_uncached(p, s) for s in seqs]
    # both prompts (5 and 3 tokens) in one forward, then decode steps of one token each
    lens = [5, 3]
    conv, scan = states.step(p, [(seqs[0], (0, 5), 0, 2), (seqs[1], (0, 3), 0, 0)])
    for i in range(2):
        _close(conv[i], want[i][0][:, :lens[i]])
        _close(scan[i], want[i][1][:, :lens[i]])
    for _ in range(4):
        conv, scan = states.step(p, [(seqs[0], (lens[0], lens[0] + 1), lens[0], 2),
                                     (seqs[1], (lens[1], lens[1] + 1), lens[1], 0)])
        for i in range(2):
            _close(conv[i], want[i][0][:, lens[i]:lens[i] + 1])
            _close(scan[i], want[i][1][:, lens[i]:lens[i] + 1])
        lens = [n + 1 for n in lens]


def test_mixed_batch_with_chunked_prefill_and_a_padding_sequence():
    p, states = _params(1), States()
    a, b = _inputs(8, 2), _inputs(8, 3)
    want_a, want_b = _uncached(p, a), _uncached(p, b)
    states.step(p, [(a, (0, 2), 0, 1)])  # a: prompt chunk 1 (tokens 0-1)
    held = states.conv[2].clone(), states.ssm[2].clone()
    # a: its next chunk (2-6) continues from its slot; b: a fresh 1-token prompt; an empty padding sequence
    conv, scan = states.step(p, [(a, (2, 7), 2, 1), (b, (0, 1), 0, 0), (b, (0, 0), 0, 2)])
    _close(conv[0], want_a[0][:, 2:7])
    _close(scan[0], want_a[1][:, 2:7])
    _close(conv[1], want_b[0][:, :1])
    _close(scan[1], want_b[1][:, :1])
    assert torch.equal(states.conv[2], held[0]) and torch.equal(states.ssm[2], held[1])  # left alone
    conv, scan = states.step(p, [(b, (1, 2), 1, 0), (a, (7, 8), 7, 1)])  # decode only, slots out of order
    _close(conv[0], want_b[0][:, 1:2])
    _close(scan[1], want_a[1][:, 7:8])


def test_a_sequence_admitted_into_a_used_slot_starts_from_zero():
    p, states = _params(2), States()
    old, new = _inputs(6, 4), _inputs(6, 5)
    for n in range(6):  # the old sequence fills slot 1 (prefill of one token, then decode)
        states.step(p, [(old, (n, n + 1), n, 1)])
    want = _uncached(p, new)
    conv, scan = states.step(p, [(new, (0, 1), 0, 1)])  # decode-only path, input_pos 0: a fresh sequence
    _close(conv[0], want[0][:, :1])
    _close(scan[0], want[1][:, :1])
    states.step(p, [(old, (0, 6), 0, 1)])
    conv, scan = states.step(p, [(new, (0, 6), 0, 1)])  # prefill path
    _close(conv[0], want[0])
    _close(scan[0], want[1])


def test_fake_implementations_keep_the_input_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    p = _params()
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(1, 7, CHANNELS)
        meta = torch.empty(2, dtype=torch.int32)
        out = ops.torch_cached_causal_conv1d(x, p["weight"], p["bias"], torch.empty(SLOTS, CHANNELS, KERNEL - 1),
                                             meta, meta, meta)
        scan = ops.torch_cached_selective_scan(x, x, p["A"], torch.empty(1, 7, STATE), torch.empty(1, 7, STATE),
                                               p["D"], x, p["dt_bias"], True, torch.empty(SLOTS, CHANNELS, STATE),
                                               meta, meta, meta)
    assert out.shape == scan.shape == (1, 7, CHANNELS)


# -- Mamba-2 (SSD) ------------------------------------------------------------------------------
HEADS, HEAD_DIM, GROUPS = 4, 3, 2


def _ssd_inputs(length, seed):
    gen = torch.Generator().manual_seed(200 + seed)
    return dict(x=torch.randn(1, length, HEADS, HEAD_DIM, generator=gen),
                dt=torch.randn(1, length, HEADS, generator=gen),
                B=torch.randn(1, length, GROUPS, STATE, generator=gen),
                C=torch.randn(1, length, GROUPS, STATE, generator=gen))


def test_cached_ssd_scan_prefill_decode_and_reset_match_the_uncached_scan():
    gen = torch.Generator().manual_seed(7)
    A, D, dt_bias = -torch.rand(HEADS, generator=gen) - 0.1, torch.randn(HEADS, generator=gen), torch.randn(HEADS)
    limits = (0.01, 1.5)
    state = torch.randn(SLOTS, HEADS, HEAD_DIM, STATE) * 100  # garbage a fresh sequence must not read
    seqs = [_ssd_inputs(7, 0), _ssd_inputs(7, 1)]
    want = [ops.torch_ssd_scan(s["x"], s["dt"], A, s["B"], s["C"], D, dt_bias, True, *limits) for s in seqs]

    def step(chunks):  # (sequence, (start, end), slot)
        cat = {k: torch.cat([seq[k][:, a:b] for seq, (a, b), _ in chunks], dim=1) for k in chunks[0][0]}
        seq_lens = torch.tensor([b - a for _, (a, b), _ in chunks], dtype=torch.int32)
        input_pos = torch.tensor([a for _, (a, _), _ in chunks], dtype=torch.int32)
        slots = torch.tensor([slot for *_, slot in chunks], dtype=torch.int32)
        out = ops.torch_cached_ssd_scan(cat["x"], cat["dt"], A, cat["B"], cat["C"], D, dt_bias, True, *limits, state,
                                        seq_lens, input_pos, slots)
        return out.split(seq_lens.tolist(), dim=1)

    out = step([(seqs[0], (0, 4), 2), (seqs[1], (0, 1), 0)])  # two prompts
    _close(out[0], want[0][:, :4])
    _close(out[1], want[1][:, :1])
    out = step([(seqs[0], (4, 5), 2), (seqs[1], (1, 6), 0)])  # a decode step beside a prompt's next chunk
    _close(out[0], want[0][:, 4:5])
    _close(out[1], want[1][:, 1:6])
    out = step([(seqs[1], (6, 7), 0), (seqs[0], (5, 6), 2)])  # decode only
    _close(out[0], want[1][:, 6:7])
    _close(out[1], want[0][:, 5:6])
    out = step([(seqs[1], (0, 1), 2)])  # admitted into the used slot 2: from the zero state
    _close(out[0], want[1][:, :1])


# -- gated delta rule ---------------------------------------------------------------------------
def test_cached_gated_delta_rule_prefill_decode_and_reset_match_the_uncached_rule():
    hk, hv, dk, dv = 2, 4, 5, 3
    state = torch.randn(SLOTS, hv, dk, dv) * 100  # garbage a fresh sequence must not read

    def inputs(length, seed):
        gen = torch.Generator().manual_seed(300 + seed)
        return dict(q=torch.randn(1, length, hk, dk, generator=gen), k=torch.randn(1, length, hk, dk, generator=gen),
                    v=torch.randn(1, length, hv, dv, generator=gen), g=-torch.rand(1, length, hv, generator=gen),
                    beta=torch.rand(1, length, hv, generator=gen))

    seqs = [inputs(6, 0), inputs(6, 1)]
    want = [ops.torch_gated_delta_rule(s["q"], s["k"], s["v"], s["g"], s["beta"], True) for s in seqs]

    def step(chunks):  # (sequence, (start, end), slot)
        cat = {key: torch.cat([seq[key][:, a:b] for seq, (a, b), _ in chunks], dim=1) for key in chunks[0][0]}
        seq_lens = torch.tensor([b - a for _, (a, b), _ in chunks], dtype=torch.int32)
        input_pos = torch.tensor([a for _, (a, _), _ in chunks], dtype=torch.int32)
        slots = torch.tensor([slot for *_, slot in chunks], dtype=torch.int32)
        out = ops.torch_cached_gated_delta_rule(cat["q"], cat["k"], cat["v"], cat["g"], cat["beta"], True, state,
                                                seq_lens, input_pos, slots)
        return out.split(seq_lens.tolist(), dim=1)

    out = step([(seqs[0], (0, 3), 1), (seqs[1], (0, 2), 2)])
    _close(out[0], want[0][:, :3])
    _close(out[1], want[1][:, :2])
    out = step([(seqs[1], (2, 3), 2), (seqs[0], (3, 4), 1)])  # decode only
    _close(out[0], want[1][:, 2:3])
    _close(out[1], want[0][:, 3:4])
    out = step([(seqs[0], (4, 6), 1), (seqs[1], (0, 6), 2)])  # a chunk beside a fresh prompt in a used slot
    _close(out[0], want[0][:, 4:6])
    _close(out[1], want[1])


def test_cached_gated_delta_rule_with_a_decay_per_key_channel():
    heads, dk, dv = 2, 4, 3
    state = torch.randn(SLOTS, heads, dk, dv) * 100
    gen = torch.Generator().manual_seed(9)
    q, k = torch.randn(1, 5, heads, dk, generator=gen), torch.randn(1, 5, heads, dk, generator=gen)
    v, g = torch.randn(1, 5, heads, dv, generator=gen), -torch.rand(1, 5, heads, dk, generator=gen)
    beta = torch.rand(1, 5, heads, generator=gen)
    want = ops.torch_gated_delta_rule(q, k, v, g, beta, True)
    one = torch.tensor([1], dtype=torch.int32)
    for start, end in ((0, 3), (3, 4), (4, 5)):  # a prompt, then two decode steps
        got = ops.torch_cached_gated_delta_rule(q[:, start:end], k[:, start:end], v[:, start:end], g[:, start:end],
                                                beta[:, start:end], True, state,
                                                torch.tensor([end - start], dtype=torch.int32),
                                                torch.tensor([start], dtype=torch.int32), one)
        _close(got, want[:, start:end])
