"""A model's versioned head atlas (every score, label, digest and causal check in one JSON) and published head
tables checked against a model (expectations). May import every study room (``data`` to ``circuits``); views and the
CLI build on it.
"""
