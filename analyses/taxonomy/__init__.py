"""The head classes of the literature, as their papers' code computes them: successor and copy-suppression heads,
IOI's name movers and S-inhibition heads, function-vector heads. May import every room below it (``data``,
``heads``, ``causal``, ``explain``, ``long``).
"""
