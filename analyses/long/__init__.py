"""Long context: head statistics of one layer in O(n) memory, retrieval heads from needle decoding, streaming-head
curves and DuoAttention-style gates. May import ``analyses.data``, ``analyses.heads``, ``analyses.causal`` and
``analyses.explain``.
"""
