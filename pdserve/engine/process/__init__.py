"""The engine in its own process: `core.py` runs an `LLMEngine` loop behind ZMQ, `messages.py` holds the
msgspec structs the server's `EngineClient` and the core exchange."""
