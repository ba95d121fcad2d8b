"""DeepSeek-V4.1: `config.py` (the release's nested config and CSA2 roles), `layout.py` (tensors and the release's formats), `family.py`."""
