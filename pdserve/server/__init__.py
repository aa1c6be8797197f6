"""The OpenAI-compatible server: an HTTP front (FastAPI + uvicorn) and an engine core in its own process.

A request arrives at a route of `api.py`, is parsed, tokenized and validated by `front.Server`, and handed
to `EngineClient` (`engine/process/client.py`), which sends it over ZMQ (msgpack,
`engine/process/messages.py`) to the engine core process (`engine/process/core.py`). The core runs
`LLMEngine.step()` in a loop and sends back each step's deltas; the client routes them to the waiting
HTTP handler, which `responses.py` streams as SSE or collects into one response. `metrics.py` turns
those deltas and the core's per-step stats into Prometheus metrics. `http.py` is the HTTP plumbing the
router shares, `wire.py` the router <-> instance protocol, `guards.py` the per-client bounds and auth.
"""
