"""Run real megatron-core on CPU with gloo, for the Megatron integration tests.

Megatron assumes CUDA in a few places that a CPU test still reaches:
- the model-parallel RNG tracker (dropout forks, activation recompute) reads and sets the
  CUDA generator's state;
- the global memory buffer (the sequence-parallel all-gather in ColumnParallelLinear) and the
  sequence-parallel collectives allocate on ``torch.cuda.current_device()``;
- dist-ckpt's filesystem writer calls ``torch.cuda.synchronize()`` before writing;
- the pipeline schedules count tokens in a ``torch.zeros(..., device="cuda")``;
- the optimizers keep their loss scale in a ``torch.tensor(..., device="cuda")``, and the
  grad norm (without Apex or TE) its overflow flag and result in CUDA tensors;
- DistributedOptimizer checks parameter type names for CUDA and gathers state with ``.cuda()``
  (:func:`shim_distributed_optimizer`, installed only by the tests that build one);
- MoE: the alltoall token dispatcher copies its split sizes to the host on a CUDA side stream
  (as numpy arrays, the form the collectives take them in), and the aux-loss tracker keeps its
  values in a ``torch.zeros(..., device="cuda")``; over expert-TP it all-gathers and
  reduce-scatters uneven token counts, which NCCL runs and gloo does not
  (:class:`_GlooUnevenCollectives`).

And one shim saves time only: dist-ckpt's writer collects its write results in a queue of a
``spawn``-context multiprocessing Manager, whose server process re-imports torch (about 10 s on
two busy cores) at the first save; these saves are synchronous, so results are put and taken in
the saving process, and a plain queue serves.

:func:`shim_cuda_only_calls` points those at the CPU generator and CPU memory. The shims live
here, in test code, because outside tests Megatron only runs on CUDA; they are installed in
the spawned worker processes only, never in the pytest process.
"""

from __future__ import annotations

import contextlib
import copy
import os
import queue
import socket
import tempfile
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core", reason="needs the megatron extra")

from megatron.core import parallel_state
from megatron.core import utils as mcore_utils
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer import clip_grads as mcore_clip_grads
from megatron.core.optimizer import optimizer as mcore_optimizer
from megatron.core.optimizer.optimizer import FP32Optimizer
from megatron.core.pipeline_parallel import schedules
from megatron.core.tensor_parallel import mappings as mcore_mappings
from megatron.core.tensor_parallel import random as mcore_random
from megatron.core.transformer import torch_norm
from megatron.core.transformer.moe import moe_utils, token_dispatcher
from megatron.core.transformer.transformer_config import TransformerConfig


class _CpuMemoryBuffer(mcore_utils.GlobalMemoryBuffer):
    """Megatron's GlobalMemoryBuffer, allocating on the CPU instead of the current GPU."""

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        numel = int(torch.Size(tensor_shape).numel())
        buffer = self.buffer.get((name, dtype))
        if buffer is None or buffer.numel() < numel:
            buffer = self.buffer[(name, dtype)] = torch.empty(numel, dtype=dtype)
        return buffer[:numel].view(*tensor_shape)


class _CpuRNGStatesTracker(mcore_random.CudaRNGStatesTracker):
    """The RNG tracker with named states of the CPU generator instead of the CUDA one."""

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_ or name in self.states_:
            raise ValueError(f"rng state {name} / seed {seed} already exists")
        self.seeds_.add(seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()


class _CpuStream:
    """A CUDA stream and event stand-in: on the CPU every copy has finished when it returns."""

    def wait_stream(self, stream: object) -> None:
        pass

    def record_event(self) -> _CpuStream:
        return self

    def synchronize(self) -> None:
        pass


class _CudaStreamsOnCpu:
    """``torch.cuda`` as the MoE token dispatcher sees it: its side stream is the CPU's one."""

    _stream = _CpuStream()

    def __getattr__(self, name: str):
        return getattr(torch.cuda, name)

    def Stream(self, *args, **kwargs) -> _CpuStream:
        return self._stream

    def current_stream(self, *args, **kwargs) -> _CpuStream:
        return self._stream

    def stream(self, stream: _CpuStream) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class _TorchWithoutCudaFactories:
    """The torch module as the schedules, optimizer, grad-norm and MoE modules see it, with the
    tensor factories they call with ``device="cuda"`` allocating on the CPU, and CUDA streams
    that are the CPU's."""

    cuda = _CudaStreamsOnCpu()

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs) -> torch.Tensor:
        return torch.zeros(*args, **kwargs)

    @staticmethod
    def tensor(*args, device=None, **kwargs) -> torch.Tensor:
        return torch.tensor(*args, **kwargs)


