"""SequenceInfo: the flattened per-forward inputs; PagePool: page allocation and reuse."""

import pytest
import torch

from autodeploy.runtime import PagePool, SequenceInfo, SequenceRequest, last_token_idx
from autodeploy.runtime.kv_cache import CacheLayer, KVCacheSpec


def test_build_mixed_prefill_and_decode():
    info = SequenceInfo(max_batch_size=4, max_seq_len=16, page_size=4, num_pages=10)
    assert info.max_pages_per_seq == 4 and info.pages_needed(5) == 2
    batch = info.build([([5, 6, 7], 0, [2]), SequenceRequest([9], 6, [0, 3]), ([1, 2], 4, [4, 5])])
    assert batch.input_ids.tolist() == [[5, 6, 7, 9, 1, 2]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 6, 4, 5]]
    assert batch.seq_lens.tolist() == [3, 1, 2] and batch.seq_lens.dtype == torch.int32
    assert batch.input_pos.tolist() == [0, 6, 4] and batch.input_pos.dtype == torch.int32
    # as wide as the longest sequence needs (position 6 -> 2 pages), not max_pages_per_seq
    assert batch.page_table.tolist() == [[2, 0], [0, 3], [4, 5]]
    assert batch.logits_idx.tolist() == [2, 3, 5] and batch.logits_idx.dtype == torch.long
    assert (batch.num_seqs, batch.num_tokens) == (3, 6)
    assert list(batch.as_kwargs()) == ["input_ids", "position_ids", "seq_lens", "input_pos", "page_table", "logits_idx"]
    assert info.build([([1, 2], 0, [0])], gather="all").logits_idx.tolist() == [0, 1]
    reserved = info.build([([1], 0, [7, 8, 9])])  # pages reserved beyond the need are not passed
    assert reserved.page_table.tolist() == [[7]]
    no_gather = info.build([([1, 2], 0, [0])], gather=None)
    assert no_gather.logits_idx is None and "logits_idx" not in no_gather.as_kwargs() and len(no_gather.as_args()) == 5


@pytest.mark.parametrize("gather, slots", [("last", False), (None, True)])
def test_reused_decode_inputs_equal_new_ones(gather, slots):
    """Decode batches built with reuse=True are refilled tensors of their shape, equal to freshly built ones;
    other batches (a prompt among them) are built anew."""
    info = SequenceInfo(max_batch_size=4, max_seq_len=16, page_size=4, num_pages=10)
    steps = [[SequenceRequest([9], 6, [0, 3], slot=2), SequenceRequest([4], 2, [5, 6, 7], slot=0)],
             [SequenceRequest([8], 7, [0, 3], slot=2), SequenceRequest([3], 3, [5], slot=0)],
             [SequenceRequest([7], 3, [1], slot=1), SequenceRequest([2], 1, [8], slot=3)]]
    built = []
    for reqs in steps:
        for min_width in (1, 3):
            batch = info.build(reqs, gather=gather, slots=slots, min_width=min_width, reuse=True)
            fresh = info.build(reqs, gather=gather, slots=slots, min_width=min_width)
            for name, tensor in batch.as_kwargs().items():
                assert torch.equal(tensor, fresh.as_kwargs()[name]), name
                assert tensor.dtype == fresh.as_kwargs()[name].dtype, name
            assert set(batch.as_kwargs()) == set(fresh.as_kwargs())
            built.append(batch)
    assert built[0] is built[2] and built[1] is built[3]  # one shape (width 2 or 3): the same tensors
    assert built[4] is not built[0]  # width 1
    assert info.build(steps[2], min_width=3).page_table.tolist() == [[1, 0, 0], [8, 0, 0]]
    prompt = [SequenceRequest([1, 2], 0, [4]), SequenceRequest([9], 6, [0, 3])]
    assert info.build(prompt, reuse=True) is not info.build(prompt, reuse=True)


def test_last_token_idx():
    assert last_token_idx([3, 1, 2]).tolist() == [2, 3, 5]
    assert last_token_idx(torch.tensor([1, 1], dtype=torch.int32)).tolist() == [0, 1]


@pytest.mark.parametrize(
    "requests, match",
    [
        ([], "at least one"),
        ([([1], 0, [0])] * 3, "max_batch_size"),
        ([([1] * 9, 0, [0, 1, 2])], "max_seq_len"),
        ([([1] * 5, 0, [0])], "need 2 pages"),
        ([([1], 0, [12])], "outside"),
        ([([], 0, [0])], "new token"),
    ],
)
def test_build_rejects_bad_requests(requests, match):
    info = SequenceInfo(max_batch_size=2, max_seq_len=8, page_size=4, num_pages=6)
    with pytest.raises(ValueError, match=match):
        info.build(requests)


def test_from_spec():
    spec = KVCacheSpec("torch", page_size=16, max_batch_size=3, max_seq_len=40,
                       layers=[CacheLayer("k", "v", 2, 8, 8, torch.float32)], num_pages=7)
    info = SequenceInfo.from_spec(spec)
    assert (info.max_batch_size, info.max_seq_len, info.page_size, info.num_pages) == (3, 40, 16, 7)
    assert spec.bytes_per_token == 2 * 16 * 4 and spec.bytes_per_page == 16 * 128 and spec.max_useful_pages == 9


def test_page_pool_reuse():
    pool = PagePool(4)
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.num_free == 1
    with pytest.raises(RuntimeError, match="out of KV-cache pages"):
        pool.allocate(2)
    pool.free(a[:2])
    b = pool.allocate(3)
    assert sorted(b) == [0, 1, 3]
    with pytest.raises(ValueError):
        pool.free([0, 0])
