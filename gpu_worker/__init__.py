"""The engine: base models, multi-LoRA adapters, losses, optimizer, sampling, checkpoints.

Knows nothing of HTTP, SQL or Celery. `gpu_worker.protocol` is importable without torch.
"""
