"""Hugging Face export / import of zoo checkpoints (``python -m tools.convert_checkpoint``).

- :mod:`models.hf.export.mapping`: parameter names and layouts, Megatron <-> GLM-4.5-MoE.
- :mod:`models.hf.export.convert`: streaming ``to_hf``, ``from_hf`` (and upcycling).
- ``remote/``: the ``transformers`` remote code of the hyper-connection variants.
"""
