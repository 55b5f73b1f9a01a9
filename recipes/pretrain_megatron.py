"""Pretrain a Megatron-core GPTModel whose MLPs run a swiglu-train impl.

    torchrun --nproc-per-node 8 recipes/pretrain_megatron.py --mlp-impl drop_h --tp 2

GPTModel with ``get_gpt_layer_spec(mlp_impl)``, bf16 through Float16Module, Megatron's DDP
and DistributedOptimizer, MockGPTDataset unless ``--data-path`` names indexed datasets,
dist-ckpt save/resume, and per-step memory (profiler, rank 0) plus loss and throughput logged
to W&B (offline without an API key). ``--mlp-impl stock`` runs Megatron's own MLP for A/B.
``--num-experts N`` makes every layer a Megatron MoE layer whose routed experts run
``--mlp-impl`` (``stock``: Megatron's SequentialMLP); ``--ep`` sets expert parallelism.

``--device cpu`` runs on gloo in fp32 for smoke tests, with torch's AdamW stepping on the
DDP grad buffers (Megatron's optimizers allocate on "cuda" unconditionally) and model-only
checkpoints. Megatron still calls a few CUDA-only functions there (its RNG tracker, buffer
allocation), which tests/megatron_support.py replaces; so ``--device cpu`` runs through
tests/megatron_recipe_cpu.py, which installs those shims first (launched directly, the recipe
says so and stops).

W&B gets memory, loss and throughput from global rank 0, so only with ``--pp 1`` (with
pipeline parallelism rank 0 holds neither the loss nor a bracketed forward/backward).

Its parts live in ``swiglu_train.integrations.megatron.pretrain`` (arguments, model and
optimizer, data, checkpoints, the training loop); this file is the entry point torchrun runs.
"""

from swiglu_train.integrations.megatron.pretrain.train import main

if __name__ == "__main__":
    main()
