"""Tensor and expert parallelism end to end on CPU (gloo): LLM(world_size=N) spawns N-1 ranks, rank 0
drives continuous batching with a small KV budget. Against the single-process graph the logits of a mixed
prefill+decode batch stay within 1e-4, and the greedy tokens equal HF generate's; with more ranks than KV
heads (world_size 4, 2 kv heads) the KV heads are replicated; the MoE models run expert parallelism."""

import os
import subprocess
import sys

import pytest
import torch

from autodeploy import LLM, SamplingParams
from autodeploy.errors import AutoDeployError
from autodeploy.runtime.sequence_info import SequenceRequest
from autodeploy.transform import BaseTransform, TransformInfo, TransformRegistry
from tiny_models import ARCHS, hf_reference

pytestmark = pytest.mark.slow  # every case starts world_size processes

PROMPTS = [[3, 17, 9, 40, 2], [8, 1], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]]
PAGE = 16
ARGS = dict(max_batch_size=2, max_seq_len=48, kv_cache_config={"max_tokens": 4 * PAGE, "page_size": PAGE})


def _hf_greedy(reference, prompt, n):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                 pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _mixed_batch_logits(llm):
    """Logits of one batch with a prefill and a decode sequence, through the module the engine serves."""
    info = llm.engine.info
    prefill = info.build([SequenceRequest(PROMPTS[0], 0, [0])], gather="all")
    mixed = info.build([SequenceRequest([4], len(PROMPTS[0]), [0]), SequenceRequest(PROMPTS[1], 0, [1])],
                       gather="all")
    with torch.no_grad():
        first = llm.module(*prefill.as_args())[0]
        return torch.cat([first, llm.module(*mixed.as_args())[0]], dim=1)


@pytest.mark.parametrize("arch, world_size", [(a, 2) for a in ARCHS] + [("llama", 4), ("qwen3", 4), ("mixtral", 4)])
def test_sharded_generation_matches_hf_and_the_single_process_graph(arch, world_size, tiny_checkpoint):
    path = tiny_checkpoint(arch)
    single = LLM(path, **ARGS)
    want_logits = _mixed_batch_logits(single)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    with LLM(path, world_size=world_size, **ARGS) as llm:
        got_logits = _mixed_batch_logits(llm)
        outs = llm.generate(PROMPTS, params)
    torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=0)
    reference = hf_reference(path)
    assert [o.outputs[0].token_ids for o in outs] == [_hf_greedy(reference, p, 8) for p in PROMPTS]
    assert set(llm.rank_peak_rss_bytes) == set(range(world_size))  # every rank reported and exited


@TransformRegistry.register("test_tp_known_to_rank_zero_only")
class _KnownToRankZeroOnly(BaseTransform):
    """Registered in this process only: a spawned rank does not know the key and fails on the config."""

    def _apply(self, gm, ctx):
        return gm, TransformInfo.unchanged()


def test_a_failing_rank_ends_the_run_with_its_error(tiny_checkpoint):
    extra = {"transforms.test_tp_known_to_rank_zero_only.stage": "post_export"}
    with pytest.raises(AutoDeployError, match=r"rank 1 failed: ConfigError: unknown transform key "
                                              r"'test_tp_known_to_rank_zero_only'"):
        LLM(tiny_checkpoint("llama"), world_size=2, overrides=extra, **ARGS)


def test_a_rank_that_dies_while_serving_ends_the_next_step(tiny_checkpoint):
    llm = LLM(tiny_checkpoint("llama"), world_size=2, **ARGS)
    worker = llm._built.workers.processes[0]
    worker.kill()
    worker.wait(10)
    with pytest.raises(AutoDeployError, match="rank 1 exited with code -9"):
        llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=4))
    llm.close()


def test_dumps_are_written_once_and_show_the_collectives(tiny_checkpoint, tmp_path, monkeypatch):
    dumps = tmp_path / "dumps"
    monkeypatch.setenv("AD_DUMP_GRAPHS_DIR", str(dumps))
    with LLM(tiny_checkpoint("llama"), world_size=2, **ARGS):
        pass
    files = sorted(p.name for p in dumps.glob("*.txt"))
    keys = [name.split("_", 1)[1] for name in files]
    assert len(keys) == len(set(keys))  # one file per transform: rank 1 wrote none
    (executor,) = [p for p in dumps.glob("*_sharding_sharding_transform_executor.txt")]
    text = executor.read_text()
    assert text.count("auto_deploy.torch_dist_all_reduce") == 4  # o and down of each of the 2 layers


def _torchrun_two_nodes(path, timeout: float):
    """torchrun --nnodes 2 (one process each) over the loopback address on a free port: the node processes
    (rank 1's first) and their (stdout, stderr), or None for the outputs if they did not finish in time."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--master-addr", "127.0.0.1", "--master-port", str(port)]
    run = ["-m", "autodeploy", "run", "--model", str(path), "--world-size", "2", "--prompt-ids", "3,17,9,40,2",
           "--max-tokens", "8", "--max-batch-size", "2", "--max-seq-len", "48"]
    env = {**os.environ, "AUTODEPLOY_DIST_TIMEOUT": "120"}
    nodes = [subprocess.Popen(command + ["--node-rank", str(i)] + run, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in (1, 0)]
    try:
        return nodes, [node.communicate(timeout=timeout) for node in nodes]
    except subprocess.TimeoutExpired:
        for node in nodes:
            node.kill()
            node.communicate()
        return nodes, None


def test_torchrun_on_two_machines_gives_the_single_process_tokens(tiny_checkpoint, tmp_path):
    """Two "machines" (torchrun --nnodes 2, one process each) over the loopback address."""
    path = tiny_checkpoint("llama")
    # a free port is only free until someone binds it: in a full run the two nodes once waited for 300 s (alone
    # the test takes 17 s; most likely another worker's server took the port), so a run that hangs is tried
    # once more on another port; one that finishes is judged as it is
    for _attempt in range(2):
        nodes, outputs = _torchrun_two_nodes(path, timeout=150)
        if outputs is not None:
            break
    assert outputs is not None, "torchrun hung twice"
    assert [node.returncode for node in nodes] == [0, 0], outputs[1][1][-2000:]
    single = LLM(path, max_batch_size=2, max_seq_len=48)
    want = single.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=8))[0].outputs[0].token_ids
    assert " ".join(map(str, want)) in outputs[1][0]  # node 0 is rank 0: it prints the tokens
    assert outputs[0][0] == ""  # the other machine prints nothing


def test_sharded_graphs_compile_with_torch_compile(tiny_checkpoint):
    """The collectives are opaque ops with fake implementations: every rank's decode and prefill graphs
    compile with Inductor (the warm-up runs the same shapes on every rank, so their collectives meet)."""
    path = tiny_checkpoint("llama")
    params = SamplingParams(temperature=0.0, max_tokens=8)
    want = [o.outputs[0].token_ids for o in LLM(path, **ARGS).generate(PROMPTS, params)]
    compiled = {"transforms.compile_model.backend": "torch-compile",
                "transforms.compile_model.capture_batch_sizes": [1, 2]}
    with LLM(path, world_size=2, overrides=compiled, **ARGS) as llm:
        assert type(llm.module.local).__name__ == "DecodeDispatch"
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert got == want
