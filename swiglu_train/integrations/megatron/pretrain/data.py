"""The training data: Megatron's MockGPTDataset, or indexed datasets (``--data-path``), one
DataLoader per data-parallel rank."""

from __future__ import annotations

import argparse

import torch
from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer


def train_loader(args: argparse.Namespace) -> torch.utils.data.DataLoader:
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=(args.data_path, None) if args.data_path else None,  # None: mock data
        split="1,0,0",
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        # the local attention's own causal mask is CUDA-only: on the CPU the data brings one
        create_attention_mask=args.create_attention_mask_in_dataloader,
        tokenizer=NullTokenizer(args.vocab_size - 1),
    )
    dp = parallel_state.get_data_parallel_world_size()
    samples = args.max_steps * args.num_microbatches * args.micro_batch_size * dp
    dataset_type = GPTDataset if args.data_path else MockGPTDataset
    train, _, _ = BlendedMegatronDatasetBuilder(
        dataset_type, [samples, 0, 0], lambda: True, config
    ).build()
    sampler = torch.utils.data.DistributedSampler(
        train, num_replicas=dp, rank=parallel_state.get_data_parallel_rank(), shuffle=False
    )
    return torch.utils.data.DataLoader(train, batch_size=args.micro_batch_size, sampler=sampler)
