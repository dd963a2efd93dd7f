"""8-bit attention: backends (triton8.py, cudnn8.py), the per-shape choice between them and SDPA (choice.py), and
the torch custom op that torch.compile and CUDA graphs accept (op.py)."""
