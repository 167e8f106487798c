"""Architecture coverage: every decoder-only text LM in transformers' causal-LM mapping, end to end.

    python -m autodeploy.coverage [--only llama,mistral] [--timeout 120] [--write docs/models.md] [--json]

For each architecture: a tiny random-weight config (generic small sizes, then :data:`OVERRIDES`), saved to a
temporary folder, then, each step only when the one before passed:

- ``export``: the pipeline up to the export stage;
- ``canonical``: after pattern_matcher, the coverage line is complete (:func:`utils.coverage.measure_coverage`);
- ``logits``: after post_load_fusion, fp32 logits within 1e-4 of ``AutoModelForCausalLM.from_pretrained``;
- ``generate``: greedy tokens through :class:`autodeploy.LLM` (a KV cache of a few pages) identical to HF
  ``generate(do_sample=False)``, and their log-probabilities within :data:`LOGPROB_ATOL` of HF's;

and the first failure's reason (the exception's first line). Every architecture runs in its own process,
under a timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

STEPS = ("export", "canonical", "logits", "generate")
ATOL = 1e-4
#: generated tokens' log-probabilities against HF's: logits within ATOL move a log-softmax by up to 2 * ATOL
LOGPROB_ATOL = 2 * ATOL
VOCAB = 128
_MARK = "@@coverage-result@@ "

#: generic tiny sizes (names a config does not know are stored as plain attributes, harmless); position
#: tables longer than the pipeline's default max_seq_len (512), which export's seq dim ranges over
GENERIC: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=None, pad_token_id=0,
    num_local_experts=4, num_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
)

#: an override value that removes the generic key (a config whose property has no setter, e.g. falcon's head_dim)
DROP = "<drop>"

#: multi-head latent attention (DeepSeek-V2/V3 and kin): the generic head_dim=16 does not describe it. The
#: rotary embedding is sized by head_dim, which these configs mean to be qk_rope_head_dim; q/k heads are
#: nope + rope (24) wide, v heads 16 (a v head dim unlike the q/k one, as in the real models); kv_b_proj makes
#: every head, so num_key_value_heads must equal num_attention_heads (HF would repeat the heads otherwise).
#: Their MoE: the first layer dense, the second routed over 2 groups of 2 experts (the defaults, 8 groups and
#: 3 dense layers, leave no expert in a group and no MoE layer in 2)
_MLA: dict[str, Any] = dict(
    num_key_value_heads=4, qk_rope_head_dim=8, head_dim=8, qk_nope_head_dim=16, v_head_dim=16, kv_lora_rank=32,
    q_lora_rank=32, index_head_dim=16, index_n_heads=2, first_k_dense_replace=1, n_group=2, topk_group=1,
)

#: per-architecture overrides where the generic sizes do not fit
OVERRIDES: dict[str, dict[str, Any]] = {
    **{arch: _MLA for arch in ("deepseek_v3", "deepseek_v32", "glm4_moe_lite", "glm_moe_dsa", "minicpm3", "axk1",
                               "axk2", "youtu")},
    "longcat_flash": {**_MLA, "zero_expert_num": 2},  # 2 zero-computation experts beside the 4 routed ones
    "deepseek_v2": {**_MLA, "q_lora_rank": None},  # V2-Lite's q_proj without a low-rank q
    "sarvam_mla": {**_MLA, "q_lora_rank": None},
    "mistral": {"sliding_window": None},
    "mixtral": {"intermediate_size": 32},
    "qwen2_moe": {"shared_expert_intermediate_size": 48},
    "falcon": {"head_dim": DROP},
    "dbrx": {"head_dim": DROP, "d_model": 64, "n_heads": 4, "n_layers": 2,
             "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
             "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2}},
    "dots1": {"n_shared_experts": 1, "first_k_dense_replace": 1},
    "gemma3n_text": {"num_kv_shared_layers": 0},
    # windows shorter than the prompts, so the sliding-window layers are checked
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "window_size": 4},
    "granite_swa": {"sliding_window": 4},
    "granitemoe_swa": {"sliding_window": 4},
    "gptj": {"rotary_dim": 8, "n_embd": 64, "n_head": 4, "n_layer": 2, "n_positions": 1024},
    # a Mamba layer with a dense MLP, then an attention layer with MoE (the defaults put both 4 layers later)
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
    # Mamba-2 hybrids: a Mamba-2 layer (8 heads in 2 groups, state 16) and an attention layer
    "bamba": {"attn_layer_indices": [1], "mamba_n_heads": 8, "mamba_n_groups": 2, "mamba_d_state": 16},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"], "mamba_n_heads": 8,
                         "mamba_n_groups": 2, "mamba_d_state": 16, "shared_intermediate_size": 48},
    # a Mamba-2 layer and a hybrid layer (the shared attention block with its adapters, then Mamba-2)
    "zamba2": {"layers_block_type": ["linear_attention", "hybrid"], "n_mamba_heads": 8, "mamba_d_state": 16,
               "mamba_ngroups": 2},
    # a Mamba layer (2 heads) and a hybrid layer (the shared attention block, then Mamba)
    "zamba": {"layers_block_type": ["linear_attention", "hybrid"], "n_mamba_heads": 2, "mamba_d_state": 16},
    "nemotron_h": {"mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 16},
    # a short-convolution layer and an attention layer (the default for 2 layers has no conv layer)
    "lfm2": {"layer_types": ["conv", "full_attention"]},
    # a Gated DeltaNet layer (2 q/k heads serving 4 value heads) and an attention layer
    "qwen3_next": {"layer_types": ["linear_attention", "full_attention"], "linear_num_key_heads": 2,
                   "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16},
    "qwen3_5_text": {"layer_types": ["linear_attention", "full_attention"], "linear_num_key_heads": 2,
                     "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16},
    # a Kimi Delta Attention layer (4 heads of 16) and an attention layer
    "kimi_linear": {"layer_types": ["linear_attention", "full_attention"], "linear_num_heads": 4,
                    "linear_head_dim": 16},
    "qwen3_5_moe_text": {"layer_types": ["linear_attention", "full_attention"], "linear_num_key_heads": 2,
                         "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16},
    "lfm3": {"layer_types": ["conv", "full_attention"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "codegen": {"rotary_dim": 8, "n_embd": 64, "n_head": 4, "n_layer": 2, "n_positions": 1024, "n_ctx": 1024},
    # the configs' own validators: RoPE per layer type, MHA only, one expert per token, heads that fill
    # hidden_size * expand, the unembedding's unpadded rows within the vocab
    "cohere_compass_text": {"rope_parameters": {t: {"rope_type": "default", "rope_theta": 10000.0}
                                                for t in ("full_attention", "sliding_attention")}},
    "dots3_note_text": {"num_key_value_heads": 4},
    "zaya": {"num_experts_per_tok": 1},
    "mamba2": {"num_heads": 8, "n_groups": 1, "state_size": 16},
    "inkling2_text": {"unpadded_vocab_size": VOCAB},
    "inkling2_loop_text": {"unpadded_vocab_size": VOCAB},
    # fewer reasoning cycles (6 attention calls instead of 16): within the timeout, still high and low cycles
    "hrm_text": {"H_cycles": 1, "L_cycles": 2, "L_bp_cycles": [1]},
}


def tiny_config_kwargs(arch: str) -> dict[str, Any]:
    """The generic sizes with ``arch``'s overrides (a :data:`DROP` value removes the key)."""
    return {k: v for k, v in {**GENERIC, **OVERRIDES.get(arch, {})}.items() if v != DROP}

