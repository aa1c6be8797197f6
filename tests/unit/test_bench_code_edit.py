"""The code-edit workload: functions of Python sources quoted in rename/fix/annotate requests,
deterministic for a seed, within the length limits, through the bench's dataset registry."""

from __future__ import annotations

import re

import pytest

from pdserve.bench.code_edit import OUTPUT_MARGIN, sample_code_edit, source_files
from pdserve.bench.serve_bench import workload_samples
from pdserve.config import CodeEditMix, Workload

CODE = re.compile(r"```python\n(.*)\n```", re.S)


class CharTokenizer:
    """One token per character: lengths are easy to check by hand."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 256 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))


SOURCE = '''
def area(width, height):
    """Area of a rectangle."""
    if width == 0 or height == 0:
        return 0
    return width * height


class Box:
    def grow(self, amount):
        total = self.size + amount
        self.size = total + 1
        return self.size
'''


def test_deterministic_and_within_limits() -> None:
    tok, mix = CharTokenizer(), CodeEditMix(min_len=80, max_len=400)
    a = sample_code_edit(tok, 12, seed=3, mix=mix)
    assert a == sample_code_edit(tok, 12, seed=3, mix=mix)
    assert a != sample_code_edit(tok, 12, seed=4, mix=mix)
    assert len(a) == 12 and len({s.prompt for s in a}) == 12
    for s in a:
        code = CODE.search(s.prompt)
        assert code is not None, s.prompt
        n = len(code.group(1))
        assert 80 - 1 <= n <= 400  # (the quoted text drops the function's final newline)
        assert s.prompt_len == len(s.prompt)
        assert n + OUTPUT_MARGIN <= s.output_len <= n + 8 + OUTPUT_MARGIN  # room to repeat the function
        assert code.group(1).lstrip().startswith("def ")


def test_edits_from_given_sources(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "shapes.py").write_text(SOURCE)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(SOURCE)  # left out: a test directory
    assert source_files(str(tmp_path)) == ["pkg/shapes.py"]
    mix = CodeEditMix(min_len=20, max_len=300, output_len=50)
    kinds = set()
    for seed in range(12):
        (s,) = sample_code_edit(CharTokenizer(), 1, seed, mix, root=str(tmp_path))
        assert s.output_len == 50
        code = CODE.search(s.prompt).group(1)  # type: ignore[union-attr]
        ask = s.prompt.split("\n", 1)[0]
        kinds.add(ask.split()[0])
        if ask.startswith("Rename"):
            old, new = re.findall(r"`([^`]+)`", ask)
            assert old in code and new.startswith(old + "_")
        elif ask.startswith("This"):  # a planted bug: the quoted code is not the source's
            assert " != " in code or " - 1" in code or " or " in code or " <= " in code
    assert kinds == {"Rename", "This", "Add"}
    # One function per file: only one prompt from one file.
    assert len(sample_code_edit(CharTokenizer(), 5, 0, mix, root=str(tmp_path))) == 1


def test_through_the_registry() -> None:
    w = Workload(dataset="code-edit", num_prompts=3, seed=1, code_edit=CodeEditMix(min_len=64, max_len=300))
    samples = workload_samples(w, CharTokenizer())
    assert len(samples) == 3 and all("```python" in s.prompt for s in samples)


def test_limits_are_checked() -> None:
    with pytest.raises(ValueError):
        CodeEditMix(min_len=10, max_len=5)
    with pytest.raises(ValueError):
        CodeEditMix(max_len=4096, max_total_len=2048)
