"""The mixture-of-experts GPT: `layers.py` (torch) and `spec.py` (its numbers, pure Python)."""
