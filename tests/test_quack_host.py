"""Host-time guards around quack that run anywhere (CPU): the negative import entry."""

import sys

import pytest

from swiglu_train.ops.quack_mlp import remember_missing_module


def test_a_missing_module_fails_at_once_afterwards(monkeypatch, tmp_path):
    name = "swiglu_train_no_such_module_here"
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    remember_missing_module(name)
    assert sys.modules[name] is None
    (tmp_path / f"{name}.py").write_text("VALUE = 1\n")  # installed later: still refused
    with pytest.raises(ImportError, match=name):
        __import__(name)
    monkeypatch.delitem(sys.modules, name)


def test_an_installed_module_is_left_alone(monkeypatch, tmp_path):
    name = "swiglu_train_installed_probe_module"
    (tmp_path / f"{name}.py").write_text("VALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    remember_missing_module(name)
    assert name not in sys.modules
    assert __import__(name).VALUE == 7
    monkeypatch.delitem(sys.modules, name)


def test_an_imported_module_is_left_alone():
    before = sys.modules["json"] if "json" in sys.modules else __import__("json")
    remember_missing_module("json")
    assert sys.modules["json"] is before
