"""The code-editing workload: prompts that ask to rename, fix or annotate one given function, so that a
good answer repeats most of the prompt (the case n-gram speculation is built for).

The functions come from the Python standard library of the running interpreter (nothing to download, the
same files for the same Python version): `.py` files under `sysconfig`'s stdlib path, tests and vendored
packages left out, sorted, then shuffled by the seed. From each file in turn one function (or method)
whose quoted source is `mix.min_len`..`mix.max_len` tokens is taken, and one of three edits is asked:

- rename: an argument or local variable of the function, to a new name, everywhere in it;
- fix: a bug planted in the quoted code (the first `==`, `<`, `+ 1`, ... flipped), to be fixed;
- annotate: type hints on the signature, the body unchanged.

Each request asks for the function's length plus 32 tokens (room for the rewrite), or `mix.output_len`.
Deterministic for a seed (and Python version); one function per file, so prompts are all different.
"""

from __future__ import annotations

import ast
import os
import random
import sysconfig
import textwrap
from collections.abc import Iterator

from pdserve.bench.datasets import SampleRequest, Tokenizer
from pdserve.config import CodeEditMix

# Directories of the stdlib tree that are not its own code (tests, demos, installed packages).
SKIP_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib2to3", "turtledemo",
     "ensurepip", "venv", "config-3"}
)
# (what the code says, the planted bug): the first of these that occurs in a function is flipped.
BUGS = (
    (" == ", " != "), (" < ", " <= "), (" > ", " >= "), (" + 1", " - 1"), (" and ", " or "),
    (" is None", " is not None"),
)
OUTPUT_MARGIN = 32  # tokens asked for beyond the function's own length


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def source_files(root: str) -> list[str]:
    """The `.py` files under `root` outside `SKIP_DIRS`, as sorted paths relative to it."""
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith("config-")]
        rel = os.path.relpath(dirpath, root)
        found += [os.path.normpath(os.path.join(rel, f)) for f in filenames if f.endswith(".py")]
    return sorted(found)


def functions(source: str) -> Iterator[tuple[ast.FunctionDef, str]]:
    """Each function or method of `source` with its own dedented source text, in file order."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    lines = source.splitlines(keepends=True)
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and not node.decorator_list and node.end_lineno is not None:
            # Whole lines: a def starts its line (after indentation) and its body ends one.
            yield node, textwrap.dedent("".join(lines[node.lineno - 1 : node.end_lineno]))


def _names(fn: ast.FunctionDef) -> list[str]:
    """Arguments and assigned local names worth renaming (not self/cls, at least 2 characters), sorted."""
    names = {a.arg for a in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]}
    names |= {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    return sorted(n for n in names if n not in ("self", "cls") and len(n) >= 2)


def edit_prompt(fn: ast.FunctionDef, code: str, rng: random.Random) -> str:
    """One edit request about `code` (the source of `fn`): the kinds in a seeded order, the first that has
    something to work on (annotation always has)."""
    kinds = ["rename", "fix", "annotate"]
    rng.shuffle(kinds)
    names = _names(fn)
    bug = next(((a, b) for a, b in BUGS if a in code), None)
    for kind in kinds:
        if kind == "rename" and names:
            old = rng.choice(names)
            new = f"{old}_{rng.choice(('value', 'item', 'result', 'arg'))}"
            ask = (
                f"Rename `{old}` to `{new}` everywhere in this Python function and return the whole "
                "function."
            )
            break
        if kind == "fix" and bug is not None:
            code = code.replace(bug[0], bug[1], 1)
            ask = "This Python function has a bug. Fix it and return the whole corrected function."
            break
        if kind == "annotate":
            ask = (
                "Add type hints to the signature of this Python function, keep the body unchanged, and "
                "return the whole function."
            )
            break
    return f"{ask}\n\n```python\n{code.rstrip()}\n```"


def sample_code_edit(
    tokenizer: Tokenizer,
    num_prompts: int,
    seed: int = 0,
    mix: CodeEditMix = CodeEditMix(),
    *,
    root: str | None = None,
) -> list[SampleRequest]:
    """`num_prompts` code-editing requests drawn from the Python sources under `root` (default: the
    standard library). Returns fewer (the caller warns or fails) only if the sources run out."""
    if num_prompts < 0:
        raise ValueError(f"num_prompts must be >= 0, got {num_prompts}")
    root = root or stdlib_root()
    rng = random.Random(seed)
    files = source_files(root)
    rng.shuffle(files)
    samples: list[SampleRequest] = []
    for rel in files:
        if len(samples) == num_prompts:
            break
        try:
            with open(os.path.join(root, rel), encoding="utf-8") as f:
                source = f.read()
        except (OSError, UnicodeDecodeError):
            continue
        # Characters first (a token is 1-8 of them in code), then tokens, in a seeded order until one fits:
        # few functions are tokenized.
        near = [(fn, code) for fn, code in functions(source) if mix.min_len <= len(code) <= 8 * mix.max_len]
        rng.shuffle(near)
        fit = (pair for pair in near if mix.min_len <= len(tokenizer.encode(pair[1])) <= mix.max_len)
        picked = next(fit, None)
        if picked is None:
            continue
        fn, code = picked
        prompt = edit_prompt(fn, code, rng)
        prompt_len = len(tokenizer.encode(prompt))
        output_len = mix.output_len or len(tokenizer.encode(code)) + OUTPUT_MARGIN
        if prompt_len + output_len > mix.max_total_len:
            continue
        samples.append(SampleRequest(prompt, prompt_len, output_len))
    return samples