#: architectures of the mapping that are not decoder-only text LMs (masked-LM encoders usable as decoders,
#: the decoder half of an encoder-decoder)
NOT_DECODER_ONLY = frozenset({
    "bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra", "ernie", "megatron-bert",
    "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer", "xlm", "xlm-roberta", "xlm-roberta-xl",
    "xlnet", "xmod", "reformer", "trocr",
})
_NON_MODALITY_SUBCONFIGS = {"attn_config", "ffn_config"}  # dbrx, mpt: parts of a text model


def decoder_only_architectures() -> list[str]:
    """The model_types of transformers' causal-LM mapping that are decoder-only text models."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    archs = []
    for arch in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        if arch in NOT_DECODER_ONLY or arch not in CONFIG_MAPPING:
            continue
        cls = CONFIG_MAPPING[arch]
        if set(getattr(cls, "sub_configs", None) or {}) - _NON_MODALITY_SUBCONFIGS:  # vision / audio / enc-dec
            continue
        if getattr(cls, "is_encoder_decoder", False) is True:
            continue
        archs.append(arch)
    return archs


@dataclass
class Result:
    arch: str
    export: bool | None = None
    canonical: bool | None = None
    logits: bool | None = None
    generate: bool | None = None
    reason: str = ""
    seconds: float = 0.0


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]


def make_checkpoint(arch: str, path: Path, seed: int = 0) -> Path:
    import torch
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    config = CONFIG_MAPPING[arch](**tiny_config_kwargs(arch))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    return path


def check_architecture(arch: str, workdir: Path) -> Result:
    """All steps for ``arch`` in this process; a step's exception ends it, with its first line as reason."""
    result = Result(arch)
    start = time.perf_counter()
    try:
        path = make_checkpoint(arch, workdir / arch)
        result.reason = _run_steps(result, path)
    except Exception as exc:  # noqa: BLE001 - any failure of any step is a row of the table
        # each step sets its column False before it runs: the last False one is the step that raised
        failed = next((s for s in reversed(STEPS) if getattr(result, s) is False), "config")
        result.reason = f"{failed}: {_first_line(exc)}"
    result.seconds = round(time.perf_counter() - start, 1)
    return result


