"""The runtime core: errors, model config, the model, checkpoints and the tokenizer (imports nothing above it)."""
