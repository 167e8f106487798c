"""``--verify``: after each transform, the pipeline's graph against HF transformers on the same samples.

The :class:`Verifier` is called by the optimizer after every transform (from ``export`` on, disabled ones
excepted). It loads the oracle once, on the first call, keeps its logits on the samples and, until the
graph holds its own weights, the checkpoint's tensors (for the graph's meta ones). Each call is one
:class:`VerifyRow`; the first failing row ends the pipeline with a :class:`~autodeploy.errors.VerificationError`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import ConfigError, VerificationError
from ..utils.graph_writer import graph_writer
from ..utils.logger import ad_logger
from .reference import Outputs, load_oracle, make_samples, oracle_outputs, oracle_tensors
from .runner import NotRunnable, pipeline_graph, run_samples
from .tolerance import Comparison, Tolerance, after_expected_error, compare, default_tolerance, expected_error

HF = "hf"
#: stages whose graphs still have their weights on the meta device (they run with the oracle's)
_STAGES_WITHOUT_WEIGHTS = ("export", "post_export", "pattern_matcher", "sharding")


@dataclass(frozen=True)
class VerifyOptions:
    """``atol`` / ``rtol``: None takes the dtype's default (:data:`~autodeploy.verify.tolerance.DTYPE_TOLERANCES`)."""

    atol: float | None = None
    rtol: float | None = None


@dataclass
class VerifyRow:
    number: int
    stage: str
    key: str
    max_abs_error: float
    max_rel_error: float
    passed: bool
    against: str  # "hf", or the key of the lossy transform whose logits are the reference since
    tolerance: Tolerance
    time_s: float
    note: str = ""  # why the graph could not run

    @property
    def result(self) -> str:
        return "pass" if self.passed else "FAIL"