def _run_steps(result: Result, path: Path) -> str:
    import torch
    from transformers import AutoModelForCausalLM

    from . import LLM, SamplingParams, optimize
    from .utils.coverage import measure_coverage, rope_layer_count

    result.export = False
    optimize(path, until="export")
    result.export = True

    result.canonical = False
    mod = optimize(path, until="pattern_matcher")
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    text_config = reference.config.get_text_config()
    coverage = measure_coverage(mod, getattr(text_config, "num_hidden_layers", None), rope_layer_count(text_config))
    result.canonical = coverage.complete
    reason = "" if coverage.complete else coverage.line()

    result.logits = False
    mod = optimize(path, until="post_load_fusion")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 7), generator=gen)
    pos = torch.arange(7).expand(2, 7)
    with torch.no_grad():
        ours = mod(ids, pos)[0].float()
        ref = reference(ids).logits.float()
    diff = (ours - ref).abs().max().item()
    result.logits = diff <= ATOL
    if not result.logits:
        return f"logits: max |diff| {diff:.2e} > {ATOL:g}" + (f"; {reason}" if reason else "")

    result.generate = False
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (3, 9)]
    llm = LLM(path, max_batch_size=2, max_seq_len=64, kv_cache_config={"max_tokens": 64, "page_size": 16})
    with llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0))
    for prompt, out in zip(prompts, outs):
        t = torch.tensor([prompt])
        with torch.no_grad():
            hf = reference.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=8, do_sample=False,
                                    pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        hf_tokens = hf.sequences[0, len(prompt):].tolist()
        if out.outputs[0].token_ids != hf_tokens:
            return f"generate: tokens differ from HF ({out.outputs[0].token_ids} vs {hf_tokens})"
        # the tokens of a tiny random model barely react to a wrong cache or state: their log-probabilities do
        hf_logp = [torch.log_softmax(step[0].float(), -1)[tok].item() for step, tok in zip(hf.logits, hf_tokens)]
        diff = max(abs(a.logprob - b) for a, b in zip(out.outputs[0].logprobs, hf_logp))
        if diff > LOGPROB_ATOL:
            return f"generate: token log-probabilities {diff:.2e} from HF's (> {LOGPROB_ATOL:g})"
    result.generate = True
    return reason


