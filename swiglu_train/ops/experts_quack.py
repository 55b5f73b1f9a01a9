"""The routed experts' ``drop_h_quack`` impl: drop_h's saved set and math on quack's varlen GEMMs,
which gather each token's row inside the GEMM, so neither the gathered input [R, D] nor the
gathered grad_y is ever written (R = T·k; ``ops.experts`` has the math).

The slots are sorted by expert (``experts_routing.route``); expert e owns sorted rows
``cu[e]:cu[e+1]`` (``cu``: the plan's offsets with a leading 0) and row r reads token
``token[r]``. quack 0.6.5's ``gemm(A, B, ...)`` takes B as (L, K, N) per expert, or (total_K, N)
with varlen_k, and gathers A's rows (varlen_m) or columns (varlen_k) through ``A_idx``:

    fc1      preact [R, 2F] = gemm(x, fc1ᵀ, cu_seqlens_m, A_idx=token)   x [T, D] never gathered
    fc2      out [R, D]     = gemm(h, fc2ᵀ, cu_seqlens_m)
    grad_h   g [R, F]       = gemm(grad_y, fc2, cu_seqlens_m, A_idx=token)
    grad_W2  [E, D, F]      = gemm(grad_yᵀ, w·h, cu_seqlens_k, A_idx=token)
    grad_xg  [R, D]         = gemm(grad_preact, fc1, cu_seqlens_m)
    grad_W1  [E, 2F, D]     = gemm(xᵀ, grad_preact, cu_seqlens_k, A_idx=token), written
                              through the transposed view of its [E, 2F, D] buffer

With the router weight on the output and a bf16 preactivation (Mixtral, Qwen, DeepSeek), fc1's
GEMM runs SwiGLU in its epilogue (``gemm_gated``, as the dense ``drop_h_quack``), so no
activation kernel runs forward; the preactivation is then kept gate/up interleaved per
column, as quack writes it. grad_preact, w·h and the router weight's gradient come from drop_h's
Triton backward kernel (``kernels.experts_swiglu``), which reads that layout too, and grad_xg
and grad_W1 pair the interleaved grad_preact with the canonical fc1 inside the GEMM
(``concat_layout``): the weights, their grads and the saved bytes are drop_h's. quack's
``gemm_dgated`` would fold grad_h's epilogue into the GEMM as well (router weight as per-row
scale, its gradient as per-row sum), but with rows gathered it took 933 µs (the timeline of
moe_h100_epilogues.json) against 475 for the plain gathered GEMM (moe_gemm_configs_h100.md)
and 204 for the Triton pass (H100, Qwen3-30B-A3B). With
the weight on the input, or the FP8-saved copy, the activation and the copy are drop_h's
Triton kernels' (``swiglu_fwd``, its FP8 variant) on a canonical [gate | up] preactivation.

With the router weight on the input (Llama-4), preact = w · (fc1 x): the gathered GEMM's rows
are scaled after it, grad_W1 takes w on grad_preact instead of on x, and the weight's gradient
⟨grad_xg, x⟩ gathers x a bounded chunk of rows at a time.

quack's layout rules (gemm.py): varlen_m needs A and the output row-major; varlen_k needs A
m-major (xᵀ, grad_yᵀ of row-major tensors) and B n-major (row-major [R, N]); gather_A needs
cluster_n = 1 (quack's untuned SM90 default is 128x192, cluster 2x1, static schedule). Every
operand's rows are 16-byte aligned, hence D and F multiples of 8 (``check_quack_inputs``).
An empty batch (T = 0) launches nothing: quack returns empty outputs and zero-fills a grad
whose contraction is empty, as it does for an expert with no rows.
"""

from __future__ import annotations

import functools

import torch

from swiglu_train.ops.experts_peak import grad_fc2_first
from swiglu_train.ops.experts_routing import (
    Routing,
    gather_sum,
    gathered_row_dots,
    live_weights,
    route,
)
from swiglu_train.ops.experts_steps import (
    activate,
    backward_rows,
    release_preact,
    router_grad,
    save,
    saved_tensors,
)
from swiglu_train.ops.quack_mlp import (
    ALIGN,
    check_quack_inputs,
    quack_gemm,
    quack_sizes_ok,
    quack_unavailable_reason,
    require_quack,
)

