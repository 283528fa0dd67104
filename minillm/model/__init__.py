"""What computes: the model's configuration (presets and shape twins), the Llama-family
transformer in plain PyTorch, and the loader for checkpoints and twins."""
