"""Building pdserve's C++ extensions (`torch.utils.cpp_extension.load`), safe against interrupted builds.

torch serialises builds of one extension with a lock *file* in its build directory. A build killed
midway (Ctrl-C during a first start, an OOM kill, a test timeout) leaves that file behind, and every later
start then waits on it forever, silently. pdserve instead takes an OS lock (`fcntl.flock`, released by
the kernel when its holder dies) around each build; whoever holds it knows that no live pdserve build
owns a torch lock file still lying there, removes it with a warning, and builds or loads."""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger(__name__)


def _build_directory(name: str) -> str:
    from torch.utils import cpp_extension

    get = getattr(cpp_extension, "_get_build_directory", None)
    if get is not None:
        return str(get(name, False))
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    return os.path.join(root, name)


def load_extension(name: str, sources: list[str], extra_cflags: list[str], extra_ldflags: list[str]) -> Any:
    """`torch.utils.cpp_extension.load` under an OS lock, clearing a lock file a dead build left behind."""
    from torch.utils.cpp_extension import load

    build_dir = _build_directory(name)
    os.makedirs(build_dir, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # no flock (not Linux/macOS): torch's own lock file only
        return load(name=name, sources=sources, extra_cflags=extra_cflags, extra_ldflags=extra_ldflags, verbose=False)
    with open(os.path.join(build_dir, "pdserve-build.lock"), "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # waits for a live build by another process; released if it dies
        try:
            stale = os.path.join(build_dir, "lock")
            if os.path.exists(stale):
                logger.warning("removing %s, left by an interrupted build of %s", stale, name)
                os.remove(stale)
            return load(name=name, sources=sources, extra_cflags=extra_cflags, extra_ldflags=extra_ldflags, verbose=False)
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)
