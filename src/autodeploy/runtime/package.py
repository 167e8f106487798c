"""A served model as files: what a process needs to serve a built model without building it.

A package is a folder:

- ``graph.py``: the cached graph's generated code (torch.fx's ``forward`` and its imports), which serves
  prefill, chunked and mixed batches;
- ``weights.safetensors``: every tensor that graph reads but the KV caches (fused, quantized and all),
  memory-mapped at load and read in then, in 2 MiB pages where the kernel can (the embedding tables' rows are
  mapped as tokens read them);
- ``manifest.json``: the graph's inputs, the KV-cache layout (:class:`KVCacheSpec`, the caches are
  allocated at load), the tensor names that alias another, the embedding tables read at random (or, where the
  products' weights are quantized, read into memory at load), the vocab and EOS ids, and the path of the decode
  step's AOTInductor package (``compile/aoti.py``: code only, its constants are the tensors above, handed over at
  load without a copy).

Loading imports torch and autodeploy's canonical ops (not safetensors: the loader maps the file itself), not the
exporter nor the compiler, so a serving process's memory is the weights, the caches and torch
(docs/performance.md).
"""

from __future__ import annotations

import dataclasses
import json
import linecache
import math
import struct
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import AutoDeployError, PackageError
from ..utils.fx import get_attr_tensor, graph_tensors, read_as_embedding_table_only
from .decode_dispatch import DecodeDispatch
from .kv_cache import CacheLayer, KVCacheSpec, StateLayer, allocate_kv_caches

PACKAGE_FORMAT = 1
MANIFEST_FILE, CODE_FILE, WEIGHTS_FILE = "manifest.json", "graph.py", "weights.safetensors"


class AOTIDecode(nn.Module):
    """The decode step from an AOTInductor package, its constants (weights and KV caches) taken from
    ``tensors`` by name: user-managed, so the package reads and writes those very tensors (they are kept
    referenced here for as long as the package may run).

    Where the native op library runs, the package is loaded by its ``DecodeLoop`` (``custom_ops/native/
    decode_loop.h``), which also runs several greedy steps in one call (:meth:`greedy_steps`); elsewhere by
    torch's loader, one step a call."""

    def __init__(self, package_path: str | Path, tensors: dict[str, torch.Tensor]):
        super().__init__()
        from ..custom_ops import native

        self.package_path = str(package_path)
        self.loops = native.library() is not None
        try:
            if self.loops:
                self._loader = torch.classes.auto_deploy.DecodeLoop(self.package_path)
            else:
                self._loader = torch._C._aoti.AOTIModelPackageLoader(self.package_path, "model", False, 1, -1)
        except RuntimeError as exc:
            if "undefined symbol: aoti_torch_cpu_" not in str(exc):
                raise
            # compiled to call the native kernels' C shims (compile/aoti.py), which this process has not loaded
            raise AutoDeployError(f"decode package {self.package_path} calls autodeploy's native kernels, which "
                                  f"this process does not run (see AUTODEPLOY_NATIVE_KERNELS); rebuild the "
                                  f"package here: {exc}") from exc
        names = self._loader.get_constant_fqns()
        missing = [n for n in names if n not in tensors]
        if missing:
            raise AutoDeployError(f"decode package {self.package_path} needs tensor(s) the graph does not hold: "
                                  f"{', '.join(missing[:5])}")
        self._constants = {n: tensors[n] for n in names}
        # (names as in the graph, not Inductor's; every constant; user-managed: no copy)
        self._loader.load_constants(self._constants, False, True, True)

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(self._loader.run(list(args)))

    def greedy_steps(self, args: list[torch.Tensor], tokens: torch.Tensor, stop_tokens: torch.Tensor, steps: int,
                     capacity: int, seconds: float, interrupt: torch.Tensor) -> torch.Tensor:
        """Up to ``steps`` greedy decode steps in one call, for at most about ``seconds`` and while ``interrupt[0]`` is
        0 (``DecodeLoop::greedy_steps``: the batch in ``args`` is advanced in place); the tokens picked, [steps run,
        sequences]. Only where :attr:`loops`."""
        return self._loader.greedy_steps(args, tokens, stop_tokens, steps, capacity, seconds, interrupt)


