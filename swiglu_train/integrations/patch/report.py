"""What ``patch`` replaced, with the impl each got, and what it left alone and why."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Replaced:
    name: str  # the module's qualified name in the model
    host_class: str
    library: str
    impl: str  # the concrete impl (what "auto" resolved to)
    auto_reason: str | None  # why auto chose it; None for a named impl
    shape: tuple[int, int, int]  # (D, F, O): hidden, ffn and output size (per expert)
    num_experts: int | None = None  # routed experts (a ParExperts); None for a dense MLP
    note: str | None = None  # why routed experts run another impl than the one asked for


@dataclass(frozen=True)
class Left:
    name: str
    host_class: str
    reason: str


@dataclass
class PatchReport:
    """Returned (and logged) by ``swiglu_train.patch``; ``str()`` is a grouped summary."""

    replaced: list[Replaced] = field(default_factory=list)
    left: list[Left] = field(default_factory=list)

    @property
    def impls(self) -> Counter[str]:
        """How many MLPs (dense or routed experts) got each impl."""
        return Counter(r.impl for r in self.replaced)

    def summary(self) -> str:
        """One line per (class, impl) replaced and per (class, reason) left, with counts and
        the first module's name: a model of 80 layers reports in a few lines, not 80."""
        lines = [f"swiglu_train.patch: replaced {len(self.replaced)} MLP(s), left {len(self.left)}"]
        groups: dict[tuple, list[str]] = {}
        for r in self.replaced:
            why = r.note or (f"auto: {r.auto_reason}" if r.auto_reason else None)
            impl = r.impl if r.num_experts is None else f"{r.num_experts} experts {r.impl}"
            key = ("replaced", r.library, r.host_class, impl, why)
            groups.setdefault(key, []).append(r.name)
        for entry in self.left:
            groups.setdefault(("left", entry.host_class, entry.reason), []).append(entry.name)
        for key, names in groups.items():
            where = names[0] + (f" and {len(names) - 1} more" if len(names) > 1 else "")
            if key[0] == "replaced":
                _, library, cls, impl, why = key
                why = f" ({why})" if why else ""
                lines.append(f"  replaced {len(names)} x {library} {cls} -> {impl}{why}: {where}")
            else:
                _, cls, reason = key
                lines.append(f"  left {len(names)} x {cls}: {reason}: {where}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()
