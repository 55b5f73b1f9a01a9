"""The key of our record in a Lightning checkpoint (fc1 layout, impl, optimizer parameter
names, data). The module that writes the record and the readers of checkpoints (fsdp2,
sharded_checkpoint, hf, pretrain) all name it, so it lives below each of them."""

LAYOUT_KEY = "swiglu_train"