class PackagedModel(DecodeDispatch):
    """The served module of a package (or of the ``aoti`` backend in the building process): decode-only
    batches through the AOTInductor package, every other batch through the cached graph. ``input_names``,
    ``kv_cache_spec`` and ``vocab_size`` are what the runtime needs of the graph; a loaded package also knows
    the checkpoint's ``eos_token_ids``."""

    def __init__(self, general: nn.Module, decode: nn.Module, input_names: list[str], spec: KVCacheSpec,
                 vocab_size: int | None = None, eos_token_ids: list[int] | None = None):
        super().__init__(general, decode, input_names)
        self.input_names, self.kv_cache_spec, self.vocab_size = list(input_names), spec, vocab_size
        self.eos_token_ids = eos_token_ids
        #: several greedy decode steps in one call (:meth:`AOTIDecode.greedy_steps`; what the engine's multi-step
        #: decode takes where it can), None where the package's loader runs one step a call
        self.greedy_steps = decode.greedy_steps if getattr(decode, "loops", False) else None


class PackagedGraph(nn.Module):
    """The cached graph from its generated code: ``forward`` is the code torch.fx generated for it, run over
    this module's tensors (registered as buffers under the graph's qualified names)."""

    def __init__(self, code: str, tensors: dict[str, torch.Tensor], spec: KVCacheSpec, filename: str):
        super().__init__()
        for name, tensor in tensors.items():
            _set_tensor(self, name, tensor)
        self.meta = {"kv_cache": spec}
        linecache.cache[filename] = (len(code), None, code.splitlines(keepends=True), filename)  # tracebacks
        namespace: dict[str, Any] = {}
        exec(compile(code, filename, "exec"), namespace)  # noqa: S102 - the code this package's build wrote
        self._code = namespace["forward"]

    def forward(self, *args: torch.Tensor):
        return self._code(self, *args)


def _set_tensor(root: nn.Module, name: str, tensor: torch.Tensor) -> None:
    module = root
    *path, attr = name.split(".")
    for part in path:
        child = module._modules.get(part)
        if child is None:
            child = nn.Module()
            module.add_module(part, child)
        module = child
    module.register_buffer(attr, tensor, persistent=False)


# -- writing --------------------------------------------------------------------------------------------
def _graph_code(gm) -> str:
    """The graph's ``forward`` source with the imports of every global it reads (as torch.fx pickles it)."""
    from torch.fx.graph_module import _format_import_block
    from torch.package import sys_importer

    python_code = gm.graph.python_code(root_module="self")
    try:
        imports = _format_import_block(python_code.globals, sys_importer)
    except Exception as exc:  # noqa: BLE001 - a global that cannot be imported by name
        raise PackageError(f"the cached graph calls something a package cannot import by name: {exc}") from exc
    return imports + "\n" + python_code.src


def _spec_json(spec: KVCacheSpec) -> dict:
    record = dataclasses.asdict(spec)
    for layer in record["layers"] + record["state_layers"]:
        layer["dtype"] = str(layer["dtype"]).removeprefix("torch.")
    return record


def _spec_from_json(record: dict) -> KVCacheSpec:
    record = dict(record)
    layers = [CacheLayer(**{**layer, "dtype": getattr(torch, layer["dtype"])}) for layer in record.pop("layers")]
    states = [StateLayer(**{**s, "shape": tuple(s["shape"]), "dtype": getattr(torch, s["dtype"])})
              for s in record.pop("state_layers")]
    return KVCacheSpec(**record, layers=layers, state_layers=states)


