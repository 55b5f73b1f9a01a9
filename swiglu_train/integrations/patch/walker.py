"""``patch``: find the SwiGLU MLPs of a model by structure and swap in PatchedSwiGLU."""

from __future__ import annotations

import logging
import re

from torch import nn

from swiglu_train.integrations.patch import guard, hf, litgpt, torchtitan
from swiglu_train.integrations.patch.module import PatchedSwiGLU
from swiglu_train.integrations.patch.report import Left, PatchReport, Replaced
from swiglu_train.integrations.patch.spec import HostSpec
from swiglu_train.layers import ParMLP, check_impl_name

logger = logging.getLogger("swiglu_train.patch")
SPECS: tuple[HostSpec, ...] = (*hf.SPECS, *litgpt.SPECS, *torchtitan.SPECS)
# class names that read as an MLP: reported when left, so nothing MLP-like goes unmentioned
_MLP_NAME = re.compile(r"(mlp|feedforward|feed_forward|ffn|experts?)$", re.IGNORECASE)


def patch(
    model: nn.Module,
    impl: str = "drop_h",
    *,
    tokens_hint: int | None = None,
    chunk: int | None = None,
    inplace: bool = True,
) -> PatchReport:
    """Replace every SwiGLU MLP of ``model`` (Hugging Face, LitGPT, torchtitan layouts) with a
    PatchedSwiGLU running ``impl``; return and log what was replaced and what was left, why.

    ``impl="auto"`` picks per layer shape from its cost model at ``tokens_hint`` (tokens
    per micro-batch); ``chunk`` and ``inplace`` are ParMLP's. Checkpoints keep the host's keys
    and values. Create the optimizer after this call: one created before holds the replaced
    weights, and its first step raises. Every replacement is built (and its options checked)
    before any is swapped in, so a refused option leaves the model as it was.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"patch expects an nn.Module, got {type(model).__name__}")
    check_impl_name(impl)
    options = {"impl": impl, "tokens_hint": tokens_hint, "chunk": chunk, "inplace": inplace}
    report, plans = PatchReport(), []
    skip: list[str] = []  # modules replaced or already patched: their insides are not walked
    for name, module in model.named_modules():
        if any(name.startswith(f"{s}.") for s in skip):
            continue
        host_class = type(module).__qualname__
        if isinstance(module, ParMLP):  # ours already: switch_impl changes its impl
            skip.append(name)
            what = "already patched" if isinstance(module, PatchedSwiGLU) else "already a ParMLP"
            report.left.append(Left(name, host_class, f"{what} (impl {module.impl})"))
            continue
        spec, reason = _recognize(module)
        if spec is not None and reason is None:
            reason = _placement(model, name)
        if reason is None:
            skip.append(name)
            shell = PatchedSwiGLU.build(module, spec, **options)  # on meta: options checked
            plans.append((name, module, spec, shell))
        elif spec is not None or _MLP_NAME.search(host_class):
            report.left.append(Left(name, host_class, reason))
    for name, module, spec, shell in plans:
        old = dict(module.named_parameters())
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, shell.fill_from(module))
        guard.remember({f"{name}.{n}": p for n, p in old.items()})
        shape = (shell.hidden_size, shell.ffn_hidden_size, shell.fc2.out_features)
        report.replaced.append(
            Replaced(name, type(module).__qualname__, spec.library, shell.impl,
                     shell.auto_reason, shape)
        )  # fmt: skip
    logger.info("%s", report.summary())
    return report


def _recognize(module: nn.Module) -> tuple[HostSpec | None, str | None]:
    """(spec, None) for a SwiGLU MLP; (spec, why not) when a layout fits but a check fails;
    (None, why) for a module no layout fits."""
    for spec in SPECS:
        if spec.fits(module):
            return spec, spec.mismatch(module)
    children = ", ".join(n for n, _ in module.named_children()) or "none"
    if "expert" in type(module).__name__.lower():
        return None, "MoE experts, not a dense MLP (routed token subsets): left to the MoE"
    return None, (
        f"not a SwiGLU layout of transformers, LitGPT or torchtitan (its children: {children})"
    )


def _placement(model: nn.Module, name: str) -> str | None:
    """Why a recognized MLP cannot be replaced where it sits; None when it can."""
    if not name:
        return "the model itself is the MLP: patch the module that holds it"
    parent_name, _, _ = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    if isinstance(parent, nn.ModuleList) and parent_name.rpartition(".")[2].endswith("experts"):
        return "an MoE expert (routed token subsets, expert-parallel layouts): left to the MoE"
    return None
