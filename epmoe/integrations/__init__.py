"""Adapters that run :class:`epmoe.DeepEPMoELayer` inside other libraries' models.

Each adapter is its own module and imports its library; importing this package imports none of
them (``transformers`` is an optional dependency: ``pip install epmoe[hf]``).

* :mod:`epmoe.integrations.transformers`: Hugging Face transformers v5 MoE models (``enable``,
  the ``"epmoe"`` experts implementation, and an expert-parallel ``from_pretrained``).
"""
