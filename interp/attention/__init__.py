"""Our attention step: the eager and flash paths registered with transformers' attention interface, their kernels
and mask functions, attention sites, the per-site pass and the O(n) statistics of the tiled pass. May import
``interp.runtime`` and ``interp.tokens``.
"""
