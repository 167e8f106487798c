"""autodeploy: deploy Hugging Face causal LMs through an observable pipeline of graph transforms."""

from .api import optimize
from .errors import AutoDeployError, VerificationError
from .llm import LLM, SamplingParams

__version__ = "0.1.0"
__all__ = ["optimize", "LLM", "SamplingParams", "AutoDeployError", "VerificationError", "__version__"]
