"""The model families, one package each (`v4/`, `v41/`): config, tensor layout and formats, and a
`Family` (`base.py`) that tells the engine what to do with the family's configs. `registry.py` keys
them by config.json's `model_type`. This package imports nothing, so a family's modules can be
imported without loading the others."""
