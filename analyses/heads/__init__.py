"""Head scores: the one registry of scores (ours and a user's), our target rules, scores read on the per-site pass,
labels, and ``detect_heads``. May import ``analyses.data``.
"""