IMPL = "drop_h_quack"
SECOND_BACKWARD_ERROR = (
    "ParExperts(impl='drop_h_quack') ran its backward in place: its saved preactivation now "
    "holds the gradient (or, with saved_fp8, was freed once read), so a second backward "
    "through this graph (retain_graph=True) would compute garbage. Build the layer with "
    "inplace=False to backpropagate more than once."
)
SECOND_BACKWARD_FREED_ERROR = (
    "ParExperts(impl='drop_h_quack'): a second backward through the same graph, whose saved "
    "tensors the first backward freed (it ran without retain_graph=True). Build the layer "
    "with inplace=False and pass retain_graph=True to every backward but the last."
)
# The shallowest contraction at which the row GEMMs (varlen_m: fc1, fc2, grad_h, grad_xg) take
# quack's cooperative 128 x 256 tile instead of its default, pingpong 128 x 192. Pingpong hides
# each tile's epilogue under the other warpgroup's mainloop, which pays while K is short; the
# wider tile reads each (gathered) row of A once per 256 output columns instead of 192, which
# pays once the mainloop dominates. On the H100 at three models' expert shapes
# (moe_gemm_configs_h100.md): cooperative 0.67-0.98x the default at K = 1536 to 28672 (all
# nine points), 1.02-1.03x at K = 768 and 1024 (fc2 of the fine-grained experts). The bound
# sits between the two. The varlen_k weight-gradient GEMMs keep the default: there the wider
# tile won at 512 and 1024 rows per expert and lost at 2048, no rule of K either way.
COOPERATIVE_MIN_DEPTH = 1280


def experts_quack_unavailable_reason(
    hidden_size: int | None, ffn_hidden_size: int | None
) -> str | None:
    """Why ``ParExperts(impl='drop_h_quack')`` cannot run here (no quack, no sm_90+ GPU, or
    sizes whose rows TMA cannot take; None sizes: not asked), or None when it can."""
    reason = quack_unavailable_reason()
    sized = hidden_size is not None and ffn_hidden_size is not None
    if reason is None and sized and not quack_sizes_ok(hidden_size, ffn_hidden_size):
        reason = (
            f"hidden_size {hidden_size} and ffn_hidden_size {ffn_hidden_size} must be "
            f"multiples of {ALIGN} (16-byte rows for TMA)"
        )
    return reason


def check_experts_quack_runs(hidden_size: int, ffn_hidden_size: int) -> None:
    """A one-line ValueError when ``ParExperts(impl='drop_h_quack')`` cannot run here. Checked
    when the layer is built, as ParMLP checks its quack impls, not at its first step."""
    reason = experts_quack_unavailable_reason(hidden_size, ffn_hidden_size)
    if reason is not None:
        raise ValueError(f"ParExperts(impl={IMPL!r}) cannot run here: {reason}; use impl='drop_h'")


def row_gemm_config(depth: int):
    """quack's SM90 config for a row GEMM contracting over ``depth``, or None for quack's
    default (``COOPERATIVE_MIN_DEPTH``). None under torch.compile, which takes no explicit
    config."""
    if depth < COOPERATIVE_MIN_DEPTH or torch.compiler.is_compiling():
        return None
    return _cooperative_config()


@functools.cache
def _cooperative_config():
    """Built once: every row GEMM of every step asks for it."""
    from quack.gemm_config import GemmConfig

    return GemmConfig(
        tile_m=128, tile_n=256, pingpong=False, cluster_m=2, cluster_n=1,
        is_dynamic_persistent=False,
    )  # fmt: skip


def _row_gemm(a: torch.Tensor, b: torch.Tensor, cu: torch.Tensor, **options) -> torch.Tensor:
    """[R, N] = rows of a (gathered through ``A_idx`` if given) times each expert's b, on the
    config ``row_gemm_config`` picks. quack's ``gemm`` takes no config, so a chosen one goes
    through ``gemm_tuned.fn``, the function ``gemm(..., tuned=False)`` calls with config=None:
    the same launch, another tile."""
    config = row_gemm_config(a.shape[-1])
    if config is None:
        return quack_gemm()(a, b, cu_seqlens_m=cu, **options)
    token = options.get("A_idx")
    out = a.new_empty(a.shape[0] if token is None else token.shape[0], b.shape[-1])
    if out.numel():
        require_quack().gemm_tuned.fn(a, b, out, cu_seqlens_m=cu, config=config, **options)
    return out


def _varlen(plan: Routing) -> tuple[torch.Tensor, torch.Tensor]:
    """(cu_seqlens [E + 1], A_idx [R]), int32 and each allocated whole (the plan's token
    is already int32 where R fits it): quack's varlen operands, which its kernels assume
    16-byte aligned."""
    cu = torch.cat([plan.offsets.new_zeros(1), plan.offsets])
    return cu, plan.token.to(torch.int32)


