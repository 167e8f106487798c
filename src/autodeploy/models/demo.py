"""The embedded demo model: a tiny random-weight Llama with a character-level tokenizer, built locally
(no download) and cached under ``~/.cache/autodeploy`` (``$XDG_CACHE_HOME/autodeploy``), so that
``autodeploy run --prompt "hello"`` works offline without ``--model``. Its weights are random: it shows
the pipeline and the runtime, its text is gibberish.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from ..utils.cache import cache_dir

DEMO_NAME = "demo-tiny-llama-v2"
#: the demo tokenizer's chat template, so chat requests work on it as on a chat model
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
_CHARS = ["<unk>", "<eos>"] + list(" abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;:!?'\"-()\n")


def char_tokenizer():
    """A character-level fast tokenizer (one token per character, ``<eos>`` = 1)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(_CHARS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def demo_model_path(root: str | Path | None = None) -> Path:
    """The demo checkpoint folder, built on first use (written to a temporary folder, then renamed)."""
    root = Path(root) if root is not None else cache_dir()
    path = root / DEMO_NAME
    if (path / "config.json").is_file():
        return path
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEMO_NAME}-", dir=root))
    try:
        config = LlamaConfig(vocab_size=len(_CHARS), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                             bos_token_id=None, eos_token_id=1, pad_token_id=None, tie_word_embeddings=False)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp)
        char_tokenizer().save_pretrained(tmp)
        try:
            tmp.rename(path)
        except OSError:  # built concurrently by another process: keep theirs
            if not (path / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
