"""The Megatron-core pretraining recipe that ``recipes/pretrain_megatron.py`` runs, by concern:

- :mod:`.args`: the command line, ``--plan`` and the recompute options checked together;
- :mod:`.build`: process groups, TransformerConfig, the GPTModel under DDP, the optimizer;
- :mod:`.data`: the training DataLoader (Megatron's mock or indexed datasets);
- :mod:`.checkpoint`: dist-ckpt save and resume, DistributedOptimizer state included;
- :mod:`.train`: the training loop, its logging (stdout, W&B, memory) and ``--summary-json``.
"""
