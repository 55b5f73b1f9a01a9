"""All-or-nothing loads: a state_dict is checked for every ParMLP of a model before torch writes
any parameter of it.

torch's ``load_state_dict`` walks the module tree and writes each module's parameters in turn,
running a module's load pre-hooks just before its own. A check in each ParMLP's own hook finds
a bad stamp in the last layer after the first layers (and the embedding before them) were
overwritten, and leaves the model half-loaded. So the module a load starts from checks the
entries of every :class:`CheckedLoad` module under it first.

torch does not say which module a load will start from: any module holding a ParMLP may be
loaded into. So each such module gets the check as a load pre-hook, which acts only where the
load starts (prefix ""). Modules learn that they hold one through torch's global module
registration hook (installed on import): it records each child's parents, weakly, and when a
ParMLP, or a module holding one, is registered under a parent, that parent and its known
ancestors are hooked. This covers models built bottom-up and ParMLPs set into a finished model
alike. A parent link torch's registration never reports (``ModuleList.insert``, writes to
``_modules``, modules built before this import) is not followed: there each ParMLP's own hook
still refuses a bad entry before its own parameters are written.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping

import torch
from torch import nn


class CheckedLoad:
    """A module that can check its entries of a state_dict without loading them."""

    def check_state_dict(self, state_dict: Mapping, prefix: str) -> object:
        """Raise if the entries under ``prefix`` cannot load into this module; change nothing."""
        raise NotImplementedError


# Keyed by id(), with a weak reference per module whose callback forgets it: a module class
# may define __eq__ without __hash__, which a WeakKeyDictionary or WeakSet would trip on.
_refs: dict[int, weakref.ref] = {}
_parents: dict[int, list[weakref.ref]] = {}
_hooked: set[int] = set()


def _remember(module: nn.Module) -> int:
    key = id(module)
    if key not in _refs:
        _refs[key] = weakref.ref(module, lambda _, key=key: _forget(key))
    return key


def _forget(key: int) -> None:
    _refs.pop(key, None)
    _parents.pop(key, None)
    _hooked.discard(key)


def _on_register(parent: nn.Module, name: str, child: nn.Module | None) -> None:
    """torch's module registration hook: note the link, and hook the parent's line if the
    child holds a checked module. Not while dynamo traces: a forward that slices a ModuleList
    (HF's ``self.layers[:n]``) registers into a throwaway container, and tracing these id()-keyed
    tables (weak references with callbacks) failed with a KeyError under torch.compile."""
    if child is None or torch.compiler.is_compiling():
        return
    parents = _parents.setdefault(_remember(child), [])
    if not any(ref() is parent for ref in parents):
        _remember(parent)
        parents.append(weakref.ref(parent))
    if isinstance(child, CheckedLoad) or id(child) in _hooked:
        _hook_line(parent)


def _hook_line(module: nn.Module) -> None:
    """Give ``module`` and each known ancestor the whole-load check (once each)."""
    todo = [module]
    while todo:
        current = todo.pop()
        if current is None or id(current) in _hooked:
            continue
        current.register_load_state_dict_pre_hook(_check_whole_load)
        _hooked.add(_remember(current))
        todo.extend(ref() for ref in _parents.get(id(current), ()))


def _check_whole_load(module: nn.Module, state_dict: Mapping, prefix: str, *args) -> None:
    """load_state_dict pre-hook: where the load starts, check every checked module's entries
    before any parameter is written; deeper down the module the load started from did."""
    if prefix:
        return
    for name, sub in module.named_modules(remove_duplicate=False):
        if isinstance(sub, CheckedLoad):
            sub.check_state_dict(state_dict, f"{name}." if name else "")


nn.modules.module.register_module_module_registration_hook(_on_register)
