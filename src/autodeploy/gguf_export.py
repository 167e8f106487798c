"""Write a Llama-family HF checkpoint (``config.json`` + ``*.safetensors``) as a GGUF file for llama.cpp.

    from autodeploy.gguf_export import write_gguf
    write_gguf("llama-125m", "llama-125m-q8_0.gguf", "Q8_0")     # F32, F16, Q8_0 or Q4_0

Needs the ``gguf`` package (``pip install 'autodeploy[llamacpp]'``), not a core dependency. Supported:
``model_type`` llama and mistral (llama.cpp's ``llama`` architecture); any other raises an
:class:`~autodeploy.errors.AutoDeployError` naming it.

What it writes:

- metadata: architecture, context length, embedding / feed-forward sizes, layer count, heads, KV heads,
  head dim, RoPE base and dimension (and ``linear`` / ``llama3`` RoPE scaling), RMSNorm epsilon, file type;
- tensors under llama.cpp's names (``token_embd``, ``blk.N.attn_q``, ..., ``output``). HF keeps q/k
  projections in the rotate-half RoPE layout (dims ``[0, d/2)`` pair with ``[d/2, d)``); llama.cpp's llama
  graph applies RoPE to interleaved pairs (``2i``, ``2i+1``), so the rows of ``q_proj`` / ``k_proj`` (and
  their biases) are permuted per head, as llama.cpp's own converter does;
- precision: 1-D tensors (norms, biases) always F32; 2-D weights in the requested type (Q8_0 / Q4_0 rows
  whose length is not a multiple of the 32-element block fall back to F16);
- the vocabulary: the checkpoint's tokenizer where it is a simple one (a ``tokenizer.json`` whose model is
  BPE, written as llama.cpp's ``gpt2`` tokenizer with its merges, or a sentencepiece-style vocabulary with
  ``▁`` pieces and ``<0xNN>`` byte tokens, written as ``llama``), otherwise a placeholder ``llama``
  vocabulary of ``vocab_size`` tokens (``<unk>``, ``<s>``, ``</s>``, the 256 byte tokens, ``<tok_N>``) so
  that llama.cpp loads checkpoints without a tokenizer, such as the benchmark's (it is driven by token
  ids, so the vocabulary's text does not matter there).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from .errors import AutoDeployError

#: GGUF tensor types this writer produces
GGUF_TYPES = ("F32", "F16", "Q8_0", "Q4_0")
SUPPORTED_MODEL_TYPES = ("llama", "mistral")
INSTALL_HINT = "pip install 'gguf>=0.16'  (or: pip install 'autodeploy[llamacpp]')"
#: bump when the written file changes for the same checkpoint (invalidates the cache)
WRITER_VERSION = 1

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate_proj.bias": "ffn_gate.bias",
    "mlp.up_proj.bias": "ffn_up.bias",
    "mlp.down_proj.bias": "ffn_down.bias",
}
_TOP_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def _gguf():
    try:
        import gguf
    except ImportError:
        raise AutoDeployError(f"GGUF export needs the 'gguf' package: {INSTALL_HINT}") from None
    return gguf


# -- the checkpoint ------------------------------------------------------------------------------------
def read_config(model: str | os.PathLike) -> dict[str, Any]:
    """The checkpoint's ``config.json`` (its ``text_config`` for multimodal wrappers), checked to be a
    model_type this writer supports."""
    path = Path(model) / "config.json"
    if not path.is_file():
        raise AutoDeployError(f"{model}: not a checkpoint folder (no config.json)")
    config = json.loads(path.read_text())
    config = config.get("text_config", config) if isinstance(config.get("text_config"), dict) else config
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise AutoDeployError(f"GGUF export supports model_type {', '.join(SUPPORTED_MODEL_TYPES)}; "
                              f"{model} has model_type {model_type!r}")
    return config


def _rope(config: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """RoPE base and the scaling parameters (transformers 5 ``rope_parameters`` or older ``rope_scaling``)."""
    params = dict(config.get("rope_parameters") or {})
    scaling = dict(config.get("rope_scaling") or {})
    theta = config.get("rope_theta", params.get("rope_theta", 10000.0))
    merged = {**scaling, **params}
    merged.pop("rope_theta", None)
    kind = merged.get("rope_type", merged.get("type", "default"))
    return float(theta), ({} if kind in (None, "default") else {**merged, "rope_type": kind})


def _safetensors_files(model: Path) -> list[Path]:
    files = sorted(model.glob("*.safetensors"))
    if not files:
        raise AutoDeployError(f"{model}: no *.safetensors weights to write as GGUF")
    return files


def _iter_checkpoint(model: Path) -> Iterator[tuple[str, Any]]:
    """(HF name, lazy slice) of every tensor of every safetensors file."""
    from safetensors import safe_open

    for file in _safetensors_files(model):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, (file, name)


def _load(ref: tuple[Path, str]) -> np.ndarray:
    import torch
    from safetensors import safe_open

    file, name = ref
    with safe_open(file, framework="pt") as f:
        return f.get_tensor(name).to(torch.float32).numpy()


def permute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Rows of a q/k projection (or its bias) from HF's rotate-half layout to GGUF's interleaved one:
    per head, row ``j`` of the first half and row ``j`` of the second half become rows ``2j`` and ``2j+1``."""
    rows = w.shape[0]
    return (w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def _gguf_name(hf_name: str, n_layers: int) -> str | None:
    """llama.cpp's tensor name for an HF one; None for tensors llama.cpp does not read (rotary buffers)."""
    if hf_name.endswith("rotary_emb.inv_freq"):
        return None
    if hf_name in _TOP_NAMES:
        return _TOP_NAMES[hf_name]
    parts = hf_name.split(".")
    if len(parts) > 3 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        rest = ".".join(parts[3:])
        if rest in _LAYER_NAMES and int(parts[2]) < n_layers:
            return f"blk.{int(parts[2])}.{_LAYER_NAMES[rest]}"
    raise AutoDeployError(f"GGUF export: checkpoint tensor {hf_name!r} has no llama.cpp counterpart")


def _tensor_type(gguf, name: str, shape: tuple[int, ...], gguf_type: str):
    Q = gguf.GGMLQuantizationType
    if len(shape) < 2 or gguf_type == "F32":
        return Q.F32
    if gguf_type == "F16":
        return Q.F16
    qtype = Q.Q8_0 if gguf_type == "Q8_0" else Q.Q4_0
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    return qtype if shape[-1] % block == 0 else Q.F16


def _encode(gguf, data: np.ndarray, qtype) -> np.ndarray:
    Q = gguf.GGMLQuantizationType
    if qtype == Q.F32:
        return np.ascontiguousarray(data, dtype=np.float32)
    if qtype == Q.F16:
        return np.ascontiguousarray(data, dtype=np.float16)
    return gguf.quants.quantize(np.ascontiguousarray(data, dtype=np.float32), qtype)


# -- the vocabulary ------------------------------------------------------------------------------------
def _placeholder_vocab(vocab_size: int) -> tuple[list[str], list[float], list[int]]:
    specials = ["<unk>", "<s>", "</s>"][:vocab_size]
    tokens = list(specials)
    types = [2, 3, 3][:len(specials)]  # UNKNOWN, CONTROL, CONTROL
    if vocab_size >= len(tokens) + 256:
        tokens += [f"<0x{b:02X}>" for b in range(256)]
        types += [6] * 256  # BYTE
    rest = vocab_size - len(tokens)
    tokens += [f"<tok_{i}>" for i in range(len(tokens), len(tokens) + rest)]
    types += [1] * rest  # NORMAL
    scores = [0.0] * len(specials) + [-float(i) for i in range(len(tokens) - len(specials))]
    return tokens, scores, types


def _real_vocab(model: Path, vocab_size: int) -> dict[str, Any] | None:
    """The vocabulary of the checkpoint's ``tokenizer.json`` when it is simple enough to carry over (a BPE
    or sentencepiece-style model with at most ``vocab_size`` ids); None otherwise."""
    path = model / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    tok_model = data.get("model") or {}
    vocab = tok_model.get("vocab")
    if tok_model.get("type") != "BPE" or not isinstance(vocab, dict):
        return None
    id_to_tok: dict[int, str] = {int(i): t for t, i in vocab.items()}
    special_ids = set()
    for added in data.get("added_tokens") or []:
        id_to_tok[int(added["id"])] = added["content"]
        if added.get("special"):
            special_ids.add(int(added["id"]))
    if not id_to_tok or max(id_to_tok) >= vocab_size:
        return None
    tokens, types = [], []
    for i in range(vocab_size):
        if i in id_to_tok:
            tokens.append(id_to_tok[i])
            types.append(3 if i in special_ids else (6 if _is_byte_token(id_to_tok[i]) else 1))
        else:
            tokens.append(f"[PAD{i}]")
            types.append(5)  # UNUSED
    sentencepiece = "<0x0A>" in vocab and any("\u2581" in t for t in list(vocab)[:2000])
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok_model.get("merges") or []]
    return {"model": "llama" if sentencepiece else "gpt2", "tokens": tokens, "types": types, "merges": merges,
            "scores": [-float(i) for i in range(vocab_size)] if sentencepiece else None}


