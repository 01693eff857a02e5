"""Multi-latent attention (DeepSeek-V2/V3): `layers.py` (torch) and `spec.py` (its numbers, pure Python)."""
