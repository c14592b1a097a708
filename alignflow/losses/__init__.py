"""Loss functions of the alignment stages, as pure functions of per-sequence log-probs.

`preference`: the DPO family (sigmoid, IPO, conservative DPO) with the SFT term.
`policy`: GRPO's group advantages (RLOO, normalisation) and clipped policy loss (dual clip,
k3 KL, on-policy KL approximation, importance-sampling correction).
Their settings are the `loss` sections of the stage schemas (`alignflow.config.schema`).
"""
