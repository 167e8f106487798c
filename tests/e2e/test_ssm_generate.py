"""State-space models end to end: Mamba, the Mamba-2 hybrid Bamba and LFM2's short convolutions (coverage's tiny
configs) through ``LLM.generate`` (state cache beside the KV cache, continuous batching) give HF's greedy tokens,
with more prompts than slots (later ones admitted into freed slots) and prompts chunked over several forwards."""

import pytest
import torch

from autodeploy import LLM, SamplingParams
from autodeploy.coverage import VOCAB, make_checkpoint
from tiny_models import hf_reference

MAX_TOKENS = 6
PROMPT_LENS = [3, 11, 1, 7, 5]


def _checkpoint(tmp_path_factory, arch):
    path = make_checkpoint(arch, tmp_path_factory.mktemp("ckpt") / arch)
    return path, hf_reference(path)


@pytest.fixture(scope="module")
def mamba(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "mamba")




def _hf_greedy(reference, prompt):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                 do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _prompts():
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]


# k/v cache layers (attention) and state layers (a conv state and a scan state per Mamba layer, a conv state per
# LFM2 short-convolution layer)
@pytest.mark.parametrize("arch,kv_layers,state_layers", [("mamba", 0, 4), ("bamba", 1, 2), ("lfm2", 1, 1)])
@pytest.mark.parametrize("max_num_tokens", [None, 4])  # 4: prompts chunked, prefill mixed with decode
def test_batch_matches_hf_with_slots_reused(tmp_path_factory, arch, kv_layers, state_layers, max_num_tokens):
    path, reference = _checkpoint(tmp_path_factory, arch)
    llm = LLM(path, max_batch_size=2, max_seq_len=32, max_num_tokens=max_num_tokens,
              kv_cache_config={"max_tokens": 128, "page_size": 16},
              **{"transforms.compile_model.backend": "torch-simple"})
    spec = llm.engine.spec
    assert len(spec.layers) == kv_layers and len(spec.state_layers) == state_layers
    assert llm.engine.takes_slots and not llm.engine.scheduler.prefix_caching
    prompts = _prompts()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == _hf_greedy(reference, prompt)
    assert sorted(llm.engine.scheduler._free_slots) == [0, 1]  # every slot given back


def test_a_prompt_in_a_used_slot_gives_the_tokens_it_gives_alone(mamba):
    path, _ = mamba
    llm = LLM(path, max_batch_size=1, max_seq_len=32, kv_cache_config={"max_tokens": 32, "page_size": 16},
              **{"transforms.compile_model.backend": "torch-simple"})
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    first, second = _prompts()[1:3]  # 11 tokens, then 1: a short prompt shows stale state most (it decays)
    alone = llm.generate([second], params)[0].outputs[0].token_ids
    after = llm.generate([first, second], params)[1].outputs[0].token_ids  # the one slot, used by `first` before
    assert after == alone