def _is_byte_token(tok: str) -> bool:
    return len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">")


def _add_vocab(writer, model: Path, config: dict[str, Any]) -> str:
    vocab_size = int(config["vocab_size"])
    real = _real_vocab(model, vocab_size)
    if real is not None:
        writer.add_tokenizer_model(real["model"])
        if real["model"] == "gpt2":
            writer.add_tokenizer_pre("default")
        writer.add_token_list(real["tokens"])
        writer.add_token_types(real["types"])
        if real["scores"] is not None:
            writer.add_token_scores(real["scores"])
        if real["merges"]:
            writer.add_token_merges(real["merges"])
        kind = f"tokenizer.json ({real['model']})"
    else:
        tokens, scores, types = _placeholder_vocab(vocab_size)
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_unk_token_id(0)
        kind = "placeholder"
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id)):
        value = config.get(key)
        value = value[0] if isinstance(value, list) and value else value
        if isinstance(value, int) and 0 <= value < vocab_size:
            add(value)
    writer.add_add_bos_token(False)
    return kind


def _llama3_rope_factors(theta: float, head_dim: int, scaling: dict[str, Any]) -> np.ndarray:
    factor = float(scaling.get("factor", 8.0))
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


# -- the writer ----------------------------------------------------------------------------------------
def write_gguf(model: str | os.PathLike, out: str | os.PathLike, gguf_type: str = "F32") -> dict[str, Any]:
    """Write checkpoint folder ``model`` as the GGUF file ``out`` with 2-D weights in ``gguf_type``.

    Tensors are converted and written one at a time (peak memory about one tensor, not the model).
    Returns a summary: ``path``, ``gguf_type``, ``bytes``, ``tensors`` (count), ``vocab`` (its source)."""
    gguf_type = gguf_type.upper()
    if gguf_type not in GGUF_TYPES:
        raise AutoDeployError(f"GGUF type {gguf_type!r}: expected one of {', '.join(GGUF_TYPES)}")
    gguf = _gguf()
    model = Path(model)
    config = read_config(model)
    n_layers = int(config["num_hidden_layers"])
    n_embd = int(config["hidden_size"])
    n_head = int(config["num_attention_heads"])
    n_kv = int(config.get("num_key_value_heads") or n_head)
    head_dim = int(config.get("head_dim") or n_embd // n_head)
    theta, scaling = _rope(config)
    if config.get("hidden_act", "silu") != "silu":
        raise AutoDeployError(f"GGUF export: hidden_act {config.get('hidden_act')!r} (llama.cpp's llama uses silu)")

    writer = gguf.GGUFWriter(None, "llama")
    writer.add_name(model.name)
    writer.add_context_length(int(config.get("max_position_embeddings", 2048)))
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layers)
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    writer.add_vocab_size(int(config["vocab_size"]))
    file_types = {"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
                  "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}
    writer.add_file_type(file_types[gguf_type])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    extra: list[tuple[str, np.ndarray]] = []
    kind = scaling.get("rope_type")
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(scaling["factor"]))
    elif kind == "llama3":
        extra.append(("rope_freqs.weight", _llama3_rope_factors(theta, head_dim, scaling)))
    elif kind is not None:
        raise AutoDeployError(f"GGUF export: RoPE scaling {kind!r} is not supported (default, linear, llama3)")
    vocab_kind = _add_vocab(writer, model, config)

    # pass 1: names, shapes and types (no data), so the header can be written before the tensors
    plan: list[tuple[str, Any, Any, tuple[int, ...]]] = []
    from safetensors import safe_open

    for hf_name, ref in _iter_checkpoint(model):
        name = _gguf_name(hf_name, n_layers)
        if name is None:
            continue
        with safe_open(ref[0], framework="pt") as f:
            shape = tuple(f.get_slice(hf_name).get_shape())
        plan.append((name, ref, _tensor_type(gguf, name, shape, gguf_type), shape))
    for name, data in extra:
        plan.append((name, data, gguf.GGMLQuantizationType.F32, data.shape))
    names = {p[0] for p in plan}
    if "token_embd.weight" not in names:
        raise AutoDeployError(f"GGUF export: {model} has no model.embed_tokens.weight")
    order = {"token_embd.weight": 0, "rope_freqs.weight": 1, "output_norm.weight": 2, "output.weight": 3}
    plan.sort(key=lambda p: (order.get(p[0], 4), _block_key(p[0])))
    for name, _, qtype, shape in plan:
        byte_shape = gguf.quant_shape_to_byte_shape(shape, qtype) if qtype not in (0, 1) else shape
        itemsize = 4 if qtype == gguf.GGMLQuantizationType.F32 else 2 if qtype == gguf.GGMLQuantizationType.F16 else 1
        dtype = {4: np.float32, 2: np.float16, 1: np.uint8}[itemsize]
        writer.add_tensor_info(name, byte_shape, np.dtype(dtype), int(np.prod(byte_shape)) * itemsize,
                               raw_dtype=qtype)

    tmp = Path(str(out) + ".part")  # written beside the target, renamed when complete
    try:
        writer.write_header_to_file(tmp)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for name, ref, qtype, _ in plan:
            data = ref if isinstance(ref, np.ndarray) else _load(ref)
            if name.endswith(("attn_q.weight", "attn_q.bias")):
                data = permute_rope_rows(data, n_head)
            elif name.endswith(("attn_k.weight", "attn_k.bias")):
                data = permute_rope_rows(data, n_kv)
            writer.write_tensor_data(_encode(gguf, data, qtype))
        writer.close()
        os.replace(tmp, out)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return {"path": str(out), "gguf_type": gguf_type, "bytes": Path(out).stat().st_size, "tensors": len(plan),
            "vocab": vocab_kind}


