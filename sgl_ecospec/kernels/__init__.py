"""GPU kernels written in Triton, each with a plain PyTorch reference beside it."""
