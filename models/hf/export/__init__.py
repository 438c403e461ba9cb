"""Hugging Face model code of exported zoo checkpoints (``python -m tools.convert_checkpoint``).

- :mod:`models.hf.export.mapping`: parameter names and layouts, Megatron <-> GLM-4.5-MoE.
- ``remote/``: the ``transformers`` remote code of the hyper-connection variants.

The converter itself (streaming ``to_hf``, ``from_hf`` and upcycling) is :mod:`tools.hf.conversion`: it
reads training checkpoints, so it lives on the tools floor.
"""
