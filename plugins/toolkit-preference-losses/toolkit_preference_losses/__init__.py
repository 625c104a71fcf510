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

b is the config's `beta` (read into `BetaSettings`). Definitions follow TRL's DPOTrainer names, and
the tests check the values against it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from toolkit import PreferenceLoss, PreferenceLossInputs, SettingsError, hookimpl

__version__ = "0.2.0"


@dataclass(frozen=True)
class BetaSettings:
    beta: float = 0.1

    def __post_init__(self):
        if self.beta <= 0:
            raise SettingsError("beta", f"must be > 0, got {self.beta}.")


def nca_pair_term(inputs: PreferenceLossInputs, settings: BetaSettings) -> torch.Tensor:
    w, lo = settings.beta * inputs.chosen_logratios, settings.beta * inputs.rejected_logratios
    return -F.logsigmoid(w) - 0.5 * F.logsigmoid(-w) - 0.5 * F.logsigmoid(-lo)


def sppo_hard_term(inputs: PreferenceLossInputs, settings: BetaSettings) -> torch.Tensor:
    half = 0.5 / settings.beta
    return (inputs.chosen_logratios - half) ** 2 + (inputs.rejected_logratios + half) ** 2


nca_pair = PreferenceLoss(nca_pair_term, BetaSettings, "NCA pairwise (Chen et al. 2024)")
sppo_hard = PreferenceLoss(sppo_hard_term, BetaSettings, "SPPO with hard win probabilities (Wu et al. 2024)")


@hookimpl
def toolkit_register_preference_losses():
    return {"nca_pair": nca_pair, "sppo_hard": sppo_hard}