def _embedding_tables(gm) -> list[str]:
    """Names of the tensors read only by embedding lookups (as their table)."""
    return [node.target for node in gm.graph.find_nodes(op="get_attr") if read_as_embedding_table_only(node)]


def _resident_tables(gm, tables: list[str]) -> list[str]:
    """The embedding tables a serving process reads into memory at load: all of them where no product of the
    graph reads a float32 weight (the products' weights were quantized or are 16-bit), none otherwise.

    A table served from the checkpoint's mapping is read a row per new token, from disk where the page cache
    does not hold it: about 100 us a row on this project's VM, 6-14 ms of a 128-token prompt (HF reads its whole
    checkpoint at load). Reading the table at load moves that cost to the load and keeps the table resident.
    The memory is what quantization saved many times over; a float32 model's products (HF's peak plus its
    KV cache is the limit there) cannot afford it, and keep reading rows on demand."""
    from ..utils.products import product_of

    for product in filter(None, map(product_of, gm.graph.nodes)):
        weight = product.weight
        if getattr(weight, "op", None) == "get_attr" and get_attr_tensor(gm, weight.target).dtype == torch.float32:
            return []
    return list(tables)


def _checkpoint_references(tensors: dict[str, torch.Tensor], checkpoint: Path | None) -> tuple[dict, dict]:
    """The tensors of ``tensors`` that still lie in a memory-mapped file of the ``checkpoint`` folder (the
    weights no transform replaced), as ``{name: {file, offset, dtype, shape}}``, and those files' sizes and
    modification times (checked at load)."""
    from ..utils.memory import mapped_file_locations

    if checkpoint is None:
        return {}, {}
    root = checkpoint.resolve()
    refs, files = {}, {}
    for name, (path, offset) in mapped_file_locations(tensors).items():
        file = Path(path)
        if root not in file.parents or not file.is_file():
            continue
        t = tensors[name]
        refs[name] = {"file": str(file), "offset": offset, "dtype": str(t.dtype).removeprefix("torch."),
                      "shape": list(t.shape)}
        stat = file.stat()
        files[str(file)] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    return refs, files


def write_package(served: PackagedModel, out_dir: str | Path, vocab_size: int | None = None,
                  eos_token_ids: list[int] | None = None, checkpoint: str | Path | None = None) -> Path:
    """Write ``served`` (the ``aoti`` backend's module, its general graph a GraphModule) as a package in
    ``out_dir`` (created; the decode package stays where it is cached). Tensors that still lie in the
    memory-mapped files of the ``checkpoint`` folder are referenced there, not copied. Returns ``out_dir``."""
    from safetensors.torch import save_file

    gm = served.general
    spec = served.kv_cache_spec
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    caches = {name for layer in spec.layers for name in (layer.k_name, layer.v_name)}
    caches |= {state.name for state in spec.state_layers}
    saved: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    strides: dict[str, list[int]] = {}
    first: dict[tuple, str] = {}
    for name, tensor in graph_tensors(gm).items():
        if name in caches:
            continue
        identity = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
        if identity in first:  # tied: one tensor under two names
            aliases[name] = first[identity]
            continue
        first[identity] = name
        if not tensor.is_contiguous():
            strides[name] = list(tensor.stride())
        # a copy where it shares storage with another saved tensor (safetensors stores each storage once)
        saved[name] = tensor.detach().contiguous()
    references, files = _checkpoint_references(saved, Path(checkpoint) if checkpoint is not None else None)
    saved = {name: t for name, t in saved.items() if name not in references}
    shared: dict[int, int] = {}
    for t in saved.values():
        shared[t.untyped_storage().data_ptr()] = shared.get(t.untyped_storage().data_ptr(), 0) + 1
    saved = {n: (t.clone() if shared[t.untyped_storage().data_ptr()] > 1 else t) for n, t in saved.items()}
    save_file(saved, str(out / WEIGHTS_FILE))
    (out / CODE_FILE).write_text(_graph_code(gm))
    # (a table tied to another name, e.g. the LM head's, is read whole anyway)
    tables = [n for n in _embedding_tables(gm) if n not in aliases and n not in aliases.values()]
    manifest = {
        "format": PACKAGE_FORMAT, "torch": torch.__version__, "input_names": served.input_names,
        "kv_cache": _spec_json(spec), "aliases": aliases, "strides": strides,
        "checkpoint_tensors": references, "checkpoint_files": files,
        "embedding_tables": tables, "resident_tables": _resident_tables(gm, tables),
        "vocab_size": vocab_size or served.vocab_size,
        "eos_token_ids": eos_token_ids, "decode_package": served.decode.package_path,
    }
    (out / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1))
    return out