class _GlooUnevenCollectives:
    """``torch.distributed`` as Megatron's TP mappings see it, with the uneven all-gather and
    reduce-scatter (tensors of different lengths per rank) run through gloo's even ones: the
    gather pads every rank's tensor to the longest, the reduce-scatter all-reduces the whole."""

    def __getattr__(self, name: str):
        return getattr(torch.distributed, name)

    @staticmethod
    def all_gather(outputs: list, tensor: torch.Tensor, group=None, async_op=False) -> None:
        sizes = [t.shape[0] for t in outputs]
        if len(set(sizes)) == 1:
            torch.distributed.all_gather(outputs, tensor, group=group)
            return
        padded = tensor.new_zeros(max(sizes), *tensor.shape[1:])
        padded[: tensor.shape[0]] = tensor
        gathered = [torch.empty_like(padded) for _ in sizes]
        torch.distributed.all_gather(gathered, padded, group=group)
        for out, full, n in zip(outputs, gathered, sizes, strict=True):
            out.copy_(full[:n])

    @staticmethod
    def reduce_scatter(output: torch.Tensor, inputs: list, group=None, async_op=False) -> None:
        total = torch.cat(inputs)
        torch.distributed.all_reduce(total, group=group)
        output.copy_(total.split([t.shape[0] for t in inputs])[group.rank()])


class _TorchWithUnevenGloo:
    """The torch module as Megatron's TP mappings see it (:class:`_GlooUnevenCollectives`)."""

    distributed = _GlooUnevenCollectives()

    def __getattr__(self, name: str):
        return getattr(torch, name)


def _host_copy_on_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
    """The dispatcher's device-to-host copy for tensors already on the CPU: split sizes become
    the numpy arrays its CUDA path makes (``all_to_all_single`` takes no tensor for them)."""
    return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor


