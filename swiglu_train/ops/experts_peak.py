"""The routed experts' backward peak from tensor sizes, and the weight-gradient order it picks.

grad_W1's buffer [E, 2F, D] is the largest a drop_h backward allocates, so its peak comes at
the weight gradients. Beside grad_W1 stand what every order holds (grad_x [T, D], y, the
saved slot, the router weights' gradient, and the token where grad_W1's GEMM gathers), its
operand grad_preact [R, 2F], x's rows [R, D] where its GEMM cannot gather them (torch's
grouped GEMM without ``gathered_wgrad``), and either grad_W2 [E, D, F], when it
is computed first, or the rows grad_W2 still needs, when it is computed last: (w·)h [R, F],
and grad_y's rows [R, D] where its GEMM cannot gather them. Computed last, grad_W2's own GEMM
then holds grad_W1, grad_W2 and those rows, and grad_preact too if it is *pinned*: in place,
the bf16 grad_preact is the saved preactivation, which autograd holds until backward returns,
unless backward frees its storage once grad_W1 has read it, as it now does
(``experts_steps.release_preact``); the commits measured below held it.

This model gives every backward peak that ``bench-moe`` measured for drop_h and drop_h_quack
on the H100 (six commits, both orders, bf16 and FP8-saved, five models) to within 1 MiB
(tests/test_experts_peak.py), and ``grad_fc2_first`` takes the order whose peak is lower.
Router weights on the input (Llama-4) add buffers it does not count.
"""

from __future__ import annotations

import torch

from swiglu_train.kernels.fp8_format import copy_bytes
from swiglu_train.ops.experts_routing import restored_bytes, routing_bytes

MODELLED_IMPLS = ("drop_h", "drop_h_quack")  # the impls whose backward the model follows


def weight_grad_peak(
    fc2_first: bool,
    *,
    grad_w2: int,
    grad_preact: int,
    waiting: int,
    gathered: int,
    pinned: bool = False,
) -> int:
    """What stands beside grad_W1 (beyond what every order holds) at the weight gradients'
    peak, in the units of its arguments: ``waiting`` is what grad_W2 needs until it is
    computed, ``gathered`` the rows of x gathered for grad_W1 (0 where its GEMM gathers)."""
    if fc2_first:
        return grad_w2 + grad_preact + gathered
    at_grad_w1 = grad_preact + waiting + gathered
    return max(at_grad_w1, grad_w2 + waiting + (grad_preact if pinned else 0))


def grad_fc2_first(
    *, grad_w2: int, grad_preact: int, waiting: int, gathered: int, pinned: bool = False
) -> bool:
    """Whether backward computes grad_W2 before grad_W1: the order of the lower peak (ties
    first, which frees grad_W2's rows soonest)."""
    sizes = dict(grad_w2=grad_w2, grad_preact=grad_preact, waiting=waiting, gathered=gathered)
    return weight_grad_peak(True, **sizes, pinned=pinned) <= weight_grad_peak(
        False, **sizes, pinned=pinned
    )


def backward_peak_bytes(
    impl: str,
    saved_fp8: bool,
    gathered_wgrad: bool,
    inplace: bool,
    tokens: int,
    hidden: int,
    ffn: int,
    top_k: int,
    experts: int,
    dtype: torch.dtype,
    fc2_first: bool | None = None,
    pinned: bool = False,
) -> int:
    """Bytes a drop_h impl's step holds at its backward peak beyond what was allocated before
    its forward (x, the routing inputs, the weights and grad_y excluded; y, the gradients of x
    and of both weights included), as ``bench-moe`` measures it: in the order the impl takes,
    or in ``fc2_first``'s, to ask what the other order would cost. ``pinned``: grad_preact
    held until backward returns in place (bf16), as every commit before ``release_preact``."""
    if impl not in MODELLED_IMPLS:
        raise ValueError(f"the peak model covers {' and '.join(MODELLED_IMPLS)}, not {impl!r}")
    size, rows = torch.empty(0, dtype=dtype).element_size(), tokens * top_k
    gathers_in_gemm = impl == "drop_h_quack"
    sizes = dict(
        grad_w2=experts * hidden * ffn * size,
        grad_preact=rows * 2 * ffn * size,
        waiting=rows * (ffn + (0 if gathers_in_gemm else hidden)) * size,
        gathered=0 if gathers_in_gemm or gathered_wgrad else rows * hidden * size,
        pinned=pinned and inplace and not saved_fp8,
    )
    held = experts * 2 * ffn * hidden * size + 2 * tokens * hidden * size  # grad_W1, grad_x, y
    held += routing_bytes(rows, experts) + restored_bytes(rows, gathers_in_gemm or gathered_wgrad)
    if not inplace:  # autograd's saved copy stays beside the one backward overwrites
        held += copy_bytes(rows, ffn) if saved_fp8 else sizes["grad_preact"]
    order = grad_fc2_first(**sizes) if fc2_first is None else fc2_first
    return held + weight_grad_peak(order, **sizes)