# -- loading ---------------------------------------------------------------------------------------------
def _run_custom_ops_without_dynamo() -> int:
    """Let autodeploy's Python custom ops run without importing Dynamo; returns how many kernels changed.

    ``torch.library.custom_op`` wraps each kernel in ``torch._disable_dynamo``, which imports Dynamo (and
    sympy with it: some 50 MiB) at the kernel's first call, to keep a running torch.compile from tracing
    into it. A process that has not imported Dynamo compiles nothing, so the kernel is its own "disabled"
    form there (the wrapper's cache attribute says so). Where Dynamo is loaded already, or torch's layout
    differs, nothing changes (the ops still run, importing Dynamo)."""
    import sys

    if "torch._dynamo" in sys.modules:
        return 0
    from torch._library import custom_ops as torch_custom_ops

    changed = 0
    for name, opdef in getattr(torch_custom_ops, "OPDEFS", {}).items():
        if not name.startswith("auto_deploy::"):
            continue
        for wrapper in getattr(opdef, "_backend_fns", {}).values():
            kernel = getattr(wrapper, "__wrapped__", None)
            if kernel is not None and getattr(kernel, "__dynamo_disable", None) is None:
                setattr(kernel, "__dynamo_disable", kernel)
                changed += 1
    return changed


def read_manifest(package_dir: str | Path) -> dict:
    path = Path(package_dir) / MANIFEST_FILE
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise AutoDeployError(f"{path}: not a readable package manifest ({exc})") from exc
    if manifest.get("format") != PACKAGE_FORMAT or manifest.get("torch") != torch.__version__:
        raise AutoDeployError(f"{path}: package format {manifest.get('format')} built with torch "
                              f"{manifest.get('torch')}; this process reads format {PACKAGE_FORMAT} with torch "
                              f"{torch.__version__}")
    return manifest


