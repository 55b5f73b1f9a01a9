"""``patch``: find the SwiGLU MLPs and routed experts of a model by structure and swap in
PatchedSwiGLU and PatchedExperts."""

from __future__ import annotations

import logging
import re

from torch import nn

from swiglu_train.integrations.patch import (
    guard,
    hf,
    hf_experts,
    hf_llama4,
    litgpt,
    torchtitan,
    torchtitan_experts,
)
from swiglu_train.integrations.patch.experts import ExpertsHost, PatchedExperts
from swiglu_train.integrations.patch.module import PatchedSwiGLU
from swiglu_train.integrations.patch.report import Left, PatchReport, Replaced
from swiglu_train.integrations.patch.spec import HostSpec
from swiglu_train.integrations.patch.torchtitan_experts import PatchedRoutedExperts
from swiglu_train.layers import ParMLP, check_impl_name
from swiglu_train.layers.experts import ParExperts, resolve_experts_impl

logger = logging.getLogger("swiglu_train.patch")
SPECS: tuple[HostSpec, ...] = (*hf.SPECS, *litgpt.SPECS, *torchtitan.SPECS)
# a whole MoE block's host comes before the experts' hosts: the walk meets the block first
EXPERTS_HOSTS: tuple[ExpertsHost, ...] = (hf_llama4.HOST, hf_experts.HOST, torchtitan_experts.HOST)
# class names that read as an MLP: reported when left, so nothing MLP-like goes unmentioned
_MLP_NAME = re.compile(r"(mlp|feedforward|feed_forward|ffn|experts?)$", re.IGNORECASE)


def patch(
    model: nn.Module,
    impl: str = "drop_h",
    *,
    tokens_hint: int | None = None,
    chunk: int | None = None,
    inplace: bool = True,
    saved_fp8: bool = False,
    experts_impl: str | None = None,
) -> PatchReport:
    """Replace every SwiGLU MLP of ``model`` (Hugging Face, LitGPT, torchtitan layouts) with a
    PatchedSwiGLU running ``impl``, and every block of routed SwiGLU experts (transformers 5's
    experts interface and Llama-4's MoE block, torchtitan's MoE) with a PatchedExperts running
    ``experts_impl``; return and log what was replaced and what was left, why.

    ``impl="auto"`` picks per layer shape from its cost model at ``tokens_hint`` (tokens
    per micro-batch); ``chunk`` and ``inplace`` are ParMLP's; ``saved_fp8`` keeps drop_h's
    preactivation in e4m3, dense and experts alike. ``experts_impl`` (normal, drop_h,
    drop_h_quack) defaults to ``impl`` where the experts have it, else to drop_h (the report
    says why). Checkpoints keep the host's keys and values. Create the optimizer after this
    call: one created before holds the replaced weights, and its first step raises. Every
    replacement is built (and its options checked) before any is swapped in, so a refused
    option leaves the model as it was.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"patch expects an nn.Module, got {type(model).__name__}")
    check_impl_name(impl)
    options = {"impl": impl, "tokens_hint": tokens_hint, "chunk": chunk, "inplace": inplace}
    options["saved_fp8"] = saved_fp8
    experts, note = resolve_experts_impl(impl, experts_impl)
    experts_options = {"impl": experts, "saved_fp8": saved_fp8, "inplace": inplace}
    report, plans = PatchReport(), []
    skip: list[str] = []  # modules replaced or already patched: their insides are not walked
    for name, module in model.named_modules():
        if any(name == s or name.startswith(f"{s}.") for s in skip):
            continue
        host_class = type(module).__qualname__
        ours = _already(module)
        if ours:  # switch_impl (ParMLP) or the impl attribute (ParExperts) changes its impl
            skip.append(name)
            report.left.append(Left(name, host_class, ours))
            continue
        host = next((h for h in EXPERTS_HOSTS if h.fits(module)), None)
        if host is not None:  # routed experts: their insides (act_fn, inner_experts) are theirs
            inside = [f"{name}.{c}".lstrip(".") for c, _ in module.named_children()
                      if c not in host.walked]  # fmt: skip
            skip.extend(inside if host.walked else [name])
            reason = host.mismatch(module) or _placement(model, name)
            if reason is None:
                plans.append((name, module, host, host.build(module, **experts_options)))
            else:
                report.left.append(Left(name, host_class, reason))
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
    for name, module, host, shell in plans:
        old = dict(module.named_parameters())
        if isinstance(host, ExpertsHost):
            replacement = host.install(shell, module)
            shape = (shell.hidden_size, shell.ffn_hidden_size, shell.hidden_size)
            entry = Replaced(name, type(module).__qualname__, host.library, shell.impl,
                             shell.auto_reason, shape, shell.num_experts, note)  # fmt: skip
        else:
            replacement = shell.fill_from(module)
            shape = (shell.hidden_size, shell.ffn_hidden_size, shell.fc2.out_features)
            entry = Replaced(name, type(module).__qualname__, host.library, shell.impl,
                             shell.auto_reason, shape)  # fmt: skip
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, replacement)
        kept = {id(p) for p in replacement.parameters()}  # adopted, not replaced
        guard.remember({f"{name}.{n}": p for n, p in old.items() if id(p) not in kept})
        report.replaced.append(entry)
    logger.info("%s", report.summary())
    return report


def _already(module: nn.Module) -> str | None:
    """Why ``module`` is ours already (its impl is switched in place), or None."""
    if isinstance(module, PatchedRoutedExperts):
        module = module.inner_experts
    if isinstance(module, ParMLP | ParExperts):
        patched = isinstance(module, PatchedSwiGLU | PatchedExperts)
        what = "already patched" if patched else f"already a {type(module).__name__}"
        return f"{what} (impl {module.impl})"
    return None


def _recognize(module: nn.Module) -> tuple[HostSpec | None, str | None]:
    """(spec, None) for a SwiGLU MLP; (spec, why not) when a layout fits but a check fails;
    (None, why) for a module no layout fits."""
    for spec in SPECS:
        if spec.fits(module):
            return spec, spec.mismatch(module)
    children = ", ".join(n for n, _ in module.named_children()) or "none"
    if "expert" in type(module).__name__.lower():
        return None, (
            "MoE experts of no layout patch knows (transformers 5's experts interface, "
            "torchtitan's RoutedExperts)"
        )
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
