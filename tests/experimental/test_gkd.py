"""toolkit.experimental.gkd: GKD / on-policy distillation. The divergence equals TRL's generalized_jsd_loss (value
and gradient) and the trainer's loss and gradients equal TRL's GKDTrainer.compute_loss on the same ids (TRL's own
code, student and teacher); the chunked head equals the unchunked one; the student moves towards the teacher;
exact resume with the lmbda coin; errors named before any model loads."""

import dataclasses
import os
import types

import pytest
import torch
from builders import StopAt

from toolkit.core.errors import ConfigError, DataError
from toolkit.core.generation import Completion
from toolkit.testing import tiny_model, tiny_tokenizer

os.environ.setdefault("TOOLKIT_EXPERIMENTAL_SILENCE", "1")
from toolkit.experimental.gkd import GKDConfig, GKDTrainer, generalized_jsd  # noqa: E402

U = lambda c: {"role": "user", "content": c}  # noqa: E731
A = lambda c: {"role": "assistant", "content": c}  # noqa: E731


def rows(n=16, completions=True):
    return [{"prompt": [U(f"What is {i} + 1?")], **({"completion": [A(str(i + 1))]} if completions else {})}
            for i in range(n)]


def cfg(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=4, learning_rate=1e-3,
                max_completion_length=8, logging_steps=1, save_strategy="no", seed=0, disable_tqdm=True,
                report_to="none", lmbda=1.0)
    base.update(kw)
    return GKDConfig(**base)


def logged(t, key):
    return [h[key] for h in t.state.log_history if key in h]


def teacher():
    """A teacher that differs clearly from the tiny student (another init, a sharper head)."""
    t = tiny_model(seed=3)
    with torch.no_grad():
        t.get_output_embeddings().weight.mul_(3.0)
    return t


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_generalized_jsd_equals_trl(beta, temperature):
    pytest.importorskip("trl")
    from trl.experimental.gkd import GKDTrainer as TRLGKD

    g = torch.Generator().manual_seed(0)
    student = torch.randn(3, 5, 11, generator=g, dtype=torch.float64, requires_grad=True)
    teacher_logits = torch.randn(3, 5, 11, generator=g, dtype=torch.float64) * 2
    labels = torch.randint(0, 11, (3, 5), generator=g)
    labels[0, :2] = -100
    labels[2, 4] = -100
    theirs = TRLGKD.generalized_jsd_loss(student, teacher_logits, labels=labels, beta=beta, temperature=temperature)
    (g_theirs,) = torch.autograd.grad(theirs, student)
    keep = labels != -100
    ours = generalized_jsd(student[keep], teacher_logits[keep], beta, temperature).sum() / keep.sum()
    (g_ours,) = torch.autograd.grad(ours, student)
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(g_ours, g_theirs, rtol=1e-10, atol=1e-10)
    assert ours > 0


def test_the_ends_of_beta_are_the_two_kls():
    g = torch.Generator().manual_seed(1)
    s, t = torch.randn(4, 7, generator=g, dtype=torch.float64), torch.randn(4, 7, generator=g, dtype=torch.float64)
    ps, pt = s.softmax(-1), t.softmax(-1)
    torch.testing.assert_close(generalized_jsd(s, t, 0.0), (pt * (pt.log() - ps.log())).sum(-1))  # KL(t || s)
    torch.testing.assert_close(generalized_jsd(s, t, 1.0), (ps * (ps.log() - pt.log())).sum(-1))  # KL(s || t)
    m = 0.5 * ps + 0.5 * pt
    js = 0.5 * (pt * (pt.log() - m.log())).sum(-1) + 0.5 * (ps * (ps.log() - m.log())).sum(-1)
    torch.testing.assert_close(generalized_jsd(s, t, 0.5), js)