@dataclass
class Verifier:
    factory: object
    max_batch_size: int
    max_seq_len: int
    device: str = "cpu"
    options: VerifyOptions = field(default_factory=VerifyOptions)
    rows: list[VerifyRow] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.factory is None or not hasattr(self.factory, "get_config"):
            raise ConfigError("--verify needs a checkpoint to compare with: pass --model PATH")
        self._reference: Outputs | None = None
        self._against = HF  # what self._reference is: HF's logits, or a lossy transform's
        self._last: Outputs | None = None  # the last verified graph's logits, and its transform
        self._last_key = HF
        self._weights: dict[str, torch.Tensor] = {}
        self.tolerance = default_tolerance(self.factory.dtype, self.options.atol, self.options.rtol)
        self._title = f"verify: logits against HF transformers ({self.factory.dtype}: {self.tolerance.describe()})"

    # -- the oracle ---------------------------------------------------------------------------------
    def _load(self) -> None:
        start = time.perf_counter()
        config = self.factory.get_config()
        vocab = getattr(getattr(config, "get_text_config", lambda: config)(), "vocab_size", None) or config.vocab_size
        self.samples = make_samples(vocab, self.max_batch_size, self.max_seq_len)
        oracle = load_oracle(self.factory)
        self._reference = oracle_outputs(oracle, self.samples)
        self._weights = oracle_tensors(oracle)
        ad_logger.info(f"verify: HF transformers reference loaded and run in {time.perf_counter() - start:.2f} s "
                       f"({self.describe_samples()}; {self.tolerance.describe()})")

    def describe_samples(self) -> str:
        shapes = ", ".join(f"{ids.shape[0]}x{ids.shape[1]}" for ids, _ in self.samples.batches)
        prompts = "+".join(str(p) for p in self.samples.prompt_lens)
        return (f"batches {shapes}; {len(self.samples.sequences)} sequences: prefill {prompts} tokens, "
                f"{self.samples.decode_steps} decode steps")

    # -- one transform ------------------------------------------------------------------------------
    def check(self, mod: nn.Module, transform, number: int) -> VerifyRow | None:
        """Verify ``mod`` after ``transform``; None where there is nothing to run yet (before export)."""
        if not transform.config.enabled or pipeline_graph(mod) is None:
            return None
        if self._reference is None:
            self._load()
        start = time.perf_counter()
        key, stage = transform.get_transform_key(), transform.config.stage.value
        lossy = expected_error(transform)
        tol, against = (lossy, self._last_key) if lossy is not None else (self.tolerance, self._against)
        reference = self._last if lossy is not None and self._last is not None else self._reference
        note = ""
        try:
            outputs = run_samples(mod, self.samples, self._weights, self.device)
            result = _compare_all(outputs, reference, tol)
        except NotRunnable as exc:
            outputs, note = None, str(exc)
            result = Comparison(math.nan, math.nan, False)
        row = VerifyRow(number, stage, key, result.max_abs_error, result.max_rel_error, result.passed, against,
                        tol, time.perf_counter() - start, note)
        self.rows.append(row)
        if outputs is not None:
            self._last, self._last_key = outputs, key
            if lossy is not None and row.passed:  # its logits are the reference from now on
                self._reference, self._against = outputs, key
                self.tolerance = after_expected_error(self.tolerance, row.max_abs_error)
        if stage not in _STAGES_WITHOUT_WEIGHTS:
            self._weights = {}  # the graph holds its own weights now
        ad_logger.info(f"[VERIFY] {row.result}: max abs error {_fmt(row.max_abs_error)} "
                       f"(rel {_fmt(row.max_rel_error)}) against {against} | {row.time_s:.3f} s"
                       + (f" | {note}" if note else ""))
        graph_writer.record_verification(key, {"max_abs_error": _json_float(row.max_abs_error),
                                               "max_rel_error": _json_float(row.max_rel_error),
                                               "result": row.result, "against": against, "note": note})
        return row

    # -- reporting ----------------------------------------------------------------------------------
    def table(self) -> str:
        head = ("#", "stage", "transform", "max abs err", "max rel err", "against", "result", "time (s)")
        body = [(str(r.number), r.stage, r.key, _fmt(r.max_abs_error), _fmt(r.max_rel_error), r.against,
                 r.result, f"{r.time_s:.3f}") for r in self.rows]
        widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
        lines = ["  ".join(cell.ljust(w) if i < 3 or i == 5 else cell.rjust(w) for i, (cell, w) in
                           enumerate(zip(row, widths))).rstrip() for row in [head, *body]]
        return "\n".join([self._title, *lines, self.summary()])

    def first_failure(self) -> VerifyRow | None:
        return next((r for r in self.rows if not r.passed), None)

    def summary(self) -> str:
        failed = self.first_failure()
        if failed is None:
            total = sum(r.time_s for r in self.rows)
            return f"verify: all {len(self.rows)} transforms within tolerance ({total:.2f} s of verification)"
        return "verify: first failing transform: " + _failure_text(failed)

    def error(self, row: VerifyRow) -> VerificationError:
        before, after = graph_writer.dump_pair(row.key)
        dumps = ""
        if after is not None:
            dumps = f"; graph after it: {after}"
            if before is not None:
                dumps = (f"; graph before it: {before}, after it: {after}; diff: autodeploy graph diff "
                         f"{after.parent} {before.name.split('_', 1)[0]} {after.name.split('_', 1)[0]}")
                page = graph_writer.diff_page(after)
                if page is not None:
                    dumps += f" (or {page})"
        return VerificationError(
            f"transform {row.key!r} (stage {row.stage}) broke the model's numerics: " + _failure_text(row) + dumps,
            transform=row.key, stage=row.stage, max_abs_error=row.max_abs_error, table=self.table(),
        )


def _compare_all(out: Outputs, ref: Outputs, tol: Tolerance) -> Comparison:
    pairs = list(zip(out.batches, ref.batches)) if out.batches else []
    pairs += [(o, r[: len(o)]) for o, r in zip(out.sequences, ref.sequences)]
    results = [compare(o, r, tol) for o, r in pairs]
    return Comparison(max(r.max_abs_error for r in results), max(r.max_rel_error for r in results),
                      all(r.passed for r in results))


def _failure_text(row: VerifyRow) -> str:
    if row.note:
        return row.note
    return (f"max abs error {_fmt(row.max_abs_error)} against {'HF transformers' if row.against == HF else row.against}"
            f" exceeds the tolerance ({row.tolerance.describe()})")


def _fmt(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2e}"


def _json_float(value: float) -> float | None:
    return None if math.isnan(value) or math.isinf(value) else value
