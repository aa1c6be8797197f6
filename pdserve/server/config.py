"""Configuration of the server: the engine's `EngineConfig` plus what only the HTTP front needs.

(It sits here rather than in `pdserve/config.py` only while that file is being edited by others.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.config import EngineConfig, ModelConfig


# Seconds an idle HTTP keep-alive connection stays open (uvicorn's default is 5): longer than clients'
# pool timeouts (aiohttp 15 s, httpx 5 s), so a client never sends on a connection being closed.
KEEP_ALIVE_S = 75


@dataclass(frozen=True, slots=True)
class RandomModelSpec:
    """Serve a randomly initialised model with the tokenizer of `EngineConfig.model` (tests: a tiny model
    whose vocabulary matches the real tokenizer's, so the whole HTTP path runs in milliseconds per step)."""

    model_config: ModelConfig
    seed: int = 0
    std: float = 0.02


@dataclass(frozen=True, slots=True)
class ServerConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # None: the model file's or directory's name
    # At most this many requests may wait for their first token (in flight to the engine or in its waiting
    # queue); beyond it the server answers 503 at once instead of queueing without bound.
    max_waiting: int = 512
    stats_interval_s: float = 10.0  # period of the one-line stats log; 0 turns it off
    startup_timeout_s: float = 600.0
    shutdown_timeout_s: float = 5.0  # how long open streams may run on after SIGINT/SIGTERM
    access_log: bool = False
    log_level: str = "info"  # of the engine core process's own log lines
    random_model: RandomModelSpec | None = None
    # Supervision of the engine core process: restart it when it dies, after restart_backoff_s doubled for
    # every other death within restart_window_s (at most restart_backoff_max_s); /health is unhealthy
    # while the core's loop has not been heard from for heartbeat_timeout_s.
    restart_engine: bool = True
    restart_backoff_s: float = 0.5
    restart_backoff_max_s: float = 30.0
    restart_window_s: float = 60.0
    heartbeat_timeout_s: float = 30.0
    # Bounds on what one client may cost: body size (413 beyond), the time its body may take to arrive
    # (408), an optional limit on a whole generation request (504 / an error event; None: no limit), the
    # Host names served (None: any), and concurrent connections (503 beyond).
    max_body_bytes: int = 4 * 2**20
    header_timeout_s: float = 10.0  # a connection whose request head has not arrived by then is closed
    body_timeout_s: float = 30.0
    request_timeout_s: float | None = None
    allowed_hosts: tuple[str, ...] | None = None
    max_connections: int = 2048
    # Authentication: clients send `Authorization: Bearer <api_key>` (None: no key needed); the router of
    # a disaggregated cluster sends the cluster secret, which alone unlocks kv_transfer_params and /load.
    api_key: str | None = None
    cluster_secret: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port}")
        if self.max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {self.max_waiting}")
        if self.stats_interval_s < 0:
            raise ValueError("stats_interval_s must be >= 0")
        for name in ("restart_backoff_s", "restart_backoff_max_s", "restart_window_s", "heartbeat_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if not self.body_timeout_s > 0 or not self.header_timeout_s > 0 or (self.request_timeout_s is not None and not self.request_timeout_s > 0):
            raise ValueError("header_timeout_s, body_timeout_s and request_timeout_s must be > 0")
        for name in ("api_key", "cluster_secret"):
            if getattr(self, name) is not None and len(getattr(self, name)) < 8:
                raise ValueError(f"{name} must have at least 8 characters")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
