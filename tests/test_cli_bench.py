"""`autodeploy bench`: the figures it reports (against HF in the same run) and its argument errors."""

import json
import sys

import pytest

from autodeploy.cli import main

FIGURES = {"build_s", "ttft_s", "prefill_tok_s", "decode_tok_s", "output_tok_s", "total_s", "peak_rss_bytes",
           "weight_bytes", "weight_bw_gb_s"}


@pytest.mark.slow  # runs the HF benchmark (bench --compare hf)
def test_bench_json_with_hf_comparison(tiny_checkpoint, capsys):
    path = tiny_checkpoint("llama")
    rc = main(["bench", "--model", str(path), "--batch-size", "2", "--isl", "8", "--osl", "3", "--warmup-osl", "1",
               "--runs", "3", "--compare", "hf", "--json"])
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    assert result["config"]["batch_size"] == 2 and result["config"]["isl"] == 8 and result["config"]["osl"] == 3
    assert result["config"]["page_cache"] == "cold"  # dropped before each side built
    for side in ("autodeploy", "hf"):
        assert FIGURES <= set(result[side]), side
        figures = result[side]
        assert figures["ttft_s"] > 0 and figures["total_s"] >= figures["ttft_s"]
        assert figures["output_tok_s"] == pytest.approx(2 * 3 / figures["total_s"])
        assert figures["prefill_tok_s"] == pytest.approx(2 * 8 / figures["ttft_s"])
        assert figures["peak_rss_bytes"] > figures["weight_bytes"] > 0
        # the reported run is the median of the three measured ones
        totals = figures["run_totals_s"]
        assert len(totals) == 3 and totals == sorted(totals) and figures["total_s"] == totals[1]
    assert result["autodeploy"]["weight_bytes"] == result["hf"]["weight_bytes"]  # same checkpoint, fp32
    assert {"prefill_tok_s", "decode_tok_s", "output_tok_s", "ttft_s"} <= set(result["ratios"])
    assert result["ratios"]["output_tok_s"] == pytest.approx(
        result["autodeploy"]["output_tok_s"] / result["hf"]["output_tok_s"])
    assert result["greedy_tokens_identical"] is True


def test_every_bench_run_prefills_its_whole_prompts(tiny_checkpoint, capsys):
    """Each run has prompts of its own: none is served from the pages an earlier run left in the prefix cache
    (HF recomputes every prompt, so a hit would flatter the time to first token). With pages of 4 tokens,
    the 8-token prompts of one set repeated across runs gave 4 hit tokens per prompt and run."""
    path = tiny_checkpoint("llama")
    rc = main(["bench", "--model", str(path), "--batch-size", "2", "--isl", "8", "--osl", "2", "--warmup-osl", "1",
               "--runs", "2", "--set", "transforms.insert_cached_attention.page_size=4", "--json"])
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    assert result["autodeploy"]["prefix_cache_hit_tokens"] == 0


def test_bench_run_prompts_differ_between_runs():
    from autodeploy.bench import run_prompts

    sets = run_prompts(batch_size=2, isl=16, vocab_size=1000, seed=0, runs=3)
    assert len(sets) == 4 and all(len(s) == 2 and all(len(p) == 16 for p in s) for s in sets)
    flat = [tuple(p) for s in sets for p in s]
    assert len(set(flat)) == len(flat)  # warm-up and every measured run: prompts of their own
    assert sets == run_prompts(batch_size=2, isl=16, vocab_size=1000, seed=0, runs=3)  # seeded


@pytest.mark.parametrize("argv, message", [
    (["--batch-size", "0"], "--batch-size must be an integer >= 1"),
    (["--osl", "-1"], "--osl must be an integer >= 1"),
    (["--runs", "0"], "--runs must be an integer >= 1"),
    (["--num-threads", "0"], "--num-threads must be >= 1"),
])
def test_bench_bad_values(tiny_checkpoint, capsys, argv, message):
    assert main(["bench", "--model", str(tiny_checkpoint("llama")), *argv]) == 2
    assert message in capsys.readouterr().err


def test_bench_bad_model_and_flags(tmp_path, capsys):
    assert main(["bench", "--model", str(tmp_path)]) == 2
    assert "not a checkpoint folder" in capsys.readouterr().err
    assert main(["bench"]) == 2
    assert "no model given" in capsys.readouterr().err
    for argv in (["--compare", "vllm"], ["--isl", "x"]):
        with pytest.raises(SystemExit) as exc:
            main(["bench", "--model", str(tmp_path), *argv])
        assert exc.value.code == 2
    assert "invalid choice: 'vllm'" in capsys.readouterr().err


def test_compare_llamacpp_missing_package(tiny_checkpoint, capsys, monkeypatch):
    """llama-cpp-python is optional: without it --compare llama.cpp fails at once, with the install command."""
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # find_spec: not installed
    rc = main(["bench", "--model", str(tiny_checkpoint("llama")), "--compare", "llama.cpp", "--isl", "4",
               "--osl", "2"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "needs the 'llama-cpp-python' package" in err and "pip install llama-cpp-python" in err
    assert err.count("\n") == 1  # one message, no traceback