def run_architecture(arch: str, timeout: float, threads: int | None = None) -> Result:
    """``arch`` in a child process under ``timeout`` seconds (``threads``: its torch threads)."""
    start = time.perf_counter()
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    try:
        proc = subprocess.run([sys.executable, "-m", "autodeploy.coverage", "--child", arch], capture_output=True,
                              text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return Result(arch, reason=f"timeout after {timeout:g} s", seconds=round(time.perf_counter() - start, 1))
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(_MARK):
            return Result(**json.loads(line[len(_MARK):]))
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return Result(arch, reason=f"crashed (exit {proc.returncode}): {tail[:200]}",
                  seconds=round(time.perf_counter() - start, 1))


def totals(results: Sequence[Result]) -> dict[str, int]:
    return {step: sum(bool(getattr(r, step)) for r in results) for step in STEPS}


def markdown(results: Sequence[Result]) -> str:
    mark = {True: "yes", False: "**no**", None: "-"}
    total = totals(results)
    n = len(results)
    lines = [
        "# Model coverage",
        "",
        "Generated by `python -m autodeploy.coverage --write docs/models.md`: every decoder-only text architecture",
        "of transformers' causal-LM mapping, as a tiny random-weight config (fp32). Columns: the pipeline exports;",
        "the pattern matcher canonicalizes all of it (the coverage line without warning); logits after",
        f"post_load_fusion within {ATOL:g} of HF; greedy tokens through `LLM.generate` (paged KV cache) identical to",
        f"HF `generate`, with their log-probabilities within {LOGPROB_ATOL:g} of HF's. `-`: not reached (an earlier",
        "step failed).",
        "",
        f"**Totals ({n} architectures): export {total['export']}/{n}, canonical {total['canonical']}/{n}, "
        f"logits {total['logits']}/{n}, generate {total['generate']}/{n}.**",
        "",
        "| architecture | export | canonical | logits | generate | reason |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        reason = r.reason.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r.arch} | " + " | ".join(mark[getattr(r, s)] for s in STEPS) + f" | {reason} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autodeploy.coverage", description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=None, help="comma-separated architectures (model_type) to run")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per architecture (default 180)")
    parser.add_argument("--write", default=None, metavar="FILE", help="write the markdown table (e.g. docs/models.md)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of the table")
    parser.add_argument("--jobs", type=int, default=1, help="architectures at once, one torch thread each (default 1)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        with tempfile.TemporaryDirectory() as tmp:
            result = check_architecture(args.child, Path(tmp))
        print(_MARK + json.dumps(asdict(result)), flush=True)
        return 0

    archs = decoder_only_architectures()
    if args.only:
        wanted = [a.strip() for a in args.only.split(",") if a.strip()]
        unknown = [a for a in wanted if a not in archs]
        if unknown:
            print(f"coverage: not a decoder-only causal-LM architecture: {', '.join(unknown)}", file=sys.stderr)
            return 2
        archs = wanted
    from concurrent.futures import ThreadPoolExecutor

    def one(arch: str) -> Result:
        result = run_architecture(arch, args.timeout, threads=1 if args.jobs > 1 else None)
        flags = " ".join(f"{s}={'-' if getattr(result, s) is None else int(bool(getattr(result, s)))}" for s in STEPS)
        print(f"coverage: {arch:24s} {flags}  ({result.seconds} s) {result.reason}", file=sys.stderr, flush=True)
        return result

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(one, archs))  # in the mapping's order
    if args.write:
        Path(args.write).write_text(markdown(results))
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2))
    else:
        print(markdown(results), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
