"""Loss functions of the alignment stages, as pure functions of per-sequence log-probs.

`preference`: the DPO family (sigmoid, IPO, conservative DPO) with the SFT term.
`policy`: GRPO's group advantages (RLOO, sample-std normalisation) and clipped policy loss
(TRL's loss types, GSPO's sequence-level ratio, dual clip, k1/k2/k3 KL with NeMo-RL's clamps,
on-policy KL approximation, importance-sampling correction).
Their settings are the `loss` sections of the stage schemas (`alignflow.orchestrator.config.schema`).
"""
