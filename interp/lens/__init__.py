"""TransformerLens's surface: tokens and generation, weights (``W_Q`` ... ``W_U``), low-rank OV/QK circuits, and the
cache's residual-stream decompositions. May import ``runtime``, ``tokens``, ``attention`` and ``structure``.
"""
