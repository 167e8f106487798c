"""The GGUF writer (``autodeploy.gguf_export``) read back with ``gguf.GGUFReader``, llama.cpp's greedy tokens
against HF's on the F32 file (where llama-cpp-python is installed), and ``bench --compare llama.cpp``'s
errors."""

import json

import numpy as np
import pytest
import torch

from autodeploy.cli import main
from autodeploy.errors import AutoDeployError
from tiny_models import save_tiny_checkpoint

gguf = pytest.importorskip("gguf", reason="the GGUF writer needs the optional 'gguf' package")

from autodeploy.gguf_export import cached_gguf, permute_rope_rows, write_gguf  # noqa: E402

N_LAYERS, N_HEAD, N_KV = 2, 4, 2  # tiny_models' llama
METADATA = ["general.architecture", "llama.context_length", "llama.embedding_length", "llama.block_count",
            "llama.feed_forward_length", "llama.attention.head_count", "llama.attention.head_count_kv",
            "llama.rope.freq_base", "llama.rope.dimension_count", "llama.attention.layer_norm_rms_epsilon",
            "general.file_type", "tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.scores",
            "tokenizer.ggml.token_type"]


def _hf_state(path):
    from safetensors.torch import load_file

    return {k: v.float().numpy() for k, v in load_file(path / "model.safetensors").items()}


def _expected(state):
    """GGUF name -> the original tensor as llama.cpp expects it (q/k rows permuted)."""
    out = {"token_embd.weight": state["model.embed_tokens.weight"], "output_norm.weight": state["model.norm.weight"],
           "output.weight": state["lm_head.weight"]}
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(N_LAYERS):
        for hf, gg in names.items():
            w = state[f"model.layers.{i}.{hf}.weight"]
            if gg == "attn_q":
                w = permute_rope_rows(w, N_HEAD)
            elif gg == "attn_k":
                w = permute_rope_rows(w, N_KV)
            out[f"blk.{i}.{gg}.weight"] = w
    return out


def _field(reader, key):
    field = reader.fields[key]
    return field.contents() if hasattr(field, "contents") else field.parts[field.data[0]]


@pytest.mark.parametrize("gguf_type", ["F32", "F16", "Q8_0", "Q4_0"])
def test_write_read_back(tiny_checkpoint, tmp_path, gguf_type):
    path = tiny_checkpoint("llama")
    out = tmp_path / f"tiny-{gguf_type}.gguf"
    summary = write_gguf(path, out, gguf_type)
    assert summary["tensors"] == 3 + 9 * N_LAYERS and summary["vocab"] == "placeholder"
    reader = gguf.GGUFReader(out)
    for key in METADATA:
        assert key in reader.fields, key
    assert _field(reader, "general.architecture") == "llama"
    assert _field(reader, "llama.attention.head_count_kv") == N_KV
    assert _field(reader, "llama.block_count") == N_LAYERS
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == 128  # vocab_size tokens, all distinct
    assert len(set(_field(reader, "tokenizer.ggml.tokens"))) == 128

    expected = _expected(_hf_state(path))
    assert {t.name for t in reader.tensors} == set(expected)
    Q = gguf.GGMLQuantizationType
    for t in reader.tensors:
        want = expected[t.name]
        assert tuple(int(d) for d in t.shape) == tuple(reversed(want.shape)), t.name  # GGUF lists ne0 first
        if want.ndim == 1 or gguf_type == "F32":
            assert t.tensor_type == Q.F32, t.name
            np.testing.assert_array_equal(np.asarray(t.data).reshape(want.shape), want, err_msg=t.name)
            continue
        assert t.tensor_type == getattr(Q, gguf_type), t.name
        got = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(want.shape)
        # per 32-element block: Q8_0 rounds to amax/127 steps (error <= half a step), Q4_0 to amax/8 steps
        # (error <= one step: the top value clips to 7); F16 to its 11-bit mantissa; scales are stored in f16
        blocks = want.reshape(-1, 32)
        amax = np.abs(blocks).max(axis=1, keepdims=True)
        step = {"F16": np.abs(blocks) * 2.0**-11, "Q8_0": amax / 254, "Q4_0": amax / 8}[gguf_type]
        err = np.abs(got.reshape(-1, 32) - blocks)
        assert (err <= step + amax * 2e-3 + 1e-12).all(), t.name
        if gguf_type != "F16":
            assert err.max() > 0  # it really is quantized


