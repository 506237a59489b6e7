"""Interventions on heads: the batching engine, ablation, activation, path and attribution patching, importance and
pruning, and the class-against-random-heads test. May import ``analyses.data`` and ``analyses.heads``.
"""
