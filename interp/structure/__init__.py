"""A model's structure found by one probe forward (decoder-only, encoder-only and encoder-decoder sites, where the
heads sit in the projections), head slicing, the families refused by name, and norms read as numbers. May import
``runtime``, ``tokens`` and ``attention``.
"""
