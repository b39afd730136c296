"""vela-ray: locality-aware expert placement for MoE LoRA fine-tuning on Ray.

The model side lives here (no Ray imports except in `api` and `cli`):
model surgery, expert shards, the expert broker and its transports,
locality profiling, data and adapters. The Ray runtime is in `actors/`,
the placement math in `placement/`.
"""

__version__ = "0.1.0"
