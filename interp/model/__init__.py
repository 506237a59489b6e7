"""The one model wrapper (``HookedModel``) and what it is built from: its configuration, one site per layer or an
encoder-decoder's sites, loading and the bundled models, TransformerLens's loading line. May import every room
below it (``runtime`` to ``lens``).
"""
