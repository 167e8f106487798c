"""``autodeploy serve``: an OpenAI-compatible HTTP server over the engine.

- :mod:`.protocol`: OpenAI's request / response shapes (pydantic) and the error JSON;
- :mod:`.engine_loop`: the one thread that runs the engine for every request (continuous batching);
- :mod:`.app`: the FastAPI app (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``,
  ``/health``, ``/metrics``);
- :mod:`.metrics`: the Prometheus metrics;
- :mod:`.server`: the command (uvicorn, signals, the address printed once ready).
"""

from .app import build_app  # noqa: F401
