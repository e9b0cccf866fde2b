"""``speculant serve``: an OpenAI-compatible HTTP server with speculative decoding.

One engine loop (a background thread, :class:`AsyncEngine`) batches every concurrent request
continuously; FastAPI handlers enqueue requests and await their results or SSE streams. Needs the
``server`` extra: ``pip install 'speculant[server]'``.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

logger = logging.getLogger("speculant.server")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def _need_extra() -> None:
    missing = []
    for mod in ("fastapi", "uvicorn", "prometheus_client"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    if missing:
        raise RuntimeError(f"speculant serve needs {', '.join(missing)}; install the server extra: "
                           "pip install 'speculant[server]'")


def build_server(llm, served_model_names: list[str] | None = None, api_key: str | None = None,
                 max_waiting_seqs: int = 256, split_special_tokens: bool = False):
    """An :class:`OpenAIServer` around ``llm`` (a :class:`speculant.LLM`), engine loop not started.
    Its FastAPI app is ``.app``; start the loop with ``.a.start()``."""
    _need_extra()
    from speculant.server.app import OpenAIServer
    from speculant.server.async_engine import AsyncEngine
    from speculant.server.metrics import ServerMetrics

    names = served_model_names or [llm.config.model or DEFAULT_MODEL_NAME]
    metrics = ServerMetrics(names[0])
    aengine = AsyncEngine(llm.engine, max_waiting_seqs=max_waiting_seqs, metrics=metrics)
    metrics.bind(aengine)
    return OpenAIServer(aengine, names, api_key=api_key, metrics=metrics,
                        model_root=str(llm.engine.model_path),
                        split_special_tokens=split_special_tokens)


def run_server(host: str = "127.0.0.1", port: int = 8000, served_model_names: list[str] | None = None,
               api_key: str | None = None, max_waiting_seqs: int = 256, log_level: str = "info",
               split_special_tokens: bool = False, **llm_kwargs: Any) -> int:
    """Load the model, start the engine loop and serve until interrupted (blocking)."""
    _need_extra()
    import uvicorn

    from speculant.llm import LLM

    llm = LLM(**llm_kwargs)
    server = build_server(llm, served_model_names, api_key, max_waiting_seqs, split_special_tokens)
    server.a.start()
    spec = llm.config.speculative_config
    print(f"speculant serve: model {server.names[0]!r} at http://{host}:{port}/v1 "
          f"(speculative_config={spec}, max_num_seqs={llm.config.max_num_seqs}, "
          f"tensor_parallel_size={llm.config.tensor_parallel_size})",
          file=sys.stderr, flush=True)
    try:
        uvicorn.run(server.app, host=host, port=port, log_level=log_level, access_log=False,
                    timeout_graceful_shutdown=5)
    finally:
        server.a.shutdown()
        llm.close()  # the tensor-parallel workers, if any
    return 0


__all__ = ["build_server", "run_server", "DEFAULT_MODEL_NAME"]
