"""A checkpoint and what it computes: config, weights and their file formats, the
default model, synthetic weights, tokenizer and chat template, the forward pass."""
