"""Presets for `bench compare`: built-in ones, more from a TOML file, and clear errors for unknown names and
malformed files."""

from __future__ import annotations

import pytest

from pdserve.bench.presets import BUILTIN_PRESETS, Preset, load_presets, resolve_modes

TOML = """
[presets.chunked-512]
args = ["--scheduler", "chunked", "--chunk-size", "512"]
description = "chunked prefill, 512-token chunks"

[presets.chunked]
args = ["--scheduler", "chunked", "--chunk-size", "64"]

[presets.disagg-1p1d]
args = ["--disagg", "1p1d"]
"""


def write(tmp_path, text: str) -> str:
    path = tmp_path / "presets.toml"
    path.write_text(text)
    return str(path)


def test_builtin_presets_are_argument_lists():
    assert {"prefill-first", "chunked", "decode-priority"} <= set(BUILTIN_PRESETS)
    assert BUILTIN_PRESETS["chunked"].args == ("--scheduler", "chunked", "--chunk-size", "256")
    for name, preset in BUILTIN_PRESETS.items():
        assert preset.name == name and all(isinstance(a, str) for a in preset.args)
    with pytest.raises(TypeError):
        BUILTIN_PRESETS["x"] = Preset("x", ())  # type: ignore[index]


def test_toml_adds_and_overrides_presets(tmp_path):
    presets = load_presets(write(tmp_path, TOML))
    assert presets["chunked-512"] == Preset(
        "chunked-512", ("--scheduler", "chunked", "--chunk-size", "512"), "chunked prefill, 512-token chunks"
    )
    assert presets["chunked"].args[-1] == "64" and presets["chunked"].description == ""
    assert presets["disagg-1p1d"].args == ("--disagg", "1p1d")
    assert presets["prefill-first"] == BUILTIN_PRESETS["prefill-first"]
    assert BUILTIN_PRESETS["chunked"].args[-1] == "256"  # the file does not change the built-in table


def test_resolve_modes_in_order(tmp_path):
    presets = load_presets(write(tmp_path, TOML))
    modes = resolve_modes(" chunked-512, prefill-first ,", presets)
    assert [m.name for m in modes] == ["chunked-512", "prefill-first"]
    assert [m.name for m in resolve_modes(["decode-priority"], presets)] == ["decode-priority"]


def test_unknown_mode_is_a_clear_error():
    with pytest.raises(ValueError) as err:
        resolve_modes("prefill-first,fastest", load_presets())
    message = str(err.value)
    assert "unknown preset 'fastest'" in message
    assert ", ".join(sorted(BUILTIN_PRESETS)) in message and "--presets" in message


@pytest.mark.parametrize("names,match", [("", "no modes"), ("chunked,chunked", "given twice")])
def test_bad_mode_lists(names, match):
    with pytest.raises(ValueError, match=match):
        resolve_modes(names, load_presets())


@pytest.mark.parametrize(
    "text,match",
    [
        ('[presets.a]\nargs = "--scheduler chunked"\n', "list of strings"),
        ("[presets.a]\nargs = [1, 2]\n", "list of strings"),
        ('[presets.a]\nargs = []\nflags = ["x"]\n', "unknown keys"),
        ('[presets.a]\nargs = []\ndescription = 3\n', "description"),
        ('[other]\nx = 1\n', r"\[presets.NAME\]"),
        ("[presets.a\nargs = []\n", "not valid TOML"),
    ],
)
def test_malformed_files(tmp_path, text, match):
    with pytest.raises(ValueError, match=match):
        load_presets(write(tmp_path, text))


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match="cannot read presets file"):
        load_presets(str(tmp_path / "none.toml"))
