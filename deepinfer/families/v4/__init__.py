"""DeepSeek-V4: `config.py`, `layout.py` (tensor inventory), `quantized.py` (transformers' FP8 format), `family.py`."""