class _ExpertsDropHQuack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, indices, weights, fc1, fc2, weights_on: str, saved_fp8: bool, inplace):
        plan = route(indices, weights, fc1.shape[0])
        cu, token = _varlen(plan)
        interleaved = gated_forward(weights_on, saved_fp8)
        if interleaved:
            preact, h = require_quack().gemm_gated(
                x, fc1.mT, activation="swiglu", cu_seqlens_m=cu, A_idx=token,
                concat_layout=("B",), tuned=False, config=row_gemm_config(x.shape[1]),
            )  # fmt: skip
            saved = (preact,)
        else:
            preact = _row_gemm(x, fc1.mT, cu, A_idx=token)
            if weights_on == "input":  # fc1 (w x) = w (fc1 x), one rounding: fp32 product
                preact.mul_(plan.weight[:, None])
            h, saved = activate(preact, saved_fp8)
        del preact
        out = _row_gemm(h, fc2.mT, cu)
        del h
        y = gather_sum(
            out, plan.bags, None if weights_on == "input" else live_weights(indices, weights)
        )
        save(ctx, x, indices, weights, fc1, fc2, plan, saved, weights_on, inplace)
        ctx.interleaved = interleaved
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        errors = (SECOND_BACKWARD_ERROR, SECOND_BACKWARD_FREED_ERROR)
        inplace, (x, indices, weights, fc1, fc2), plan, saved = saved_tensors(ctx, errors)
        gemm = quack_gemm()  # the weight-gradient (varlen_k) GEMMs: quack's default config
        cu, token = _varlen(plan)
        # the plan's parts, each dropped once read for the last time: the peak keeps the token
        bags, weight = plan.bags, plan.weight
        del plan
        on_output = ctx.weights_on == "output"
        grad_y = grad_y.contiguous()
        g = _row_gemm(grad_y, fc2, cu, A_idx=token)  # unweighted grad_h
        w = weight if on_output else None
        # g: (w ·) h now; an interleaved preact gives an interleaved grad_preact
        grad_preact, g, grad_w_rows = backward_rows(saved, g, w, inplace, ctx.interleaved)
        pinned = inplace and grad_preact is saved[0]  # released once grad_W1 has read it
        del saved, w
        fc2_first = grad_fc2_first(  # x's and grad_y's rows: gathered inside the GEMMs
            grad_w2=fc2.numel(),
            grad_preact=grad_preact.numel(),
            waiting=g.numel(),
            gathered=0,
        )
        if fc2_first:
            grad_fc2 = gemm(grad_y.T, g, cu_seqlens_k=cu, A_idx=token)
            g = None
        # the interleaved grad_preact meets the canonical fc1 inside the GEMM (concat_layout)
        concat = ("B",) if ctx.interleaved else None
        grad_xg = _row_gemm(grad_preact, fc1, cu, concat_layout=concat)
        if not on_output:  # d(w x)/dw = x; grad_W1 takes the weight on grad_preact's rows
            grad_w_rows = gathered_row_dots(grad_xg, x, token)
            grad_preact.mul_(weight[:, None])
        del weight
        grad_w = router_grad(grad_w_rows, bags, indices, weights)
        # grad_x before grad_W1 is allocated: the step's peak then holds [T, D], not [R, D]
        grad_x = gather_sum(grad_xg, bags, None if on_output else live_weights(indices, weights))
        del grad_xg, grad_w_rows, bags
        grad_fc1 = fc1.new_empty(fc1.shape)
        out_concat = ("out",) if ctx.interleaved else None
        gemm(
            x.T, grad_preact, out=grad_fc1.mT, cu_seqlens_k=cu, A_idx=token,
            concat_layout=out_concat,
        )  # fmt: skip
        release_preact(grad_preact, pinned)
        del grad_preact
        if not fc2_first:
            grad_fc2 = gemm(grad_y.T, g, cu_seqlens_k=cu, A_idx=token)
        return grad_x, None, grad_w, grad_fc1, grad_fc2, None, None, None


def drop_h_quack_experts(
    x, indices, weights, fc1, fc2, weights_on, saved_fp8=False, inplace=True, **_
):
    """drop_h for routed experts on quack's gather GEMMs (CUDA sm_90+, D and F multiples of 8;
    the module docstring). One expert's weights have the dense layer's shapes, which
    ``check_quack_inputs`` reads. Its GEMMs gather inside already: ``gathered_wgrad`` is
    drop_h's (``ops.experts.check_options`` refuses it here)."""
    check_quack_inputs(x, fc1[0], fc2[0], IMPL)
    x, fc1, fc2 = x.contiguous(), fc1.contiguous(), fc2.contiguous()
    return _ExpertsDropHQuack.apply(x, indices, weights, fc1, fc2, weights_on, saved_fp8, inplace)


def gated_forward(weights_on: str, saved_fp8: bool) -> bool:
    """Whether SwiGLU runs in fc1's GEMM epilogue (the module docstring): unless the router
    weight scales the input, and so the preactivation before SwiGLU, which quack's gated
    epilogue cannot, or the preactivation is kept as drop_h's canonical FP8 copy, which
    drop_h's quantizing kernel writes."""
    return weights_on == "output" and not saved_fp8
