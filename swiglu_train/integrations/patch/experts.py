"""PatchedExperts: a host library's routed SwiGLU experts run by a ParExperts impl, its keys kept.

The experts of a Mixture-of-Experts block take the tokens, their top-k expert indices and
router weights, and return the weighted sum of the chosen experts' outputs: ParExperts' own
contract. A host's experts module is replaced by a ParExperts subclass that adopts the host's
parameter objects where their layout is already ours ([E, 2F, D] with [gate; up] rows per
expert, [E, D, F]), so nothing is copied and an optimizer built earlier still trains them, and
presents the host's state_dict keys through hooks, as PatchedSwiGLU does for dense MLPs. The
host adapters (``hf_experts``, ``torchtitan_experts``) say how a module is recognized, which
keys it has and what the patched module computes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from swiglu_train.integrations.patch.spec import _hooks
from swiglu_train.kernels.runtime import SUPPORTED_DTYPES
from swiglu_train.layers.experts import ParExperts
from swiglu_train.layers.layout import DTensor


class PatchedExperts(ParExperts):
    """A ParExperts standing in for ``host_class`` of ``library``, with that class's keys.

    Subclasses say which host keys the weights read as (:meth:`host_state`) and how a host
    state_dict's entries become ``fc1_weight``/``fc2_weight`` (:meth:`take_host_state`).
    """

    library: str = ""

    def __init__(self, host_class: str, num_experts: int, hidden: int, ffn: int, **options):
        super().__init__(num_experts, hidden, ffn, device="meta", **options)
        self.host_class = host_class
        self._register_state_dict_hook(_to_host_keys)
        self.register_load_state_dict_pre_hook(_from_host_keys)

    def host_state(self) -> dict[str, torch.Tensor]:
        """The host's state_dict entries of this module (names relative to it), in its order."""
        raise NotImplementedError

    def take_host_state(self, state_dict: dict, prefix: str, error_msgs: list[str]) -> None:
        """Replace the host's entries under ``prefix`` by ``fc1_weight``/``fc2_weight`` ones."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"patched {self.library} {self.host_class}, {super().extra_repr()}"


def _to_host_keys(module: PatchedExperts, state_dict: dict, prefix: str, local_metadata) -> None:
    for name in ("fc1_weight", "fc2_weight"):
        state_dict.pop(prefix + name, None)
    for name, value in module.host_state().items():
        state_dict[prefix + name] = value


def _from_host_keys(
    module: PatchedExperts,
    state_dict: dict,
    prefix: str,
    local_metadata,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    module.take_host_state(state_dict, prefix, error_msgs)


@dataclass(frozen=True)
class ExpertsHost:
    """One host library's routed experts: how they are recognized and replaced.

    ``fits`` says whether a module is this host's experts at all (so the report names it as
    such); ``mismatch`` why one that fits cannot be replaced (None when it can); ``build``
    the PatchedExperts on ``meta`` (options checked, no memory touched); ``install`` fills it
    from the host module and returns what takes the host's place in the model. ``walked``
    names the children that ``patch`` still walks into, replaced or left (a whole MoE block's
    shared expert, a dense MLP of its own); the others are the experts'.
    """

    library: str
    fits: Callable[[nn.Module], bool]
    mismatch: Callable[[nn.Module], str | None]
    build: Callable[..., PatchedExperts]
    install: Callable[[PatchedExperts, nn.Module], nn.Module]
    walked: tuple[str, ...] = ()


def module_mismatch(module: nn.Module) -> str | None:
    """Why ``module`` cannot be swapped out whatever its layout: sharded, hooked or patched."""
    if any(DTensor is not None and isinstance(p, DTensor) for p in module.parameters()):
        return "its weights are DTensors (already sharded): patch before fully_shard, TP or EP"
    if "forward" in vars(module):
        return "its forward was replaced on the instance (a hook or another patch)"
    hooks = _hooks(module)
    return f"it has {hooks}, which a replacement would drop" if hooks else None


def weights_mismatch(weights: dict[str, torch.Tensor]) -> str | None:
    """Why these expert weights cannot feed ParExperts: not plain tensors of one supported
    dtype and device."""
    first = next(iter(weights.values()))
    for name, p in weights.items():
        if type(p.data) is not torch.Tensor:
            return f"{name} is a {type(p.data).__name__}, not a plain tensor (quantized?)"
        if p.dtype not in SUPPORTED_DTYPES:
            return f"{name} is {p.dtype}; the impls support {SUPPORTED_DTYPES}"
        if (p.dtype, p.device) != (first.dtype, first.device):
            return f"{name} is {p.dtype} on {p.device}, unlike its other weights"
    return None


def gate_up_down_mismatch(experts: nn.Module, *, transposed: bool) -> str | None:
    """Why ``experts`` is not a pair of transformers' fused SwiGLU expert weights:
    ``gate_up_proj`` [E, 2F, D] and ``down_proj`` [E, D, F] alone (Llama-4's bmm experts hold
    them transposed, [E, D, 2F] and [E, F, D]), plain, of one dtype and device, chaining."""
    names = ("gate_up_proj", "down_proj")
    extra = sorted(set(experts._parameters) - set(names))
    if extra or experts._buffers:
        return f"it holds {', '.join(extra or experts._buffers)} besides {' and '.join(names)}"
    up, down = experts.gate_up_proj, experts.down_proj
    why = weights_mismatch({"gate_up_proj": up, "down_proj": down})
    if why:
        return why
    e, two_f, d = (up.shape[0], up.shape[2], up.shape[1]) if transposed else tuple(up.shape)
    chained = (e, two_f // 2, d) if transposed else (e, d, two_f // 2)
    if two_f % 2 or tuple(down.shape) != chained:
        want = "[E, D, 2F] and [E, F, D]" if transposed else "[E, 2F, D] and [E, D, F]"
        return (
            f"its shapes do not chain: gate_up_proj {tuple(up.shape)}, down_proj "
            f"{tuple(down.shape)} (want {want})"
        )
    return None