#: safetensors' names of the dtypes a package may hold -> torch's
_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                       "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                       "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def _safetensors_references(path: Path) -> dict[str, dict]:
    """The tensors of the safetensors file ``path`` as references into it (file, offset, dtype, shape), from
    its header: 8 bytes of length, then JSON naming each tensor's dtype, shape and byte range after it."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        entries = {name: entry for name, entry in header.items() if name != "__metadata__"}
        unknown = sorted({entry["dtype"] for entry in entries.values()} - _SAFETENSORS_DTYPES.keys())
        if unknown:
            raise AutoDeployError(f"{path}: holds tensors of dtype {', '.join(unknown)}, which a package never holds")
        return {name: {"file": str(path), "offset": 8 + length + entry["data_offsets"][0],
                       "dtype": _SAFETENSORS_DTYPES[entry["dtype"]], "shape": entry["shape"]}
                for name, entry in entries.items()}
    except (OSError, struct.error, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise AutoDeployError(f"{path}: not a readable safetensors file ({type(exc).__name__}: {exc})") from exc


def _check_checkpoint_files(manifest: dict) -> None:
    """The checkpoint files the package references must be those it was built from."""
    import os

    for path, expected in manifest["checkpoint_files"].items():
        try:
            stat = os.stat(path)
        except OSError as exc:
            raise AutoDeployError(f"the package's weights are in {path}, which cannot be read: {exc}") from exc
        if (stat.st_size, stat.st_mtime_ns) != (expected["size"], expected["mtime_ns"]):
            raise AutoDeployError(f"checkpoint file {path} changed after the package was built; rebuild it")


def _map_tensors(references: dict[str, dict]) -> dict[str, torch.Tensor]:
    """The tensors of ``references`` (file, offset, dtype, shape) as views of a private mapping of each file:
    pages are read from the file as the steps touch them, and none is read here."""
    import mmap
    import os

    maps = {}
    for path in {ref["file"] for ref in references.values()}:
        fd = os.open(path, os.O_RDONLY)
        try:  # private and writable (copy on write), as torch wants a writable buffer; the file is never written
            maps[path] = mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
    tensors = {}
    for name, ref in references.items():
        dtype, count = getattr(torch, ref["dtype"]), math.prod(ref["shape"])
        tensors[name] = (torch.frombuffer(maps[ref["file"]], dtype=dtype, count=count, offset=ref["offset"])
                         .view(ref["shape"]) if count else torch.empty(ref["shape"], dtype=dtype))
    return tensors


def load_package(package_dir: str | Path) -> PackagedModel:
    """The served module of the package in ``package_dir`` (see the module docstring), on the CPU. The
    weights stay memory-mapped from the package's file, which may be deleted once this returns; those a decode
    step reads whole are read in here, in huge pages (``utils.memory.map_in_huge_pages``)."""
    from .. import custom_ops  # noqa: F401 - registers the canonical ops the graph and the package call
    from ..custom_ops import native
    from ..utils.logger import ad_logger
    from ..utils.memory import advise_random_access, map_in_huge_pages, read_into_memory

    native.library()
    _run_custom_ops_without_dynamo()
    package_dir = Path(package_dir)
    manifest = read_manifest(package_dir)
    _check_checkpoint_files(manifest)
    # our own mappings, not safetensors' (whose get_tensor reads each tensor into the page cache): every page
    # is read after the hints below
    tensors = _map_tensors({**_safetensors_references(package_dir / WEIGHTS_FILE), **manifest["checkpoint_tensors"]})
    tables = set(manifest["embedding_tables"])
    map_in_huge_pages(t for name, t in tensors.items() if name not in tables)  # each decode step reads them all
    for name, stride in manifest["strides"].items():
        tensors[name] = torch.empty_strided(tensors[name].shape, stride, dtype=tensors[name].dtype).copy_(
            tensors[name])
    for name, target in manifest["aliases"].items():
        tensors[name] = tensors[target]
    resident = set(manifest.get("resident_tables", ()))
    for name in manifest["embedding_tables"]:
        if name in resident:
            start = time.perf_counter()
            tensors[name] = read_into_memory(tensors[name])
            ad_logger.info(f"embedding table {name} read into memory at load ({tensors[name].nbytes / 2**20:.0f} MiB, "
                           f"{time.perf_counter() - start:.2f} s): the products' weights are quantized")
        else:
            advise_random_access(tensors[name])  # a token's row is mapped, not a read-ahead window of rows
    spec = _spec_from_json(manifest["kv_cache"])
    for layer in spec.layers:  # placeholders that allocate_kv_caches replaces (it reads their shapes)
        for name, dim in ((layer.k_name, layer.head_dim), (layer.v_name, layer.v_head_dim)):
            tensors[name] = torch.empty(0, spec.page_size, layer.n_kv_heads, dim, dtype=layer.dtype, device="meta")
    general = PackagedGraph((package_dir / CODE_FILE).read_text(), tensors, spec,
                            filename=f"<autodeploy package {package_dir.name}>")
    allocate_kv_caches(general, spec, spec.num_pages, "cpu")
    decode = AOTIDecode(manifest["decode_package"], graph_tensors(general))
    return PackagedModel(general, decode, manifest["input_names"], spec, manifest["vocab_size"],
                         manifest["eos_token_ids"])