def _l2_norm_on_cpu(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Megatron's torch fallback for Apex's multi-tensor L2 norm, its result left on the CPU."""
    norms = [torch.linalg.vector_norm(t.float()) for tensors in tensor_lists for t in tensors]
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def shim_cuda_only_calls(seed: int = 1234) -> None:
    """Install the CPU stand-ins for Megatron's CUDA-only RNG and buffer calls (per process)."""
    mcore_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    tracker = _CpuRNGStatesTracker()
    tracker.add(mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed)
    mcore_random._CUDA_RNG_STATE_TRACKER = tracker
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    parallel_state._GLOBAL_MEMORY_BUFFER = _CpuMemoryBuffer()
    # Only ever called in the spawned worker processes, which never touch a GPU.
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda device=None: None
    without_cuda = _TorchWithoutCudaFactories()
    schedules.torch = mcore_optimizer.torch = mcore_clip_grads.torch = without_cuda
    token_dispatcher.torch = moe_utils.torch = without_cuda
    token_dispatcher.maybe_move_tensor_to_cpu = _host_copy_on_cpu
    mcore_mappings.torch = _TorchWithUnevenGloo()
    filesystem_async._results_queue = queue.Queue()
    mcore_clip_grads.l2_norm_impl = _l2_norm_on_cpu


def shim_distributed_optimizer() -> None:
    """Let Megatron's DistributedOptimizer take CPU parameters (per process, workers only).

    It accepts a parameter only if ``.type()`` names a CUDA tensor type, and moves the state it
    gathers for a checkpoint with ``.cuda()``: CPU tensors report the CUDA type names and
    ``.cuda()`` leaves them where they are. Nothing else about its arithmetic changes.
    """
    plain_type = torch.Tensor.type

    def cuda_type_names(self: torch.Tensor, *args, **kwargs):
        name = plain_type(self, *args, **kwargs)
        if args or kwargs or not name.startswith("torch.") or ".cuda." in name:
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = cuda_type_names
    torch.Tensor.cuda = lambda self, *args, **kwargs: self


def shim_torch_norm_sequence_parallel() -> None:
    """Let the torch norms Megatron builds without Apex or TE (``WrappedTorchNorm``) run under
    sequence parallelism (per process, workers only), which Megatron requires of MoE layers
    with TP > 1 in training. A norm over the hidden size is the same on a sequence shard; the
    fused norms it asserts for differ only in marking their parameters ``sequence_parallel``
    (their grads are partial sums over the TP group, which DDP's finalize all-reduces): the
    norm is built from a copy of the config without it and its parameters are marked so."""
    cls = torch_norm.WrappedTorchNorm
    if getattr(cls, "_sequence_parallel_shim", False):
        return
    plain = cls.__new__

    def new(cls_, config, *args, **kwargs):
        if not config.sequence_parallel:
            return plain(cls_, config, *args, **kwargs)
        config = copy.copy(config)
        config.sequence_parallel = False
        norm = plain(cls_, config, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    cls.__new__ = staticmethod(new)
    cls._sequence_parallel_shim = True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def megatron_parallel(
    rank: int, world_size: int, rendezvous: str, tp: int = 1, pp: int = 1
) -> Iterator:
    """A gloo process group with Megatron's model-parallel state, torn down on exit.

    The ranks meet through a file, not a TCP port: a free port picked in the parent can be
    taken by another test before the workers bind it.
    """
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size
    )
    try:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
        )
        shim_cuda_only_calls()
        yield
        torch.distributed.barrier()  # no rank tears gloo down while another is in a collective
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def spawn(fn: Callable, world_size: int, *args) -> None:
    """Run ``fn(rank, world_size, rendezvous, *args)`` in ``world_size`` gloo processes, where
    ``rendezvous`` is a fresh file path for :func:`megatron_parallel`."""
    with tempfile.TemporaryDirectory() as folder:
        rendezvous = os.path.join(folder, "rendezvous")
        torch.multiprocessing.spawn(fn, args=(world_size, rendezvous, *args), nprocs=world_size)


def swiglu_config(**overrides) -> TransformerConfig:
    """A tiny fp32 SwiGLU config on CPU; TransformerConfig reads the TP size given here."""
    fields = dict(
        num_layers=2,
        hidden_size=32,
        ffn_hidden_size=48,
        num_attention_heads=4,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        bias_activation_fusion=False,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        normalization="RMSNorm",
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size()
        if parallel_state.model_parallel_is_initialized()
        else 1,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def _init_adam_state(optimizer: torch.optim.Optimizer, config=None) -> None:
    """What get_megatron_optimizer passes for Adam: zero moments before a load."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not optimizer.state[p]:
                optimizer.state[p]["exp_avg"] = torch.zeros_like(p)
                optimizer.state[p]["exp_avg_sq"] = torch.zeros_like(p)


def make_optimizer(model: torch.nn.Module) -> FP32Optimizer:
    """Megatron's optimizer for fp32 params without DistributedOptimizer (which needs CUDA)."""
    config = OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=0.0)
    # One param group with the keys Megatron's optimizers match groups by when loading.
    group = dict(wd_mult=1.0, lr_mult=1.0, is_expert_parallel=False, is_decoupled_lr=False)
    adam = torch.optim.Adam([{"params": list(model.parameters()), **group}], lr=config.lr)
    return FP32Optimizer(adam, config, init_state_fn=_init_adam_state)
