"""The export-patch registry.

Some model code cannot be traced on meta tensors as written (autocast regions, data-dependent
helpers, expert loops over tokens). A patch is a named context manager that swaps such code for an
export-friendly equivalent computing the same thing, only while ``torch.export`` runs.
"""

from __future__ import annotations

import contextlib
import difflib
import types
from typing import Callable, ClassVar, Iterator, Type

from torch import nn

from ...errors import ConfigError
from ...utils.logger import ad_logger


class ExportPatch:
    """Base class: override ``patch`` as a generator that yields while the patch is active."""

    name: ClassVar[str] = ""

    def __init__(self, model: nn.Module, export_config, max_seq_len: int | None = None):
        self.model = model
        self.export_config = export_config
        self.max_seq_len = max_seq_len  # the longest sequence the exported graph must serve (None: unknown)

    def applies(self) -> bool:
        """Whether this patch is relevant to the model (patches that do not apply are not entered)."""
        return True

    @contextlib.contextmanager
    def patch(self) -> Iterator[None]:
        raise NotImplementedError


class ModuleForwardPatch(ExportPatch):
    """A patch that gives every module some ``FORWARDS`` entry recognises (``(is_match(module), forward)``
    pairs, matched on what the module holds, not its class) that entry's forward while export runs."""

    FORWARDS: ClassVar[tuple[tuple[Callable[[nn.Module], bool], Callable], ...]] = ()

    def _matches(self) -> list[tuple[nn.Module, Callable]]:
        found = []
        for module in self.model.modules():
            forward = next((fwd for is_match, fwd in self.FORWARDS if is_match(module)), None)
            if forward is not None:
                found.append((module, forward))
        return found

    def applies(self) -> bool:
        return bool(self._matches())

    @contextlib.contextmanager
    def patch(self) -> Iterator[None]:
        matches = self._matches()
        for module, forward in matches:  # an instance attribute shadows the class's forward
            module.forward = types.MethodType(forward, module)
        try:
            yield
        finally:
            for module, _ in matches:
                del module.forward


class ExportPatchRegistry:
    _patches: ClassVar[dict[str, Type[ExportPatch]]] = {}

    @classmethod
    def register(cls, name: str) -> Callable[[Type[ExportPatch]], Type[ExportPatch]]:
        def decorator(patch_cls: Type[ExportPatch]) -> Type[ExportPatch]:
            patch_cls.name = name
            cls._patches[name] = patch_cls
            return patch_cls

        return decorator

    @classmethod
    def names(cls) -> list[str]:
        return list(cls._patches)

    @classmethod
    def resolve(cls, names: list[str] | None) -> list[Type[ExportPatch]]:
        """The patch classes for ``names`` (all registered when None); an unknown name is an error."""
        if names is None:
            return list(cls._patches.values())
        unknown = [n for n in names if n not in cls._patches]
        if unknown:
            hints = []
            for n in unknown:
                close = difflib.get_close_matches(n, cls._patches, n=1)
                hints.append(f"{n!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise ConfigError(
                f"transforms.export_to_gm.patch_list: unknown export patch {', '.join(hints)}; "
                f"registered patches: {', '.join(sorted(cls._patches))}"
            )
        return [cls._patches[n] for n in names]


@contextlib.contextmanager
def apply_export_patches(model: nn.Module, export_config, names: list[str] | None,
                         max_seq_len: int | None = None) -> Iterator[list[str]]:
    """Enter every selected patch that applies to ``model``; yields the names of those applied."""
    with contextlib.ExitStack() as stack:
        applied = []
        for patch_cls in ExportPatchRegistry.resolve(names):
            patch = patch_cls(model, export_config, max_seq_len)
            if patch.applies():
                stack.enter_context(patch.patch())
                applied.append(patch_cls.name)
        ad_logger.info(f"export patches applied: {', '.join(applied) or 'none'}")
        yield applied
