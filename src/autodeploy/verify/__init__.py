"""``--verify``: each transform's graph checked numerically against HF transformers (verifier.py), on seeded
samples (reference.py), run without changing the pipeline's graph (runner.py), within stated tolerances
(tolerance.py)."""

from .tolerance import DTYPE_TOLERANCES, EXPECTED_ERROR, Tolerance
from .verifier import Verifier, VerifyOptions, VerifyRow

__all__ = ["Verifier", "VerifyOptions", "VerifyRow", "Tolerance", "DTYPE_TOLERANCES", "EXPECTED_ERROR"]
