"""toolkit-preference-losses: registration through the entry point, values against TRL, a DPO run with each loss."""

from pathlib import Path

import pytest
import torch
from toolkit_preference_losses import BetaSettings, nca_pair, sppo_hard

import toolkit
from toolkit import DPOConfig, DPOTrainer, PreferenceLossInputs
from toolkit.testing import tiny_model, tiny_tokenizer, trl_dpo_inputs


def rows(n=8):
    return [{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
             "chosen": [{"role": "assistant", "content": str(i + 1)}],
             "rejected": [{"role": "assistant", "content": f"{i + 3} maybe not"}]} for i in range(n)]


def cfg(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=4, learning_rate=1e-3,
                logging_steps=1, save_strategy="no", seed=0, disable_tqdm=True, report_to="none", beta=0.3)
    base.update(kw)
    return DPOConfig(**base)


def test_registered_through_the_installed_entry_point():
    table = toolkit.registry().tables()["preference_loss"]
    assert table["nca_pair"].obj is nca_pair and table["sppo_hard"].obj is sppo_hard
    assert {table[k].package for k in ("nca_pair", "sppo_hard")} == {"toolkit-preference-losses 0.2.0"}


def _call(loss, z_w, z_l, beta=0.3):
    from toolkit.core.objectives import resolve_preference_loss_settings

    settings = resolve_preference_loss_settings(loss, cfg(Path("/tmp/unused"), beta=beta), name="x")
    assert settings == BetaSettings(beta=beta)  # beta comes from the config field of that name
    return loss(PreferenceLossInputs(z_w, z_l, torch.ones_like(z_w), torch.ones_like(z_l)), settings)


def test_formulas_on_known_values():
    z_w, z_l = torch.tensor([2.0, -1.0]), torch.tensor([-3.0, 0.5])
    s = torch.nn.functional.logsigmoid
    torch.testing.assert_close(_call(nca_pair, z_w, z_l), -s(0.3 * z_w) - 0.5 * s(-0.3 * z_w) - 0.5 * s(-0.3 * z_l))
    torch.testing.assert_close(_call(sppo_hard, z_w, z_l), (z_w - 0.5 / 0.3) ** 2 + (z_l + 0.5 / 0.3) ** 2)
    # sppo_hard is minimal exactly at z_w = 1/(2 beta), z_l = -1/(2 beta)
    assert _call(sppo_hard, torch.tensor([0.5 / 0.3]), torch.tensor([-0.5 / 0.3])).item() == pytest.approx(0.0)


@pytest.mark.parametrize("loss_type", ["nca_pair", "sppo_hard"])
def test_loss_equals_trl(tmp_path, loss_type):
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    tok = tiny_tokenizer()
    data = rows(4)
    ours = DPOTrainer(tiny_model(), args=cfg(tmp_path, loss_type=loss_type), train_dataset=data, processing_class=tok)
    examples = [ours.train_dataset[i] for i in range(4)]
    g = torch.Generator().manual_seed(0)
    ref_c, ref_r = -torch.rand(4, generator=g) * 20 - 5, -torch.rand(4, generator=g) * 20 - 5
    batch = ours.data_collator(examples)
    batch["ref_chosen_logps"], batch["ref_rejected_logps"] = ref_c, ref_r
    ours.model.train()
    our_loss = ours.compute_loss(ours.model, batch)

    tiny_model().save_pretrained(tmp_path / "tiny")
    theirs = trl.DPOTrainer(model=str(tmp_path / "tiny"), processing_class=tok,
                            args=trl.DPOConfig(output_dir=str(tmp_path / "trl"), loss_type=[loss_type], beta=0.3,
                                               use_cpu=True, bf16=False, report_to="none",
                                               model_init_kwargs={"dtype": torch.float32}),
                            train_dataset=Dataset.from_list(data))
    theirs.precompute_ref_logps = True
    theirs.model.train()
    inputs = {**trl_dpo_inputs(examples, tok.pad_token_id), "ref_chosen_logps": ref_c, "ref_rejected_logps": ref_r}
    trl_loss = theirs._compute_loss(theirs.model, inputs, return_outputs=False)
    trl_loss = trl_loss[0] if isinstance(trl_loss, tuple) else trl_loss
    assert our_loss.item() == pytest.approx(trl_loss.item(), rel=1e-5, abs=1e-5)


def test_nca_raises_the_chosen_likelihood(tmp_path):
    """NCA's point: the chosen answer's log-prob goes up in absolute terms (DPO only promises the margin)."""
    t = DPOTrainer(tiny_model(), args=cfg(tmp_path, loss_type="nca_pair", max_steps=6, learning_rate=3e-3),
                   train_dataset=rows(), processing_class=tiny_tokenizer())
    t.train()
    chosen = [h["logps/chosen"] for h in t.state.log_history if "logps/chosen" in h]
    margins = [h["rewards/margins"] for h in t.state.log_history if "rewards/margins" in h]
    assert chosen[-1] > chosen[0] and margins[-1] > margins[0]