def test_permutation_interleaves_rotate_half_pairs():
    head_dim, n_head = 8, 2
    w = np.arange(n_head * head_dim, dtype=np.float32)[:, None].repeat(3, axis=1)  # row r holds r
    rows = permute_rope_rows(w, n_head)[:, 0].astype(int).tolist()
    # per head: HF pairs row j with row j + head_dim/2; GGUF puts them at 2j, 2j+1
    assert rows == [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]
    bias = np.arange(n_head * head_dim, dtype=np.float32)
    assert permute_rope_rows(bias, n_head).astype(int).tolist() == rows


def test_tied_embeddings_and_cache(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("llama", tie_word_embeddings=True)
    first, write_s = cached_gguf(path, "q8_0", tmp_path)
    assert write_s is not None and first.name.endswith("-q8_0.gguf")
    again, write_s = cached_gguf(path, "Q8_0", tmp_path)
    assert again == first and write_s is None  # written once, then reused
    names = {t.name for t in gguf.GGUFReader(first).tensors}
    assert "token_embd.weight" in names and "output.weight" not in names  # llama.cpp reuses the embedding


def test_mistral_and_rope_scaling(tiny_checkpoint, tmp_path):
    write_gguf(tiny_checkpoint("mistral"), tmp_path / "m.gguf", "F16")
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 500000.0}
    path = save_tiny_checkpoint(tmp_path / "l3", "llama", rope_parameters=scaling)
    write_gguf(path, tmp_path / "l3.gguf", "F32")
    tensors = {t.name: t for t in gguf.GGUFReader(tmp_path / "l3.gguf").tensors}
    assert tuple(tensors["rope_freqs.weight"].shape) == (8,)  # head_dim / 2 frequency factors


def test_unsupported_model_type(tiny_checkpoint, tmp_path):
    with pytest.raises(AutoDeployError, match="model_type 'qwen2'"):
        write_gguf(tiny_checkpoint("qwen2"), tmp_path / "q.gguf", "F32")
    with pytest.raises(AutoDeployError, match="GGUF type 'Q5_K'"):
        write_gguf(tiny_checkpoint("llama"), tmp_path / "q.gguf", "Q5_K")


def test_real_tokenizer_vocab(tiny_checkpoint, tmp_path):
    """A BPE tokenizer.json's tokens and merges are carried over (gpt2 tokenizer in llama.cpp's terms)."""
    import shutil

    src = tiny_checkpoint("llama")
    path = tmp_path / "ckpt"
    shutil.copytree(src, path)
    vocab = {f"t{i}": i for i in range(120)}
    merges = ["t 1"]
    (path / "tokenizer.json").write_text(json.dumps({
        "model": {"type": "BPE", "vocab": vocab, "merges": merges},
        "added_tokens": [{"id": 120, "content": "<|end|>", "special": True}]}))
    write_gguf(path, tmp_path / "v.gguf", "F32")
    reader = gguf.GGUFReader(tmp_path / "v.gguf")
    assert _field(reader, "tokenizer.ggml.model") == "gpt2"
    tokens = _field(reader, "tokenizer.ggml.tokens")
    assert len(tokens) == 128 and tokens[5] == "t5" and tokens[120] == "<|end|>" and tokens[127] == "[PAD127]"
    assert _field(reader, "tokenizer.ggml.merges") == merges


# -- llama.cpp itself --------------------------------------------------------------------------------
def test_llamacpp_f32_greedy_matches_hf(tiny_checkpoint, tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (optional)")
    from autodeploy.bench import llamacpp_last_logits
    from tiny_models import hf_reference, random_batch

    path = tiny_checkpoint("llama")
    write_gguf(path, tmp_path / "f32.gguf", "F32")
    prompts, _ = random_batch(2, 12, seed=3)
    hf = hf_reference(path)
    n_new = 16
    with torch.no_grad():
        ref = hf.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False, max_new_tokens=n_new,
                          min_new_tokens=n_new, pad_token_id=0)[:, prompts.shape[1]:].tolist()
        ref_logits = hf(prompts[:1]).logits[0, -1].numpy()
    llm = llama_cpp.Llama(model_path=str(tmp_path / "f32.gguf"), n_ctx=64, n_batch=64, n_threads=1,
                          logits_all=False, verbose=False)
    for row, want in zip(prompts.tolist(), ref):
        llm.reset()
        llm.eval(row)
        if row == prompts[0].tolist():  # the prompt's last logits: the same model, not just the same argmax
            np.testing.assert_allclose(llamacpp_last_logits(llm), ref_logits, atol=1e-4, rtol=0)
        got = []
        for _ in range(n_new):
            got.append(int(np.argmax(llamacpp_last_logits(llm))))
            llm.eval([got[-1]])
        assert got == want


