"""Loss functions of the alignment stages, as pure functions of per-sequence log-probs.

`preference`: the DPO family (sigmoid, IPO, conservative DPO) with the SFT term.
`policy`: GRPO's group advantages (RLOO, normalisation) and clipped policy loss (dual clip,
k3 KL, on-policy KL approximation, importance-sampling correction).
"""

from dataclasses import fields
from typing import Any, TypeVar

Knobs = TypeVar("Knobs")


def from_section(config_class: type[Knobs], section: Any) -> Knobs:
    """A loss config dataclass from its stage's config section (plain data or DictConfig): the
    knobs the loss names, leaving the section's other keys (batch sizes, trainer, ...) out."""
    return config_class(**{f.name: section[f.name] for f in fields(config_class)})
