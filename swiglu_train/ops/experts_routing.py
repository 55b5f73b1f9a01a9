"""Routing plans and grouped GEMMs for the routed experts (``ops.experts``).

A token's top-k choices are k *slots*; slot (t, j) goes to expert ``indices[t, j]`` with
router weight ``weights[t, j]``. The experts' GEMMs run on the slots sorted by expert (stable,
so within an expert slots keep token order), as groups of consecutive rows: ``offsets[e]`` is
the end of expert e's rows, the form ``torch._grouped_mm`` takes. An index of -1 drops the slot
(a token routed to no expert, as capacity-limited or expert-parallel routers produce): it is
computed by expert 0 with weight 0, so it adds exactly 0 to y and to every gradient, and
the plan needs no host synchronization to know how many slots are live.

Nothing here reads a tensor's values on the host: the plan is built with sort and
searchsorted on the device, so a step never waits for the GPU. A bad index is caught by an
asynchronous device assert on CUDA (eagerly on CPU), never turned into a wrong row.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from swiglu_train.ops.activation import triton_enabled
from swiglu_train.ops.eager import eager_op

try:
    from swiglu_train.kernels import experts_swiglu as kernels
    from swiglu_train.kernels.experts_wgrad import gathered_weight_grad as _gathered_wgrad
except ImportError:  # no Triton on this platform: torch computes the same sums
    kernels = _gathered_wgrad = None

# Elements of x gathered at once for an input-side router weight's gradient: 32 MiB of bf16.
DOT_CHUNK = 1 << 24
BAD_INDEX = "expert_indices must hold values in [0, num_experts) or -1 (slot dropped)"


class Routing(NamedTuple):
    """Where each sorted slot comes from and goes: every tensor is on the input's device, the
    integers in ``index_dtype``."""

    token: torch.Tensor  # [R]: the token of each sorted slot
    slot: torch.Tensor  # [R]: its flat index t * k + j into [T, k]
    bags: torch.Tensor  # [T, k]: the sorted row of each slot
    offsets: torch.Tensor  # [E] int32: cumulative ends of each expert's rows
    weight: torch.Tensor  # [R] fp32: each sorted slot's router weight, 0 if dropped


def index_dtype(rows: int) -> torch.dtype:
    """int32 where R rows fit it (every reader widens before it scales an index), else int64."""
    return torch.int32 if rows <= torch.iinfo(torch.int32).max else torch.int64


def saved_plan(plan: Routing) -> tuple[torch.Tensor, torch.Tensor]:
    """What the drop_h impls keep of a plan for backward, which then sorts nothing again: each
    sorted row's slot and the offsets, 4 bytes a slot. The token (slot // k), the bags (the
    slot's inverse) and the router weights (the caller's, which backward keeps anyway, read
    through the slot) are rebuilt in backward rather than kept."""
    return plan.slot.to(index_dtype(plan.slot.numel())), plan.offsets


def restored_plan(
    slot: torch.Tensor, offsets: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor
) -> Routing:
    """The plan backward reads, from ``saved_plan``'s tensors and the routing inputs."""
    wide = slot.long()  # index_copy_ takes int64 indices only: a moment's [R], freed here
    bags = torch.empty_like(slot).index_copy_(0, wide, _row_numbers(slot.numel(), slot))
    del wide
    weight = sorted_weights(indices, weights, slot)
    return Routing(slot // indices.shape[1], slot, bags.view(indices.shape), offsets, weight)


def routing_bytes(rows: int, experts: int) -> int:
    """What ``saved_plan`` keeps: a slot a row (int32 where it fits), E int32 offsets."""
    return rows * index_dtype(rows).itemsize + experts * 4


def restored_bytes(rows: int, token_held: bool) -> int:
    """What a drop_h backward holds beside the saved plan at its peak, the weight gradients:
    the router weights' gradient (fp32, as routers give their weights), and each row's token
    where grad_W1's GEMM reads x's rows through it (``token_held``; gathered first, the token
    is freed once x's rows are). The bags and, with the weight on the output, the sorted router
    weights are freed before."""
    return rows * (4 + (index_dtype(rows).itemsize if token_held else 0))


def sorted_weights(
    indices: torch.Tensor, weights: torch.Tensor, slot: torch.Tensor
) -> torch.Tensor:
    """[R] fp32: each sorted slot's router weight, 0 for a dropped slot (no autograd)."""
    live = torch.where(indices >= 0, weights.detach(), 0).reshape(-1).float()
    return live.index_select(0, slot)


def _row_numbers(rows: int, like: torch.Tensor) -> torch.Tensor:
    """0 .. rows - 1 in ``index_dtype``, on ``like``'s device: each sorted row's number."""
    return torch.arange(rows, device=like.device, dtype=index_dtype(rows))


def sort_key_dtype(num_experts: int) -> torch.dtype:
    """The narrowest integer the expert ids fit: a radix sort makes one pass per key byte."""
    return torch.int16 if num_experts <= torch.iinfo(torch.int16).max else torch.int32


def check_routing(
    x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, num_experts: int
) -> None:
    """A one-line error naming the problem with the experts' inputs (shapes, dtypes, devices;
    index values eagerly on CPU, by device assert on CUDA)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [T, D] (tokens, hidden), got {tuple(x.shape)}")
    if indices.dim() != 2 or indices.shape[0] != x.shape[0]:
        raise ValueError(
            f"expert_indices must be [T, k] with T = {x.shape[0]} (x's tokens), "
            f"got {tuple(indices.shape)}"
        )
    if tuple(weights.shape) != tuple(indices.shape):
        raise ValueError(
            f"expert_weights must match expert_indices' shape {tuple(indices.shape)}, "
            f"got {tuple(weights.shape)}"
        )
    if indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"expert_indices must be int32 or int64, got {indices.dtype}")
    if not weights.is_floating_point():
        raise TypeError(f"expert_weights must be floating point, got {weights.dtype}")
    for name, t in (("expert_indices", indices), ("expert_weights", weights)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    if indices.shape[1] == 0:
        raise ValueError("expert_indices must have k >= 1 choices per token, got k = 0")
    if indices.numel() == 0 or indices.is_meta:  # meta: shapes only, no values to check
        return
    ok = (indices >= -1) & (indices < num_experts)
    if indices.is_cuda:
        torch._assert_async(ok.all(), BAD_INDEX)
    elif not bool(ok.all()):
        bad = indices[~ok][0].item()
        raise ValueError(f"{BAD_INDEX} (num_experts={num_experts}), found {bad}")


def route(indices: torch.Tensor, weights: torch.Tensor, num_experts: int) -> Routing:
    """The sorted-slot plan of [T, k] expert indices and weights (the module docstring)."""
    flat = indices.reshape(-1).long()
    live = flat >= 0
    keys = torch.where(live, flat, 0).to(sort_key_dtype(num_experts))
    sorted_expert, slot = torch.sort(keys, stable=True)
    bounds = torch.arange(num_experts, device=flat.device, dtype=sorted_expert.dtype)
    offsets = torch.searchsorted(sorted_expert, bounds, right=True).to(torch.int32)
    rows = _row_numbers(slot.numel(), slot)
    bags = torch.empty_like(rows).index_copy_(0, slot, rows).view(indices.shape)
    weight = sorted_weights(indices, weights, slot)
    slot = slot.to(rows.dtype)
    return Routing(slot // indices.shape[1], slot, bags, offsets, weight)


def combine(rows: torch.Tensor, plan: Routing, slot_weights: torch.Tensor | None) -> torch.Tensor:
    """[T, D]: each token's k sorted rows summed, each times its slot's weight if given
    ([T, k], slot order), differentiable by autograd (``normal``'s; it keeps the gathered rows,
    the expert outputs, for the weights' gradient). A batched GEMM over the k rows: fp32
    accumulation, deterministic, and its backward runs for bf16 on CUDA, where
    ``embedding_bag``'s per-sample-weights backward does not."""
    t, k = plan.bags.shape
    gathered = rows.index_select(0, plan.bags.reshape(-1)).view(t, k, rows.shape[1])
    if slot_weights is None:
        return gathered.sum(1)
    return torch.bmm(slot_weights.to(rows.dtype).unsqueeze(1), gathered).squeeze(1)


def gather_sum(
    rows: torch.Tensor, bags: torch.Tensor, slot_weights: torch.Tensor | None
) -> torch.Tensor:
    """``combine`` outside autograd (the impls' own Functions), by a plan's ``bags``: with the
    router weights kept in fp32 until the sum, which is rounded once. Triton where it runs,
    else in fp32 torch."""
    weights = None if slot_weights is None else slot_weights.float()
    return combine_rows(rows, bags, weights)


@eager_op("swiglu_train::experts_combine_rows", mutates_args=())
def combine_rows(
    rows: torch.Tensor, bags: torch.Tensor, weights: torch.Tensor | None
) -> torch.Tensor:
    """[T, D]: Σ_j weights[t, j] · rows[bags[t, j]] (fp32 weights), rounded once; an op
    torch.compile keeps opaque, as it cannot trace a Triton launch on every platform."""
    if kernels is not None and triton_enabled(rows):
        return kernels.combine_rows(rows, bags, weights)
    if bags.shape[0] == 0:
        return rows.new_zeros(0, rows.shape[1])
    summed = F.embedding_bag(bags, rows.float(), mode="sum", per_sample_weights=weights)
    return summed.to(rows.dtype)


@combine_rows.register_fake
def _(rows: torch.Tensor, bags: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    return rows.new_empty(bags.shape[0], rows.shape[1])


def live_weights(indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[T, k]: the router weights with a dropped slot's set to 0 (differentiable)."""
    return torch.where(indices >= 0, weights, torch.zeros_like(weights))


def _grouped_mm_runs(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM takes these operands: bf16 on CUDA (fp32 too on CPU),
    16-byte aligned pointers and strides; otherwise a loop over experts computes the same
    product. Group sizes need no alignment: the kernel checks only the static dimensions."""
    if not hasattr(torch, "_grouped_mm") or a.dtype != b.dtype:
        return False
    # meta follows CUDA's rule (its kernel checks as CUDA's does); other dtypes get shapes alone
    dtypes = (torch.bfloat16,) if a.is_cuda or a.is_meta else (torch.bfloat16, torch.float32)
    aligned = all(
        t.data_ptr() % 16 == 0
        and all(s == 1 or (s * t.element_size()) % 16 == 0 for s in t.stride())
        for t in (a, b)
    )
    return a.dtype in dtypes and aligned


def _groups(offsets: torch.Tensor) -> list[tuple[int, int]]:
    """Host (start, end) row spans per expert: the loop's only synchronization."""
    ends = offsets.tolist()
    return list(zip([0, *ends[:-1]], ends, strict=True))


def grouped_linear(a: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows of expert e times weight[e]ᵀ: a [R, K], weight [E, N, K] -> [R, N]."""
    if _grouped_mm_runs(a, weight):
        return torch._grouped_mm(a, weight.transpose(1, 2), offs=offsets)
    out = a.new_empty(a.shape[0], weight.shape[1])
    if a.is_meta:  # shapes only: the loop would read the group sizes
        return out
    for e, (start, end) in enumerate(_groups(offsets)):
        torch.mm(a[start:end], weight[e].t(), out=out[start:end])
    return out


def grouped_weight_grad(
    grad_out: torch.Tensor, inp: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """Σ over expert e's rows of grad_outᵀ inp: grad_out [R, N], inp [R, K] -> [E, N, K]
    (zeros for an expert with no rows)."""
    if _grouped_mm_runs(grad_out, inp):
        return torch._grouped_mm(grad_out.t(), inp, offs=offsets)
    out = inp.new_zeros(offsets.shape[0], grad_out.shape[1], inp.shape[1])
    if inp.is_meta:  # shapes only
        return out
    for e, (start, end) in enumerate(_groups(offsets)):
        if end > start:
            torch.mm(grad_out[start:end].t(), inp[start:end], out=out[e])
    return out


def gathers_in_gemm(in_gemm: bool, grad_out: torch.Tensor) -> bool:
    """Whether ``gathered_weight_grad`` reads the rows inside its GEMM (no [R, K] buffer)."""
    return in_gemm and _gathered_wgrad is not None and triton_enabled(grad_out)


def gathered_row_dots(rows: torch.Tensor, x: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """[R] fp32: ⟨rows[r], x[token[r]]⟩, the gradient of an input-side router weight (d(w x)/dw
    = x), x gathered DOT_CHUNK elements at a time, so the gathered [R, D] is never whole for
    it: for the impls whose weight-gradient GEMM gathers x's rows itself. bmm's sums, as the
    unchunked dot of ``row_dots``."""
    out = torch.empty(rows.shape[0], device=rows.device)
    step = max(1, DOT_CHUNK // max(rows.shape[1], 1))
    for start in range(0, rows.shape[0], step):
        part = slice(start, start + step)
        xg = x.index_select(0, token[part])
        out[part] = row_dots(rows[part], xg)
    return out


def rows_weight_grad(
    grad_out: torch.Tensor,
    rows: torch.Tensor,
    offsets: torch.Tensor,
    row_scale: torch.Tensor | None,
) -> torch.Tensor:
    """``grouped_weight_grad`` on rows already gathered, scaled in place by ``row_scale`` (an
    input-side router weight, rounded to the rows' dtype as the forward rounded w·x) if given:
    the rows are the caller's scratch."""
    if row_scale is not None:
        rows.mul_(row_scale.to(rows.dtype)[:, None])
    return grouped_weight_grad(grad_out, rows, offsets)


def row_dots(rows: torch.Tensor, gathered: torch.Tensor) -> torch.Tensor:
    """[R] fp32: ⟨rows[r], gathered[r]⟩ (one bmm: the dtype's GEMM, rounded to it)."""
    return torch.bmm(rows.unsqueeze(1), gathered.unsqueeze(2)).view(-1).float()


@eager_op("swiglu_train::experts_gathered_weight_grad", mutates_args=())
def gathered_weight_grad(
    grad_out: torch.Tensor,
    inp: torch.Tensor,
    token: torch.Tensor,
    offsets: torch.Tensor,
    row_scale: torch.Tensor | None,
    in_gemm: bool,
) -> torch.Tensor:
    """``grouped_weight_grad(grad_out, (row_scale ·) inp[token], offsets)`` [E, N, K]. With
    ``in_gemm`` where Triton runs, the GEMM reads inp's rows through ``token``
    (``kernels.experts_wgrad``), so the gathered [R, K] rows are never written; otherwise
    they are gathered here first, for torch's grouped GEMM."""
    if gathers_in_gemm(in_gemm, grad_out):
        return _gathered_wgrad(grad_out, inp, token, offsets, row_scale)
    return rows_weight_grad(grad_out, inp.index_select(0, token), offsets, row_scale)


@gathered_weight_grad.register_fake
def _(grad_out, inp, token, offsets, row_scale, in_gemm) -> torch.Tensor:
    return grad_out.new_empty(offsets.shape[0], grad_out.shape[1], inp.shape[1])
