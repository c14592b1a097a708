"""Loss functions of the alignment stages, as pure functions of per-sequence log-probs.

`preference`: the DPO family (sigmoid, IPO, conservative DPO) with the SFT term.
"""
