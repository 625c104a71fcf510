"""Two preference losses for toolkit's DPOTrainer: `loss_type = "nca_pair"` and `"sppo_hard"`.

Both take the implicit rewards' log-ratios z = log pi(y|x) - log pi_ref(y|x) (summed over the
answer's tokens) of the chosen (w) and rejected (l) answers:

* nca_pair (Chen et al. 2024, "Noise Contrastive Alignment", arXiv:2402.05369):
      -log s(b z_w) - 1/2 log s(-b z_w) - 1/2 log s(-b z_l)
  optimises absolute likelihoods, not only the margin: the chosen answer's likelihood is pushed up
  instead of both falling together as DPO often does.
* sppo_hard (Wu et al. 2024, "Self-Play Preference Optimization", arXiv:2405.00675, with the hard
  win probability 1 for the chosen and 0 for the rejected answer):
      (z_w - 1/(2b))^2 + (z_l + 1/(2b))^2

b is the config's `beta`. Definitions follow TRL's DPOTrainer names, and the tests check the values
against it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from toolkit import hookimpl

__version__ = "0.1.0"


def nca_pair(chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor, *, config, **_) -> torch.Tensor:
    w, lo = config.beta * chosen_logratios, config.beta * rejected_logratios
    return -F.logsigmoid(w) - 0.5 * F.logsigmoid(-w) - 0.5 * F.logsigmoid(-lo)


def sppo_hard(chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor, *, config, **_) -> torch.Tensor:
    half = 0.5 / config.beta
    return (chosen_logratios - half) ** 2 + (rejected_logratios + half) ** 2


@hookimpl
def toolkit_register_preference_losses():
    return {"nca_pair": nca_pair, "sppo_hard": sppo_hard}
