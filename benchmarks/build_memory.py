"""Peak memory of an autodeploy build for a ~1B-parameter Llama, against the weights' own size.

Creates a random-weight checkpoint (Llama, hidden 2048, 22 layers, 1.1B parameters, TinyLlama's
shape) in a temporary folder, then in separate processes measures the peak resident memory of
  1. `autodeploy.optimize(CKPT, until="post_load_fusion")` (the default pipeline before the KV cache)
     followed by one forward pass, and
  2. HF transformers `AutoModelForCausalLM.from_pretrained(CKPT)` and the same forward (baseline),
and prints both as ratios of the checkpoint's weight bytes. The forward pass touches every weight,
so memory-mapped weights are counted too.

    python benchmarks/build_memory.py [--dtype float32|bfloat16] [--keep DIR]
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GiB = 1024**3


def make_checkpoint(path: Path, dtype: str) -> int:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
        num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048, tie_word_embeddings=False,
    )
    torch_dtype = getattr(torch, dtype)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    model = model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float32).mul_(0.02))
    model.save_pretrained(path)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def peak_rss_of(code: str) -> tuple[float, float]:
    """Run ``code`` in a fresh Python; return (its peak RSS in bytes, wall seconds)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    wall = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if peak <= before:
        raise RuntimeError("child peak not above an earlier child's; run each measurement in a fresh parent")
    return peak * 1024, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--keep", type=Path, help="use/keep the checkpoint in this folder")
    args = parser.parse_args()

    folder = args.keep or Path(tempfile.mkdtemp(prefix="ad_mem_"))
    if not (folder / "config.json").exists():
        print(f"creating checkpoint in {folder} ...", flush=True)
        make_checkpoint(folder, args.dtype)
    weight_bytes = sum(f.stat().st_size for f in folder.glob("*.safetensors"))

    # Measured in separate parents so that RUSAGE_CHILDREN's max belongs to one child each.
    forward = "ids = torch.arange(8)[None]; torch.no_grad()(lambda: m(input_ids=ids, position_ids=ids))()"
    build = f"import torch, autodeploy; m = autodeploy.optimize({str(folder)!r}, until='post_load_fusion'); {forward}"
    hf = (
        "import torch; from transformers import AutoModelForCausalLM; "
        f"m = AutoModelForCausalLM.from_pretrained({str(folder)!r}, dtype=torch.{args.dtype}); {forward}"
    )
    results = {}
    for name, code in (("autodeploy build", build), ("HF from_pretrained", hf)):
        wrapper = (
            "import sys; sys.path.insert(0, %r); from build_memory import peak_rss_of; "
            "peak, wall = peak_rss_of(%r); print(peak, wall)" % (str(Path(__file__).parent), code)
        )
        out = subprocess.run([sys.executable, "-c", wrapper], check=True, capture_output=True, text=True)
        peak, wall = map(float, out.stdout.split()[-2:])
        results[name] = (peak, wall)

    print(f"\ncheckpoint weights: {weight_bytes / GiB:.2f} GiB ({args.dtype})")
    print(f"{'(+ one forward)':24s} {'peak RSS':>10s} {'x weights':>10s} {'wall':>8s}")
    for name, (peak, wall) in results.items():
        print(f"{name:24s} {peak / GiB:8.2f} GiB {peak / weight_bytes:9.2f}x {wall:7.1f} s")
    ad, hf_peak = results["autodeploy build"][0], results["HF from_pretrained"][0]
    print(f"autodeploy build / HF from_pretrained peak: {ad / hf_peak:.2f}x")


if __name__ == "__main__":
    main()
