"""Why a head attends and what it writes: QK attribution and its causal check, direct logit attribution and the
logit lens, composition scores. May import ``analyses.data``, ``analyses.heads`` and ``analyses.causal``.
"""
