"""The engine in its own process: `core.py` runs an `LLMEngine` loop behind ZMQ, `client.py` is the
front's `EngineClient` (spawns, feeds and supervises the core, on the front's event loop), `messages.py`
holds the msgspec structs the two exchange."""