def _block_key(name: str) -> tuple[int, str]:
    parts = name.split(".")
    return (int(parts[1]), name) if parts[0] == "blk" else (-1, name)


# -- the cache -----------------------------------------------------------------------------------------
def gguf_cache_path(model: str | os.PathLike, gguf_type: str, cache: str | os.PathLike | None = None) -> Path:
    """Where :func:`cached_gguf` keeps the GGUF file of checkpoint ``model`` in ``gguf_type``: a name keyed by
    the checkpoint's files (names, sizes, mtimes), in ``cache`` (default ``$XDG_CACHE_HOME/autodeploy/gguf``,
    made here)."""
    from .utils.cache import cache_dir

    model = Path(model).resolve()
    read_config(model)  # unsupported model types fail before anything is written
    gguf_type = gguf_type.upper()
    key = hashlib.sha256()
    key.update(f"{model}|{gguf_type}|{WRITER_VERSION}".encode())
    for file in sorted(model.glob("*.json")) + _safetensors_files(model):
        stat = file.stat()
        key.update(f"|{file.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    folder = Path(cache) if cache is not None else cache_dir() / "gguf"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{model.name}-{key.hexdigest()[:16]}-{gguf_type.lower()}.gguf"


def cached_gguf(model: str | os.PathLike, gguf_type: str, cache: str | os.PathLike | None = None
                ) -> tuple[Path, float | None]:
    """The GGUF file of checkpoint ``model`` in ``gguf_type``, written once into ``cache`` (see
    :func:`gguf_cache_path`) and reused while the checkpoint's files are unchanged. Returns (path, seconds spent
    writing it, or None when it came from the cache)."""
    import time

    path = gguf_cache_path(model, gguf_type, cache)
    if path.is_file():
        return path, None
    start = time.perf_counter()
    write_gguf(Path(model).resolve(), path, gguf_type.upper())
    return path, time.perf_counter() - start
