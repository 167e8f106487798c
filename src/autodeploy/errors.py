"""Errors that autodeploy reports to users as one clear message (no traceback)."""


class AutoDeployError(Exception):
    """Base class: the message names the problem (config key, file, parameter) and how to fix it."""


class ConfigError(AutoDeployError):
    """The pipeline configuration (YAML, --set overrides, transform fields) is invalid."""


class CheckpointError(AutoDeployError):
    """The model checkpoint folder or its weights cannot be used."""


class ExportError(AutoDeployError):
    """torch.export could not trace the model."""


class GraphDumpError(AutoDeployError):
    """The graph-dump directory cannot be used safely."""


class PackageError(AutoDeployError):
    """The built graph cannot be served from a package (the ``aoti`` backend): exporting or compiling its
    decode step, or writing its code, failed; names the step. The model itself may be fine."""


class TransformError(AutoDeployError):
    """A transform failed unexpectedly (a bug or an unsupported model construct); names the transform."""


class VerificationError(AutoDeployError):
    """``--verify``: a transform's graph is no longer within tolerance of HF transformers' logits.

    ``transform`` (its key), ``stage`` and ``max_abs_error`` name the finding; ``table`` is the verification
    table up to and including it."""

    def __init__(self, message: str, *, transform: str, stage: str, max_abs_error: float, table: str = ""):
        super().__init__(message)
        self.transform = transform
        self.stage = stage
        self.max_abs_error = max_abs_error
        self.table = table
