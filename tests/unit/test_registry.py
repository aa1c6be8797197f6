"""The generic lazy registry (pdserve/registry.py): nothing is imported until a name is loaded, an
unknown name is a ValueError that lists the choices, and a malformed target is refused when the
registry is built."""

from __future__ import annotations

import sys

import pytest

from pdserve.registry import Registry


def test_imports_only_on_load(tmp_path, monkeypatch) -> None:
    (tmp_path / "pdserve_lazy_probe.py").write_text("class Thing:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "pdserve_lazy_probe", raising=False)
    reg: Registry[type] = Registry("probe", {"thing": "pdserve_lazy_probe:Thing"})
    assert "pdserve_lazy_probe" not in sys.modules
    assert list(reg) == ["thing"] and reg["thing"] == "pdserve_lazy_probe:Thing" and len(reg) == 1
    reg.check("thing")
    assert "pdserve_lazy_probe" not in sys.modules  # checking a name imports nothing either
    cls = reg.load("thing")
    assert cls.__name__ == "Thing" and "pdserve_lazy_probe" in sys.modules
    assert reg.load("thing") is cls


def test_unknown_name_lists_the_choices_in_order() -> None:
    reg: Registry[object] = Registry("widget", {"b": "json:dumps", "a": "json:loads"})
    with pytest.raises(ValueError, match=r"unknown widget 'c'; choose from b, a"):
        reg.load("c")
    assert reg.names == ("b", "a")


@pytest.mark.parametrize("target", ["json", "json:", ":dumps", "json.dumps"])
def test_malformed_target_is_refused(target: str) -> None:
    with pytest.raises(ValueError, match="not 'module:attr'"):
        Registry("widget", {"x": target})


def test_the_package_registries_load_by_name() -> None:
    from pdserve.router.policies import POLICIES as ROUTER_POLICIES
    from pdserve.router.policies import RoundRobin, make_policy
    from pdserve.scheduler.policies import POLICIES, Chunked

    assert POLICIES.load("chunked") is Chunked
    assert isinstance(make_policy("round-robin"), RoundRobin) and ROUTER_POLICIES.kind == "instance policy"
