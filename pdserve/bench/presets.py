"""Server presets for `pdserve bench compare`: a name for a list of extra `pdserve serve` arguments.

A preset knows nothing about what its arguments mean, so any serving mode that `pdserve serve` can be
told to run with (a scheduling policy, prefix caching off, a disaggregated layout) is a preset. Built-in
ones are in `BUILTIN_PRESETS`; a TOML file adds more or replaces built-in ones:

    [presets.chunked-512]
    args = ["--scheduler", "chunked", "--chunk-size", "512"]
    description = "chunked prefill, 512-token chunks"
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType


@dataclass(frozen=True, slots=True)
class Preset:
    name: str
    args: tuple[str, ...]  # appended to `pdserve serve` (after the arguments common to every mode)
    description: str = ""


# `--speculative-config` of the `spec-ngram` preset (benchmarks/spec_serving.py's default "on" mode).
NGRAM_SPEC_CONFIG = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}'


BUILTIN_PRESETS: Mapping[str, Preset] = MappingProxyType(
    {
        p.name: p
        for p in (
            Preset("prefill-first", ("--scheduler", "prefill-first"), "new prompts first, whole prompts"),
            Preset(
                "chunked",
                ("--scheduler", "chunked", "--chunk-size", "256"),
                "chunked prefill, 256-token chunks alongside running decodes",
            ),
            Preset(
                "decode-priority",
                ("--scheduler", "decode-priority"),
                "prefills pause while many decodes run",
            ),
            Preset(
                "slo",
                ("--scheduler", "slo", "--slo-ttft-ms", "1000", "--slo-itl-ms", "100"),
                "prompt budget per step from the fitted step-time model (TTFT 1 s, ITL 100 ms targets)",
            ),
            Preset(
                "disagg-1p1d",
                ("--disagg", "1p1d", "--scheduler", "prefill-first"),
                "one prefill and one decode instance behind the router, KV over shared memory, cores split",
            ),
            Preset(
                "disagg-1p1d-chunked",
                ("--disagg", "1p1d", "--scheduler", "chunked", "--chunk-size", "256"),
                "1P1D with chunked prefill on the prefill instance (KV sent chunk by chunk)",
            ),
            Preset(
                "spec-ngram",
                ("--speculative-config", NGRAM_SPEC_CONFIG),
                "n-gram prompt lookup, k = 4 (window 2-5), the default length rule",
            ),
        )
    }
)


def _load_toml(path: str) -> dict:
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        try:
            import tomli as tomllib
        except ModuleNotFoundError as exc:
            raise ValueError(f"reading {path} on Python < 3.11 needs `pip install tomli`") from exc
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ValueError(f"cannot read presets file {path}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path} is not valid TOML: {exc}") from None


def parse_presets(data: Mapping, source: str = "presets file") -> dict[str, Preset]:
    """The presets of a parsed TOML document: every `[presets.NAME]` table with `args` (a list of strings)
    and an optional `description`."""
    tables = data.get("presets")
    if not isinstance(tables, Mapping) or not tables:
        raise ValueError(f"{source}: expected [presets.NAME] tables")
    presets: dict[str, Preset] = {}
    for name, table in tables.items():
        where = f"{source}: [presets.{name}]"
        if not isinstance(table, Mapping):
            raise ValueError(f"{where} must be a table")
        unknown = set(table) - {"args", "description"}
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}; expected args and description")
        args = table.get("args")
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise ValueError(f"{where}: args must be a list of strings")
        description = table.get("description", "")
        if not isinstance(description, str):
            raise ValueError(f"{where}: description must be a string")
        presets[name] = Preset(name, tuple(args), description)
    return presets


def load_presets(path: str | None = None) -> dict[str, Preset]:
    """The built-in presets, plus (and overridden by) those of the TOML file at `path`."""
    presets = dict(BUILTIN_PRESETS)
    if path is not None:
        presets.update(parse_presets(_load_toml(path), path))
    return presets


def resolve_modes(names: str | Sequence[str], presets: Mapping[str, Preset]) -> list[Preset]:
    """The presets named by `names` (a list, or one comma-separated string), in order."""
    if isinstance(names, str):
        names = names.split(",")
    names = [n.strip() for n in names if n.strip()]
    if not names:
        raise ValueError("no modes given: expected a comma-separated list of preset names")
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"mode given twice: {', '.join(duplicates)}")
    unknown = [n for n in names if n not in presets]
    if unknown:
        raise ValueError(
            f"unknown preset {', '.join(repr(n) for n in unknown)}: known presets are "
            f"{', '.join(sorted(presets))} (define more in a --presets TOML file)"
        )
    return [presets[n] for n in names]
