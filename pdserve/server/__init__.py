"""The OpenAI-compatible server: an HTTP front (FastAPI + uvicorn) and an engine core in its own process.

A request arrives at `api.py`, is parsed, tokenized and validated there, and handed to `EngineClient`,
which sends it over ZMQ (msgpack, `engine/process/messages.py`) to the engine core process
(`engine/process/core.py`). The core
runs `LLMEngine.step()` in a loop and sends back each step's deltas; the client routes them to the waiting
HTTP handler, which streams them as SSE or collects them into one response. `metrics.py` turns those
deltas and the core's per-step stats into Prometheus metrics. `http.py` is the HTTP plumbing the router
shares, `wire.py` the router <-> instance protocol.
"""