def _groups(tok):
    eos = tok.eos_token_id
    return [[Completion([5, 6, 7, eos], [0.0] * 4, "stop")], [Completion([8, 9, 10, 11, 12, eos], [0.0] * 6, "stop")],
            [Completion([13, eos], [0.0] * 2, "stop")], [Completion([14, 15, 16], [0.0] * 3, "length")]]


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_loss_and_gradients_equal_trl_compute_loss(tmp_path, beta):
    pytest.importorskip("trl")
    from trl.experimental.gkd import GKDTrainer as TRLGKD

    tok = tiny_tokenizer()
    the_teacher = teacher()
    ours = GKDTrainer(tiny_model(), teacher_model=the_teacher, args=cfg(tmp_path, beta=beta), train_dataset=rows(4),
                      processing_class=tok)
    groups = _groups(tok)
    rollout = ours.build_rollout([0, 1, 2, 3], groups, torch.zeros(0, 4), 0.0, 0.0)
    micro = ours._split(rollout)[0]
    ours.model.train()
    our_loss = ours.compute_loss(ours.model, micro)

    # TRL's compute_loss (its own code) on a padded batch of the same ids; labels -100 outside the completions
    pad = tok.pad_token_id
    seqs = [ours.prompt_ids[i] + g[0].token_ids for i, g in enumerate(groups)]
    width = max(map(len, seqs))
    input_ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
    attention = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    labels = torch.full_like(input_ids, -100)
    for i, g in enumerate(groups):
        p = len(ours.prompt_ids[i])
        labels[i, p:p + len(g[0].token_ids)] = torch.tensor(g[0].token_ids)
    student = tiny_model()
    student.train()
    self = types.SimpleNamespace(teacher_model=the_teacher, beta=beta,
                                 generalized_jsd_loss=TRLGKD.generalized_jsd_loss)
    trl_loss = TRLGKD.compute_loss(self, student, {"input_ids": input_ids, "attention_mask": attention,
                                                   "labels": labels})
    assert our_loss.item() == pytest.approx(trl_loss.item(), rel=1e-5, abs=1e-6)
    assert our_loss.item() > 1e-3
    our_loss.backward()
    trl_loss.backward()
    for (k, p), (_, q) in zip(student.named_parameters(), ours.model.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=k)