# -- bench --compare llama.cpp errors ----------------------------------------------------------------
def test_compare_llamacpp_bad_flags(tiny_checkpoint, capsys):
    rc = main(["bench", "--model", str(tiny_checkpoint("qwen2")), "--compare", "llama.cpp"])
    assert rc == 2
    err = capsys.readouterr().err
    assert ("model_type 'qwen2'" in err) or ("llama-cpp-python" in err)  # whichever check comes first here
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--model", str(tiny_checkpoint("llama")), "--compare", "llama.cpp", "--gguf-type", "q5_k"])
    assert exc.value.code == 2


def test_gguf_type_of_the_run(tiny_checkpoint):
    from autodeploy.bench import BenchArgs, gguf_type_for

    args = BenchArgs(model=str(tiny_checkpoint("llama")), batch_size=1, isl=4, osl=2)
    assert gguf_type_for(args) == "F32"
    assert gguf_type_for(args, "q4_0") == "Q4_0"
    args.overrides = {"transforms.quantize_weights.enabled": True}
    assert gguf_type_for(args) == "Q8_0"
    args.overrides = {"dtype": "bfloat16"}
    assert gguf_type_for(args) == "F16"


def test_bench_compare_llamacpp_json(tiny_checkpoint, tmp_path, capsys):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (optional)")
    rc = main(["bench", "--model", str(tiny_checkpoint("llama")), "--batch-size", "2", "--isl", "8", "--osl", "4",
               "--warmup-osl", "1", "--runs", "3", "--compare", "llama.cpp", "--gguf-dir", str(tmp_path), "--json"])
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    ref = result["llama.cpp"]
    assert ref["gguf_type"] == "F32" and ref["sequential"] is True and ref["gguf_write_s"] > 0
    assert ref["output_tok_s"] == pytest.approx(2 * 4 / ref["total_s"])
    assert len(ref["run_totals_s"]) == 3 and ref["total_s"] == ref["run_totals_s"][1]
    assert result["ratios"]["output_tok_s"] == pytest.approx(result["autodeploy"]["output_tok_s"] / ref["output_tok_s"])
    assert result["greedy_tokens_identical"] is True and result["greedy_matching_prefix"] == 1.0
    # the table form says the sequences ran one after another, and the file came from the cache this time
    assert main(["bench", "--model", str(tiny_checkpoint("llama")), "--batch-size", "2", "--isl", "8", "--osl", "2",
                 "--warmup-osl", "0", "--runs", "1", "--compare", "llama.cpp", "--gguf-dir", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert "one after another" in table and "(cached)" in table and "llama.cpp" in table.splitlines()[1]


def test_the_bench_writes_the_gguf_in_a_child_process(tiny_checkpoint, tmp_path, monkeypatch):
    """The writer maps the whole checkpoint: in the bench's own process those pages would count in the autodeploy
    side's peak memory, so a child process writes the file (a writer that fails here is never called), and the
    next run finds it in the cache."""
    from autodeploy import bench, gguf_export

    def not_here(*args, **kwargs):
        raise AssertionError("the GGUF file was written in the bench's process")

    monkeypatch.setattr(gguf_export, "write_gguf", not_here)
    path = tiny_checkpoint("llama")
    written, write_s = bench._cached_gguf_in_child(str(path), "Q8_0", str(tmp_path))
    assert write_s > 0 and written == gguf_export.gguf_cache_path(path, "q8_0", tmp_path)
    assert {t.name for t in gguf.GGUFReader(written).tensors} >= {"token_embd.weight", "output.weight"}
    assert bench._cached_gguf_in_child(str(path), "Q8_0", str(tmp_path)) == (written, None)
