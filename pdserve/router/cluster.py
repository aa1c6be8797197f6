"""`pdserve serve --disagg XpYd`: a local disaggregated cluster in one command.

Starts X prefill and Y decode instances as `pdserve serve` child processes on free local ports (KV over
shared memory, the machine's cores split evenly between them unless --num-threads says otherwise),
waits until every one answers, then runs the router in this process on --host/--port. Every other
option of the command line (model, scheduler, cache, ...) is passed on to every instance. Stopping the
router (Ctrl-C, SIGTERM) stops the instances.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
from collections.abc import Sequence

logger = logging.getLogger(__name__)

# serve options that the cluster sets per instance: (flag, takes a value)
_OWN_OPTIONS = {"--disagg": True, "--host": True, "--port": True, "--num-threads": True, "--role": True,
                "--kv-transfer": True, "--kv-transfer-host": True, "--kv-transfer-port": True,
                "--cluster-secret": True}


def parse_topology(spec: str) -> tuple[int, int]:
    """'1p1d' -> (1, 1); '2p1d' -> (2, 1)."""
    m = re.fullmatch(r"(\d+)p(\d+)d", spec.strip().lower())
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise ValueError(f"--disagg wants XpYd with X, Y >= 1 (e.g. 1p1d, 2p1d), got {spec!r}")
    return int(m.group(1)), int(m.group(2))


def instance_args(argv: Sequence[str]) -> list[str]:
    """The `serve` options of `argv` that every instance shares (the cluster sets the rest itself)."""
    args = list(argv)
    if "serve" in args:
        args = args[args.index("serve") + 1 :]
    out: list[str] = []
    i = 0
    while i < len(args):
        flag = args[i].split("=", 1)[0]
        if flag in _OWN_OPTIONS:
            i += 1 if "=" in args[i] or not _OWN_OPTIONS[flag] else 2
            continue
        out.append(args[i])
        i += 1
    return out


def serve_cluster(
    spec: str, argv: Sequence[str], host: str, port: int, num_threads: int | None, api_key: str | None = None
) -> int:
    from pdserve.config import RouterConfig
    from pdserve.router.app import serve_router
    from pdserve.server.launcher import ServerProcess

    # A fresh cluster secret: only this router can reserve KV blocks on, or send KV through, the
    # instances (passed in the environment, not on a command line that `ps` shows).
    secret = os.environ.get("PDSERVE_CLUSTER_SECRET") or secrets.token_hex(32)
    env = {**os.environ, "PDSERVE_CLUSTER_SECRET": secret}

    num_prefill, num_decode = parse_topology(spec)
    n = num_prefill + num_decode
    threads = num_threads or max(1, len(os.sched_getaffinity(0)) // n)
    shared = instance_args(argv)
    roles = ["prefill"] * num_prefill + ["decode"] * num_decode
    procs = [
        ServerProcess([*shared, "--role", role, "--kv-transfer", "shm", "--num-threads", str(threads)], env=env)
        for role in roles
    ]
    try:
        for p in procs:
            p.start()
        for p, role in zip(procs, roles):
            p.wait_ready()
            logger.info("%s instance ready at %s (pid %d, %d threads)", role, p.url, p.pid, threads)
        config = RouterConfig(
            prefill_urls=tuple(p.url for p, r in zip(procs, roles) if r == "prefill"),
            decode_urls=tuple(p.url for p, r in zip(procs, roles) if r == "decode"),
            host=host,
            port=port,
            api_key=api_key,
            cluster_secret=secret,
        )
        logger.info("router on http://%s:%d over %d prefill + %d decode", host, port, num_prefill, num_decode)
        serve_router(config)
    except RuntimeError as e:  # an instance did not start: its log says why
        logger.error("%s", e)
        return 1
    finally:
        for p in procs:
            p.close()
    return 0