def test_chunked_head_equals_one_chunk(tmp_path):
    tok = tiny_tokenizer()
    grads = []
    for chunk in (3, 4096):
        t = GKDTrainer(tiny_model(), teacher_model=teacher(), args=cfg(tmp_path / str(chunk), logps_chunk_size=chunk),
                       train_dataset=rows(4), processing_class=tok)
        micro = t._split(t.build_rollout([0, 1, 2, 3], _groups(tok), torch.zeros(0, 4), 0.0, 0.0))[0]
        t.model.train()
        loss = t.compute_loss(t.model, micro)
        loss.backward()
        grads.append((loss.item(), [p.grad.clone() for p in t.model.parameters()]))
    assert grads[0][0] == pytest.approx(grads[1][0], rel=1e-6)
    for a, b in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_accumulated_micro_batches_take_the_step_of_one(tmp_path):
    """Two micro-batches of two completions give the gradient of one micro-batch of four: the loss divides by the
    step's completion tokens, not each micro-batch's (the completions have different lengths)."""
    tok = tiny_tokenizer()
    grads = []
    for B, GA in ((4, 1), (2, 2)):
        t = GKDTrainer(tiny_model(), teacher_model=teacher(), args=cfg(tmp_path / str(B), per_device_train_batch_size=B,
                                                                      gradient_accumulation_steps=GA),
                       train_dataset=rows(4), processing_class=tok)
        rollout = t.build_rollout([0, 1, 2, 3], _groups(tok), torch.zeros(0, 4), 0.0, 0.0)
        t.model.train()
        for micro in t._split(rollout):
            t.compute_loss(t.model, micro).backward()
        grads.append([p.grad.clone() for p in t.model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_the_student_moves_towards_the_teacher(tmp_path):
    """Off-policy steps (lmbda=0) on fixed completions: the divergence falls; on-policy steps run and log too."""
    t = GKDTrainer(tiny_model(), teacher_model=teacher(), args=cfg(tmp_path, lmbda=0.0, max_steps=8, beta=0.5,
                                                                   learning_rate=3e-3, lr_scheduler_type="constant"),
                   train_dataset=rows(4), processing_class=tiny_tokenizer())
    t.train()
    jsd = logged(t, "jsd_per_token")
    assert jsd[-1] < 0.6 * jsd[0], jsd
    assert set(logged(t, "on_policy")) == {0.0}
    t = GKDTrainer(tiny_model(), teacher_model=teacher(), args=cfg(tmp_path / "on", lmbda=1.0, max_steps=2),
                   reward_funcs=[lambda completions, **kw: [1.0] * len(completions)], train_dataset=rows(8),
                   processing_class=tiny_tokenizer())
    t.train()
    assert set(logged(t, "on_policy")) == {1.0} and logged(t, "reward") == [1.0, 1.0]


def test_off_policy_steps_train_on_the_dataset_completions(tmp_path):
    tok = tiny_tokenizer()
    t = GKDTrainer(tiny_model(), teacher_model=teacher(), args=cfg(tmp_path, lmbda=0.0), train_dataset=rows(4),
                   processing_class=tok)
    r = t.generate_rollout([2, 0])
    data = rows(4)
    for i, prompt_ids, ids in zip((2, 0), r.prompt_ids, r.completion_ids):
        # the prompt as rendered for sampling, then the completion: exactly the template's whole conversation
        full = tok.apply_chat_template(data[i]["prompt"] + data[i]["completion"], tokenize=False)
        assert prompt_ids + ids == tok(full, add_special_tokens=False)["input_ids"][:len(prompt_ids) + len(ids)]
        assert tok.decode(ids).startswith(data[i]["completion"][0]["content"]), tok.decode(ids)
        assert ids[-1] in (tok.eos_token_id, *tok(full, add_special_tokens=False)["input_ids"][-2:])
    assert not any(t.on_policy_step(s) for s in range(50))
    half = GKDTrainer(tiny_model(), teacher_model=teacher(), args=cfg(tmp_path / "h", lmbda=0.5),
                      train_dataset=rows(4), processing_class=tok)
    coins = [half.on_policy_step(s) for s in range(400)]
    assert 150 < sum(coins) < 250 and coins == [half.on_policy_step(s) for s in range(400)]  # seeded by step


@pytest.mark.slow
def test_exact_resume_equals_uninterrupted(tmp_path):
    def make(out, callbacks=(), **kw):
        return GKDTrainer(tiny_model(), teacher_model=teacher(), args=cfg(out, max_steps=4, lmbda=0.5, **kw),
                          train_dataset=rows(), processing_class=tiny_tokenizer(), callbacks=list(callbacks))

    full = make(tmp_path / "a")
    full.train()
    first = make(tmp_path / "b", callbacks=[StopAt(2)], save_strategy="steps", save_steps=2)
    first.train()
    resumed = make(tmp_path / "b", save_strategy="steps", save_steps=2)
    resumed.train(resume_from_checkpoint=True)
    assert logged(resumed, "on_policy") == logged(full, "on_policy") and 0.0 in logged(full, "on_policy")
    assert logged(resumed, "loss") == pytest.approx(logged(full, "loss"), abs=1e-6)
    for (k, v), (_, w) in zip(full.model.state_dict().items(), resumed.model.state_dict().items()):
        torch.testing.assert_close(w, v, rtol=0, atol=1e-6, msg=k)


def test_errors_name_the_field_before_any_model_loads(tmp_path):
    with pytest.raises(ConfigError, match="lmbda: the probability"):
        cfg(tmp_path, lmbda=1.5)
    with pytest.raises(ConfigError, match="beta: GKD's interpolation"):
        cfg(tmp_path, beta=-0.1)
    with pytest.raises(ConfigError, match="skip_solved_threshold: a prompt counts as solved by its reward"):
        GKDTrainer(tiny_model(), teacher_model=teacher(), args=cfg(tmp_path, skip_solved_threshold=0.9),
                   train_dataset=rows(4), processing_class=tiny_tokenizer())
    assert "advantage_estimator" not in {f.name for f in dataclasses.fields(GKDConfig)}  # GRPO's, not GKD's
    with pytest.raises(ConfigError, match="teacher_model: GKD needs a teacher"):
        GKDTrainer("/nonexistent/student", args=cfg(tmp_path), train_dataset=rows(4), processing_class=tiny_tokenizer())
    # lmbda < 1 needs the dataset's completions; named before the (nonexistent) models are loaded
    with pytest.raises(DataError, match="no 'completion' column"):
        GKDTrainer("/nonexistent/student", teacher_model=teacher(), args=cfg(tmp_path, lmbda=0.5),
                   train_dataset=rows(4, completions=False), processing_class=tiny_tokenizer())


def test_heads_padded_to_other_sizes_are_compared_over_the_tokenizer(tmp_path):
    tok = tiny_tokenizer()
    big = teacher()
    big.resize_token_embeddings(big.get_output_embeddings().weight.shape[0] + 8)  # a family's larger, padded head
    t = GKDTrainer(tiny_model(), teacher_model=big, args=cfg(tmp_path), train_dataset=rows(4), processing_class=tok)
    assert t._vocab == len(tok)
    micro = t._split(t.build_rollout([0, 1, 2, 3], _groups(tok), torch.zeros(0, 4), 0.0, 0.0))[0]
    t.model.train()
    assert torch.isfinite(t.compute_loss(t.model, micro))
    student = tiny_model()
    student.resize_token_embeddings(student.get_output_embeddings().weight.shape[0] + 8)
    # a student head larger than the teacher's could sample ids the teacher has no row for
    with pytest.raises(ConfigError, match="teacher's head to cover"):
        GKDTrainer(student, teacher_model=teacher(), args=cfg(tmp_path / "s"), train_dataset=rows(4),
                   processing_class=tok)
    # and a tokenizer with more entries than the student's head has rows
    from toolkit.experimental.gkd import _compared_vocab

    with pytest.raises(ConfigError, match="the student's to cover the tokenizer"):
        _compared_vocab(student=100, teacher=120, tokenizer=110)
    assert _compared_vocab(student=100, teacher=120, tokenizer=90) == 90


def test_place_frozen_leaves_a_dispatched_model_where_it_is():
    from toolkit.core.models import place_frozen

    dispatched = tiny_model()
    dispatched.hf_device_map = {"": "cpu"}  # as accelerate's dispatch leaves it

    def moved(*a, **k):
        raise AssertionError("a dispatched model was moved")

    dispatched.to = moved
    assert place_frozen(dispatched, torch.device("cpu")) is dispatched
    plain = tiny_model()
    assert place_frozen(plain, torch.device("cpu")) is plain and plain.device.type == "cpu"


def test_fp32_lm_head_holds_inside_a_bf16_autocast_region():
    """The student's and teacher's heads are float32 under fp32_lm_head even where a wrapper's autocast is on."""
    from toolkit.experimental.gkd import _chunk_jsd

    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(5, 32, generator=g), torch.randn(300, 32, generator=g)
    th, tw = torch.randn(5, 32, generator=g), torch.randn(300, 32, generator=g)
    plain = _chunk_jsd(h, w, None, th, tw, None, 0.5, 1.0, True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        upcast = _chunk_jsd(h, w, None, th, tw, None, 0.5, 1.0, True)
        low = _chunk_jsd(h, w, None, th, tw, None, 0.5, 1.0, False)
    torch.testing.assert_close(upcast, plain, rtol=1e-6, atol=1e-6)
    assert (low - plain).abs() > 1e-4  # without upcast the caller's autocast applies


def test_a_teacher_head_too_small_is_refused_from_its_config_before_any_model_loads(tmp_path, monkeypatch):
    """It was refused only after the student (and the teacher) had loaded; now the configs are read first."""
    import toolkit.experimental.gkd as gkd

    tok = tiny_tokenizer()
    small, big = tiny_model(), tiny_model()
    big.resize_token_embeddings(big.get_output_embeddings().weight.shape[0] + 8)
    for name, m in (("teacher", small), ("student", big)):
        m.save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)

    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the heads were compared")

    monkeypatch.setattr(gkd, "load_model", no_load)
    monkeypatch.setattr("toolkit.core.grpo.load_model", no_load)
    with pytest.raises(ConfigError, match=r"teacher_model: its LM head has \d+ rows, the student's \d+"):
        GKDTrainer(str(tmp_path / "student"), teacher_model=str(tmp_path / "teacher"), args=cfg(tmp_path),
                   train_dataset=rows(4), processing_class=tok)
