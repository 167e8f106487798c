"""Building in a child process, serving from its package: what keeps a serving process free of the compiler.

With the ``aoti`` backend, :class:`~autodeploy.LLM` does not build in its own process. It starts
``python -m autodeploy.build_process CONFIG_JSON OUT_DIR``, which runs the whole pipeline (its log lines,
graph dumps and errors are the same as in-process) and writes the served model as a package
(:mod:`autodeploy.runtime.package`); the LLM then loads the package, importing torch and the runtime only.
Exporting and compiling leave their memory (some 150 MiB of the compiler's modules and state on the 125M
model) in the child, which exits.

The child writes ``result.json`` into ``OUT_DIR``: ``{"packaged": true, "peak_rss_bytes": ...}``, or
``{"packaged": false, "reason": ...}`` where the graph cannot be packaged (the LLM then builds in-process
with ``torch-compile``), or ``{"error": CLASS, "message": ...}`` for a failure of the build itself (the LLM
raises it as that error class, with the same message).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

from . import errors
from .utils.cache import cache_dir, source_digest
from .utils.logger import ad_logger

RESULT_FILE = "result.json"


def _write_result(out_dir: Path, result: dict) -> None:
    (out_dir / RESULT_FILE).write_text(json.dumps(result))


def run_build(config_json: str, out_dir: str) -> int:
    """The child: build the pipeline of the config in ``config_json`` and write its package to ``out_dir``."""
    from .config.loader import AutoDeployConfig
    from .distributed.runner import build_model
    from .models.hf import checkpoint_eos_token_ids
    from .runtime.package import WEIGHTS_FILE, PackagedModel, write_package
    from .utils.fx import text_config
    from .utils.memory import drop_cached_pages, peak_rss_bytes

    out = Path(out_dir)
    try:
        config = AutoDeployConfig.model_validate(json.loads(Path(config_json).read_text()))
        built = build_model(config)
        if not isinstance(built.module, PackagedModel):
            _write_result(out, {"packaged": False, "reason": "the compile stage did not produce an aoti package"})
            return 0
        factory = built.factory
        vocab = getattr(text_config(factory.get_config()), "vocab_size", None) if factory is not None else None
        eos = checkpoint_eos_token_ids(Path(config.model), factory) if config.model else None
        start = time.perf_counter()
        write_package(built.module, out, vocab_size=vocab, eos_token_ids=eos, checkpoint=config.model)
        drop_cached_pages([out / WEIGHTS_FILE])  # the server maps the pages it reads, not the written file's
        ad_logger.info(f"package written in {time.perf_counter() - start:.1f} s ({out})")
    except errors.PackageError as exc:  # the package, not the model, failed
        _write_result(out, {"packaged": False, "reason": str(exc)})
        return 0
    except errors.AutoDeployError as exc:
        _write_result(out, {"error": type(exc).__name__, "message": str(exc)})
        return 1
    _write_result(out, {"packaged": True, "peak_rss_bytes": peak_rss_bytes()})
    return 0


#: ``0`` turns the package cache off (every LLM then builds); graph dumps (``AD_DUMP_GRAPHS_DIR``) do too
PACKAGE_CACHE_ENV = "AUTODEPLOY_PACKAGE_CACHE"
#: packages kept in the cache, the most recently used first (each holds the weights the build made)
KEEP_PACKAGES = 3
#: environment variables that change what a build makes (kernels, instruction sets, the backend choice)
_BUILD_ENV_PREFIXES = ("AUTODEPLOY_", "AUTO_DEPLOY_", "ATEN_CPU_CAPABILITY", "ONEDNN_", "MKL_ENABLE", "TORCHINDUCTOR_")


def package_cache_key(config) -> str | None:
    """The key of ``config``'s package in the cache: the configuration, the checkpoint folder's files (name,
    size, modification time), autodeploy's sources, torch's version, the CPU's instruction set and the
    environment that steers a build. None where the cache does not apply (turned off, graph dumps asked
    for, or a model that is not a local folder)."""
    import torch

    if os.environ.get(PACKAGE_CACHE_ENV, "1") == "0" or os.environ.get("AD_DUMP_GRAPHS_DIR"):
        return None
    folder = Path(config.model or "")
    if not config.model or not folder.is_dir():
        return None
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir() if p.is_file())
    record = {
        "config": config.model_dump(mode="json"), "folder": str(folder.resolve()), "files": files,
        "sources": source_digest(), "torch": torch.__version__, "capability": torch.backends.cpu.get_cpu_capability(),
        "env": sorted((k, v) for k, v in os.environ.items() if k.startswith(_BUILD_ENV_PREFIXES)),
    }
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:24]


def cached_package(key: str) -> Path | None:
    """The cached package of ``key``, marked as just used; None where there is none."""
    path = cache_dir() / "packages" / key
    if not (path / RESULT_FILE).is_file():
        return None
    os.utime(path)
    return path


def _keep_in_cache(package: Path, key: str) -> Path:
    """Move a built package into the cache under ``key`` (another process's of the same key wins) and drop
    the least recently used beyond :data:`KEEP_PACKAGES`; returns where the package now is."""
    packages = cache_dir() / "packages"
    packages.mkdir(parents=True, exist_ok=True)
    target = packages / key
    try:
        os.replace(package, target)
    except OSError:  # one is there already (a concurrent build of the same model): use it
        return target if (target / RESULT_FILE).is_file() else package
    shutil.rmtree(package.parent, ignore_errors=True)
    entries = sorted((p for p in packages.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in entries[KEEP_PACKAGES:]:
        shutil.rmtree(old, ignore_errors=True)
    return target


def build_package(config, key: str | None = None) -> tuple[Path | None, dict]:
    """Build ``config`` (an :class:`~autodeploy.config.loader.AutoDeployConfig` with the ``aoti`` backend)
    in a child process. Returns the package folder and the child's result; with a cache ``key`` the package
    is kept in the cache, else the caller removes it with :func:`remove_package` once loaded. ``None`` and
    the result with its ``reason`` where the graph could not be packaged. A failure of the build raises the
    child's error, with its message."""
    staging = cache_dir() / "staging" / f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staging.mkdir(parents=True)
    config_file = staging / "config.json"
    record = config.model_dump(mode="json")
    # named, not auto: where the decode step cannot be packaged the child says so (and the caller builds
    # in-process) rather than compiling with torch-compile there, for nothing
    record["transforms"].setdefault("compile_model", {})["backend"] = "aoti"
    config_file.write_text(json.dumps(record))
    package = staging / "package"
    package.mkdir()
    ad_logger.info(f"building in a child process (pid of this one: {os.getpid()}); it writes {package}")
    try:
        code = subprocess.call([sys.executable, "-m", "autodeploy.build_process", str(config_file), str(package)])
        try:
            result = json.loads((package / RESULT_FILE).read_text())
        except (OSError, ValueError):
            raise errors.AutoDeployError(f"the build process exited with code {code} without a result "
                                         "(killed, or out of memory?); its log is above") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if "error" in result:
        shutil.rmtree(staging, ignore_errors=True)
        error_class = getattr(errors, result["error"], errors.AutoDeployError)
        if not (isinstance(error_class, type) and issubclass(error_class, errors.AutoDeployError)):
            error_class = errors.AutoDeployError
        try:
            raise error_class(result["message"])
        except TypeError:  # an error class with required keyword fields (VerificationError)
            raise errors.AutoDeployError(result["message"]) from None
    if not result.get("packaged"):
        shutil.rmtree(staging, ignore_errors=True)
        return None, result
    if key is not None:
        package = _keep_in_cache(package, key)
    return package, result


def remove_package(package: Path) -> None:
    """Remove a staged package (and its staging folder) once loaded: its weights stay mapped until the
    served model is freed. A package in the cache stays."""
    if package.parent.parent == cache_dir() / "staging":
        shutil.rmtree(package.parent, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(run_build(*sys.argv[1:3]))
