"""The privacy unit, declared: ``privacy_unit="user"`` (hf_dpfilter/data/units.py).

* Clipping per unit, exactly (float64): a user's clipped vector is the sum of the per-example gradients of
  their examples (each computed alone by autograd), wherever the examples sit -- several padded rows, segments
  of several packed rows -- with its norm, for GPT-2 and a Llama-family decoder.
* User-level sensitivity at noise 0 (float32): removing one user and all their examples (spread over packed
  rows and micro-batches) moves the pre-noise aggregate by <= C, for DP-SGD and DiSK's two-point combination;
  negative control: clipping the user's examples separately moves it by about k C. The 2-process version
  (gloo) is in test_two_processes_user_sensitivity.
* Sampling: users Poisson-sampled at rate q, at most k examples of a user per step, chosen uniformly; shards
  of processes hold whole users and form one draw.
* Accounting: epsilon over users equals the accountant's for q over users and the steps; the report names the
  unit; the model card says "user-level (ε, δ)".
* Refusals, before training; DPTrainer end to end at user level (padded and packed rows).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys

import pytest
import torch
from helpers import ListDataset, PadCollator, flat, make_examples
from models import VOCAB, tiny_decoder, tiny_gpt2
from transformers import DataCollatorWithFlattening

from hf_dpfilter import DPTrainer, DPTrainingArguments, GhostClippingEngine
from hf_dpfilter.accounting.accountant import compute_epsilon
from hf_dpfilter.data.packing import PackedLayout, packed_token_mean_loss
from hf_dpfilter.data.units import (
    PrivacyUnitError,
    UnitLayout,
    UserIndex,
    UserPoissonBatchSampler,
    per_unit_loss,
    unit_micro_batches,
)
from hf_dpfilter.factory import make_private
from hf_dpfilter.losses.tasks import per_example_loss
from hf_dpfilter.optimizers.clipping import clip_factors
from hf_dpfilter.plan import PrivacyPlan
from hf_dpfilter.proofs.batch_structure import probe_batch_structure

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = {"gpt2": tiny_gpt2, "llama": lambda dtype=torch.float64: tiny_decoder("llama", dtype=dtype)}
# Llama computes its rotary tables in float32 inside a float64 model (see tests/data/test_packing.py)
TOL = {"gpt2": 1e-10, "llama": 1e-6}


def _example(length: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (length,), generator=g)
    labels = ids.clone()
    labels[0] = -100
    return {"input_ids": ids, "labels": labels}


def _per_user_reference(model, data: list[dict], params: list) -> tuple[float, torch.Tensor]:
    """The float64 per-user reference of one step at lr 1 over the 4 users of ``data``: each user's summed
    gradient (every example alone) clipped to C = the median user norm (so some users are clipped, some not);
    (C, update)."""
    per_user: dict[str, torch.Tensor] = {}
    for e in data:
        per_user[e["user"]] = per_user.get(e["user"], 0) + _alone_gradient(model, e, params)
    clip = float(torch.stack([v.norm() for v in per_user.values()]).median())
    return clip, -sum(clip_factors(v.norm().reshape(1), clip, "abadi")[0] * v for v in per_user.values()) / 4


def _alone_gradient(model, example, params):
    ids = example["input_ids"].unsqueeze(0)
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    loss = per_example_loss(logits, example["labels"].unsqueeze(0), causal_lm=True)
    grads = torch.autograd.grad(loss.sum(), params, allow_unused=True)
    return flat([torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)])


def _packed_rows(rows: list[list[dict]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of concatenated examples (equal total length), positions restarting at each example."""
    ids = torch.stack([torch.cat([e["input_ids"] for e in row]) for row in rows])
    positions = torch.stack([torch.cat([torch.arange(len(e["input_ids"])) for e in row]) for row in rows])
    labels = torch.stack([torch.cat([e["labels"] for e in row]) for row in rows])
    return ids, positions, labels


# ---------------------------------------------------------------------------------- 3: clipping per unit
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("where", ["packed_rows", "padded_rows"])
def test_unit_gradient_is_the_sum_of_its_examples_gradients_fp64(name, where):
    """Each user's vector (norm and value) = the sum of their examples' gradients, each computed alone by
    autograd; users whose examples sit in several rows (packed: segments of two rows; padded: several
    rows)."""
    model = MODELS[name]()
    model.eval()
    params = [p for p in model.parameters() if p.requires_grad]
    engine = GhostClippingEngine(model)
    if where == "packed_rows":
        # row 0: examples 0 (4 tokens), 1 (5), 2 (3); row 1: examples 3 (6), 4 (6)
        examples = [_example(n, s) for s, n in enumerate([4, 5, 3, 6, 6])]
        units = ((0, 3), (1, 2), (4,))  # user 0 in both rows; user 1 twice in row 0; user 2 alone
        ids, positions, labels = _packed_rows([examples[:3], examples[3:]])
        examples_layout = PackedLayout.from_position_ids(positions)
        layout = UnitLayout(examples_layout.spans, 2, 12, units=units)
        inputs = {"input_ids": ids, "position_ids": positions, "use_cache": False}

        def losses_of(logits):
            return packed_token_mean_loss(logits, labels, examples_layout, shift=True)
    else:
        examples = [_example(n, 10 + s) for s, n in enumerate([4, 7, 3, 6, 5])]
        units = ((0, 3), (1, 2, 4))
        batch = PadCollator(0)([examples[i] for i in range(5)])
        labels = batch.pop("labels")
        layout = UnitLayout(tuple((r, 0, labels.shape[1]) for r in range(5)), 5, labels.shape[1], units=units,
                            packed_rows=False)
        inputs = batch

        def losses_of(logits):
            return per_example_loss(logits, labels, causal_lm=True)

    def loss_fn():
        return losses_of(model(**inputs).logits)

    with engine.packed(layout), engine.record(batch_size=layout.num_examples):
        losses = per_unit_loss(loss_fn, layout)()
    with engine.packed(layout):
        grads = engine.per_example_gradients(losses)
    assert losses.shape == (len(units),)
    norms = grads.norms()
    for u, members in enumerate(units):
        reference = sum(_alone_gradient(model, examples[e], params) for e in members)
        scale = reference.norm()
        assert abs(norms[u] - scale) <= TOL[name] * scale, (name, where, u)
        separately = sum(_alone_gradient(model, examples[e], params).norm() for e in members)
        if len(members) > 1:  # the cross terms matter: not the norms of the examples added up
            assert abs(separately - scale) > 1e-3 * scale
        indicator = torch.zeros(len(units), dtype=torch.float64)
        indicator[u] = 1.0
        got = flat([grads.weighted_sum(indicator)[p] for p in params])
        assert (got - reference).norm() <= TOL[name] * scale, (name, where, u)


# ---------------------------------------------------------------------------------- 3: sensitivity
def _users(n_users: int, per_user: list[int], seed: int) -> tuple[list[dict], list[int]]:
    examples, users = [], []
    g = torch.Generator().manual_seed(seed)
    for u in range(n_users):
        for _ in range(per_user[u]):
            length = int(torch.randint(3, 9, (1,), generator=g))
            examples.append(_example(length, int(torch.randint(10**6, (1,), generator=g))))
            users.append(u)
    return examples, users


def _extreme_user(k: int) -> list[dict]:
    """k near-copies of one long example: their gradients point the same way, so clipping them separately adds
    up to about k C, while the user's one clipped vector has norm C."""
    base = _example(10, 4242)
    out = []
    for j in range(k):
        e = {"input_ids": base["input_ids"].clone(), "labels": base["labels"].clone()}
        e["input_ids"][-1] = 3 + j
        out.append(e)
    return out


def accumulate_packed_users(engine, optimizer, examples, units, micro, per_example=False) -> int:
    """One step's accumulation: the examples packed in rows (DataCollatorWithFlattening), micro-batches cut at
    unit boundaries, one clipped vector per unit (``per_example``: per example, the negative control). Returns
    the number of micro-batches. Shared with the two-process worker."""
    collator = DataCollatorWithFlattening()
    structure = probe_batch_structure(collator, examples[0], examples[min(1, len(examples) - 1)])
    batch = collator(examples)
    labels = batch.pop("labels")
    cut = unit_micro_batches(structure, lambda i, lab, n, size: structure.micro_batches(i, lab, size, n),
                             batch,
                             labels, units, micro)
    for inputs, micro_labels, layout in cut:
        def loss_fn(values, inputs=inputs, micro_labels=micro_labels, layout=layout):
            logits = engine.call_model(values, input_ids=inputs["input_ids"],
                                       position_ids=inputs["position_ids"],
                                       use_cache=False).logits
            return packed_token_mean_loss(logits, micro_labels, layout.examples_layout, shift=True) * 50.0

        use = layout.examples_layout if per_example else layout
        fn = loss_fn if per_example else per_unit_loss(loss_fn, layout)
        with engine.packed(use):
            optimizer.accumulate(engine, fn, batch_size=use.num_examples)
    return len(cut)


def _aggregate(examples, users, clip, method="dpsgd", per_example=False, micro=3, warmup=None):
    """The pre-noise aggregate of one step (float32 GPT-2, noise 0) over packed micro-batches cut at user
    boundaries; ``per_example``: the negative control, each example clipped separately."""
    model = tiny_gpt2(dtype=torch.float32)
    method_args = {"kappa": 0.7, "gamma": 0.5} if method == "disk" else {}
    plan = PrivacyPlan.for_optimizer(method=method, method_args=method_args, noise_multiplier=0.0,
                                     per_sample_max_grad_norm=clip, expected_batch_size=4.0, sample_rate=0.5, seed=0)
    engine, optimizer, _ = make_private(plan, model, base=torch.optim.SGD, lr=0.5,
                                        verify_first_backward=False)

    def one_step(examples, users):
        order = sorted(range(len(examples)), key=lambda i: users[i])
        return accumulate_packed_users(engine, optimizer, [examples[i] for i in order],
                                       torch.tensor([users[i] for i in order]), micro, per_example)

    if warmup is not None:  # a first step (the same for D and D'): DiSK's second step evaluates two points
        one_step(*warmup)
        optimizer.step()
        optimizer.zero_grad()
    cuts = one_step(examples, users)
    local = optimizer._local_sums()
    return flat([local[p].detach().double() for p in optimizer.params]), optimizer.sensitivity(), cuts


@pytest.mark.parametrize("method", ["dpsgd", "disk"])
def test_removing_one_user_moves_the_aggregate_by_at_most_c(method):
    k, clip = 3, 0.5
    others, users = _users(5, [1, 3, 2, 4, 1], seed=1)
    victim = _extreme_user(k)
    # the victim (user 9) between the others: with micro-batches of 3 examples its examples share a
    # micro-batch with nobody else's split in two, and the users before and after it land in other
    # micro-batches
    d_examples, d_users = others + victim, users + [9] * k
    warmup = (others, users) if method == "disk" else None
    with_user, delta, cuts = _aggregate(d_examples, d_users, clip, method, warmup=warmup)
    without, delta_without, _ = _aggregate(others, users, clip, method, warmup=warmup)
    assert delta == delta_without == clip and cuts >= 3
    moved = float((with_user - without).norm())
    assert moved <= delta * (1 + 1e-5), f"{method}: the aggregate moved by {moved:.6g} > C = {delta}"
    assert moved > 0.9 * delta  # the victim is clipped at C
    # negative control: clipped example by example, the same user moves it by about k C
    with_sep, _, _ = _aggregate(d_examples, d_users, clip, method, per_example=True, warmup=warmup)
    without_sep, _, _ = _aggregate(others, users, clip, method, per_example=True, warmup=warmup)
    moved_sep = float((with_sep - without_sep).norm())
    assert moved_sep > 2.5 * delta, f"{method}: per-example clipping moved it by only {moved_sep:.4g}"
    assert moved_sep <= k * delta * (1 + 1e-5)


def test_micro_batches_hold_whole_users():
    examples, users = _users(6, [2, 4, 1, 1, 3, 2], seed=3)
    collator = DataCollatorWithFlattening()
    batch = collator(examples)
    labels = batch.pop("labels")
    structure = probe_batch_structure(collator, examples[0], examples[1])
    cut = unit_micro_batches(structure, lambda i, lab, n, size: structure.micro_batches(i, lab, size, n),
                             batch,
                             labels, torch.tensor(users), 3)
    seen = []
    for inputs, _labels, layout in cut:
        assert inputs["input_ids"].shape[0] == 1  # re-packed into one row
        sizes = [len(u) for u in layout.units]
        assert sum(sizes) <= 3 or len(sizes) == 1  # up to 3 examples, or one user with more
        seen += [len(u) for u in layout.units]
    assert seen == [2, 4, 1, 1, 3, 2]  # every user whole, in order
    with pytest.raises(PrivacyUnitError, match="not consecutive"):
        unit_micro_batches(structure, lambda i, lab, n, size: structure.micro_batches(i, lab, size, n), batch,
                           labels,
                           torch.tensor([0, 1, 0] + users[3:]), 3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_user_sensitivity(tmp_path):
    """2 gloo processes, users assigned whole to processes, micro-batches cut at user boundaries: removing one
    user moves the all-reduced pre-noise aggregate by <= C; clipping its examples separately by about k C."""
    # the worker imports this checkout's hf_dpfilter (not another installed copy)
    path = os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=path)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
           "127.0.0.1",
           "--master_port", str(_free_port()), os.path.join(HERE, "user_unit_worker.py"), str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    clip, k = result["clip"], result["k"]
    assert result["whole_users_per_process"]
    assert result["victim_ranks"] == 1  # the removed user's examples on one process only
    assert result["moved_unit"] <= clip * (1 + 1e-5), result
    assert result["moved_unit"] > 0.9 * clip
    assert 2.5 * clip < result["moved_per_example"] <= k * clip * (1 + 1e-5), result
    # the DPTrainer at user level: two processes (users split between them) end where one process does
    from user_unit_worker import train_user_level

    one = train_user_level(str(tmp_path / "one"))
    for rank in range(2):
        two = torch.load(tmp_path / f"trainer_rank{rank}.pt")
        diff = max(float((two[n] - one[n]).abs().max()) for n in one)
        assert diff <= 1e-10, f"rank {rank} differs from the one-process run by {diff:.2e}"
    initial = dict(tiny_gpt2().named_parameters())
    assert max(float((one[n] - initial[n]).abs().max()) for n in one) > 1e-4  # the step moved the model


# ---------------------------------------------------------------------------------- 2: sampling
def test_users_are_poisson_sampled_at_q_and_at_most_k_examples_enter_a_step():
    per_user = [1, 2, 5, 8, 3] * 8  # 40 users, 152 examples
    unit_of = [u for u, n in enumerate(per_user) for _ in range(n)]
    index = UserIndex.from_dataset([{"user": f"u{u}"} for u in unit_of], "user")
    assert index.num_users == 40
    q, k, steps = 0.15, 3, 2000
    sampler = UserPoissonBatchSampler(index, q, k, steps, seed=5)
    counts = torch.zeros(40)
    picked = torch.zeros(len(unit_of))
    sizes = []
    for batch in sampler:
        step_users = [unit_of[i] for i in batch]
        # each user's examples consecutive, at most k, no example twice
        assert len(set(batch)) == len(batch)
        runs = [u for j, u in enumerate(step_users) if j == 0 or step_users[j - 1] != u]
        assert len(runs) == len(set(runs))
        for u in set(step_users):
            assert step_users.count(u) == min(k, per_user[u])
            counts[u] += 1
        for i in batch:
            picked[i] += 1
        sizes.append(len(set(step_users)))
    # each user in a step with probability q (binomial, 5 sigma)
    sd = (steps * q * (1 - q)) ** 0.5
    assert ((counts - steps * q).abs() <= 5 * sd).all(), counts
    # the number of users per step: mean N q and variance N q (1 - q)
    sizes = torch.tensor(sizes, dtype=torch.float64)
    assert abs(sizes.mean() - 40 * q) <= 5 * (40 * q * (1 - q) / steps) ** 0.5
    assert abs(sizes.var() / (40 * q * (1 - q)) - 1) < 0.15
    # a sampled user with n > k examples: each of them chosen with probability k / n (uniform without
    # replacement)
    for u in range(40):
        members = [i for i, v in enumerate(unit_of) if v == u]
        if per_user[u] > k:
            p = k / per_user[u]
            n = counts[u]
            for i in members:
                assert abs(picked[i] - n * p) <= 5 * (n * p * (1 - p)) ** 0.5, (u, i)
    # the secure source too: at most k per user, whole users
    for batch in UserPoissonBatchSampler(index, 0.5, k, 20, secure=True):
        users_in = [unit_of[i] for i in batch]
        assert all(users_in.count(u) == min(k, per_user[u]) for u in set(users_in))


@pytest.mark.parametrize("secure", [False, True])
def test_process_shards_hold_whole_users_and_form_one_draw(secure):
    per_user = [3, 1, 4, 1, 5, 9, 2, 6]
    unit_of = [u for u, n in enumerate(per_user) for _ in range(n)]
    index = UserIndex.from_dataset([{"user": u} for u in unit_of], "user")
    world = 2
    shards = [list(UserPoissonBatchSampler(index, 0.5, 2, 30, seed=3, rank=r, world_size=world,
                                           secure=secure))
              for r in range(world)]
    single = list(UserPoissonBatchSampler(index, 0.5, 2, 30, seed=3))
    for step in range(30):
        for r in range(world):
            assert all(unit_of[i] % world == r for i in shards[r][step])  # user u on process u mod world only
        if not secure:  # one draw: the union of the shards is the single-process batch
            assert sorted(shards[0][step] + shards[1][step]) == sorted(single[step])


def test_a_fresh_choice_of_examples_each_step():
    index = UserIndex.from_dataset([{"user": 0}] * 10, "user")
    batches = {tuple(b) for b in UserPoissonBatchSampler(index, 1.0, 2, 50, seed=1)}
    assert len(batches) > 10  # not the same k examples every step


# ---------------------------------------------------------------------------------- trainer, accounting
def _user_data(n_users=4, per_user=(3, 1, 2, 2), seed=3):
    examples = make_examples(sum(per_user), VOCAB, causal=True, seed=seed)
    users = [u for u, n in enumerate(per_user[:n_users]) for _ in range(n)]
    # interleave the users in the data set: the sampler groups them, not the data set order
    order = sorted(range(len(examples)), key=lambda i: (i % 3, i))
    data = []
    for i in order:
        data.append({**examples[i], "user": f"user-{users[i]}"})
    return data


def _args(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path), dp_method="dpsgd", noise_multiplier=0.0, per_sample_max_grad_norm=1.0,
        logical_batch_size=4, per_device_train_batch_size=2, max_steps=1, optim="sgd", learning_rate=1.0,
        lr_scheduler_type="constant", weight_decay=0.0, report_to=[], use_cpu=True, save_strategy="no",
        remove_unused_columns=False, dp_seed=0, privacy_unit="user", user_id_column="user",
        max_examples_per_user=3,
    )
    base.update(kw)
    return DPTrainingArguments(**base)


@pytest.mark.parametrize("collator", ["padded", "packed"])
def test_dptrainer_user_level_step_equals_the_per_user_reference(collator, tmp_path):
    """One DPTrainer step at user level (q = 1, k >= every user's count, noise 0, micro-batches of 2
    examples):
    the update is -(lr / B) sum_u clip_C(sum of u's per-example gradients), B = the expected users per
    step."""
    model = tiny_gpt2()
    model.eval()
    data = _user_data()
    params = [p for p in model.parameters() if p.requires_grad]
    per_user: dict[str, torch.Tensor] = {}
    for e in data:
        g = _alone_gradient(model, e, params)
        per_user[e["user"]] = per_user.get(e["user"], 0) + g
    norms = torch.stack([v.norm() for v in per_user.values()])
    clip = float(norms.median())  # some users clipped, some not
    expected = -sum(clip_factors(v.norm().reshape(1), clip, "abadi")[0] * v for v in per_user.values()) / 4
    data_collator = PadCollator(0) if collator == "padded" else DataCollatorWithFlattening()
    trainer = DPTrainer(model=model, args=_args(tmp_path, per_sample_max_grad_norm=clip),
                        train_dataset=ListDataset(data), data_collator=data_collator)
    assert trainer.num_train_examples == 4  # the plan is over users
    before = [p.detach().clone() for p in params]
    trainer.train()
    got = flat([p.detach() - b for p, b in zip(params, before)])
    assert ((got - expected).norm() / expected.norm()).item() <= 1e-10
    report = trainer.privacy_report()
    assert report["privacy_unit"] == "user" and report["num_units"] == 4 and report["unit_sample_rate"] == 1.0
    assert report["max_examples_per_user"] == 3 and "one user" in report["neighbouring_relation"]


def test_fp16_loss_scaling_at_user_level_equals_the_per_user_reference(tmp_path, caplog):
    """fp16=True at user level: the scale S = 2^12 multiplies each user's summed loss and is divided out
    exactly (float64 model: the update equals the float64 per-user reference), the step clipping each user to
    C; the start report's user line names public quantities only."""
    model = tiny_gpt2()
    model.eval()
    data = _user_data()
    params = [p for p in model.parameters() if p.requires_grad]
    clip, expected = _per_user_reference(model, data, params)
    trainer = DPTrainer(model=model, args=_args(tmp_path, per_sample_max_grad_norm=clip, fp16=True,
                                                dp_fp16_loss_scale=2.0**12),
                        train_dataset=ListDataset(data), data_collator=PadCollator(0))
    before = [p.detach().clone() for p in params]
    with caplog.at_level(logging.INFO, logger="hf_dpfilter"):
        trainer.train()
    # the start report: public quantities only, not the examples (8) nor the largest user's count (3), nor the
    # first-step check's measured errors (rounding of the first examples' gradients)
    started = "\n".join(r.getMessage() for r in caplog.records)
    assert "N = 4 users" in started and "check passed" in started, started
    assert "8 examples" not in started and "largest" not in started and "relative errors" not in started, started
    assert trainer.engine.loss_scale == 2.0**12 and trainer.dp_optimizer.loss_scaler.skipped_steps == 0
    got = flat([p.detach() - b for p, b in zip(params, before)])
    assert ((got - expected).norm() / expected.norm()).item() <= 1e-10


def test_epsilon_over_users_is_the_accountants_and_the_card_says_user_level(tmp_path):
    data = _user_data(per_user=(3, 1, 2, 2))  # 4 users
    args = _args(tmp_path, noise_multiplier=1.3, logical_batch_size=2, max_steps=3, max_examples_per_user=2)
    trainer = DPTrainer(model=tiny_gpt2(dtype=torch.float32), args=args, train_dataset=ListDataset(data),
                        data_collator=DataCollatorWithFlattening())
    assert trainer.sample_rate == 0.5  # q = expected users per step / number of users
    trainer.train()
    report = trainer.privacy_report()
    assert report["steps"] == 3
    assert report["epsilon"] == pytest.approx(compute_epsilon([(1.3, 0.5, 3)], report["delta"], "prv"),
                                              rel=1e-9)
    # the example-level plan of the same data would have q = 2 / 8: a different (smaller) epsilon
    assert compute_epsilon([(1.3, 0.25, 3)], report["delta"], "prv") < report["epsilon"]
    trainer.create_model_card(model_name="tiny")
    card = (tmp_path / "README.md").read_text()
    assert "user-level (ε, δ)" in card and "number of units: 4" in card
    assert "Noise multiplier σ: 1.3; accountant: prv; expected logical (Poisson) batch: 2 users" in card
    # C and delta under the names a user sets them by
    assert f"clipping norm C per user: {report['per_sample_max_grad_norm']}" in card
    assert f"= ({report['epsilon']:.4g}, {report['delta']:.3g}) differential privacy" in card


@pytest.mark.parametrize("method", ["disk", "pmlf", "dicesgd", "diff2"])
def test_other_methods_train_at_user_level(method, tmp_path):
    data = _user_data(per_user=(3, 1, 2, 2))
    extra = {"dp_method_args": {"difference_max_grad_norm": 5.0}} if method == "diff2" else {}
    args = _args(tmp_path, dp_method=method, noise_multiplier=0.5, logical_batch_size=2, max_steps=2, **extra)
    trainer = DPTrainer(model=tiny_gpt2(dtype=torch.float32), args=args, train_dataset=ListDataset(data),
                        data_collator=DataCollatorWithFlattening())
    trainer.train()
    report = trainer.privacy_report()
    assert trainer.accountant.steps == 2 and report["privacy_unit"] == "user"
    assert "one user (all of their examples)" in report["neighbouring_relation"], report["neighbouring_relation"]


def test_datasets_dataset_with_a_string_user_column(tmp_path):
    """The Trainer drops the user column before the collator (remove_unused_columns=True); the users were read
    from it when the DPTrainer was created."""
    import datasets

    rows = [{"input_ids": e["input_ids"].tolist(), "labels": e["labels"].tolist(), "author": e["user"]}
            for e in _user_data()]
    table = datasets.Dataset.from_list(rows)

    def collate(batch):
        return PadCollator(0)([{k: torch.tensor(v) for k, v in b.items()} for b in batch])

    args = _args(tmp_path, user_id_column="author", remove_unused_columns=True, noise_multiplier=1.0,
                 max_steps=2)
    trainer = DPTrainer(model=tiny_gpt2(dtype=torch.float32), args=args, train_dataset=table,
                        data_collator=collate)
    assert trainer.num_train_examples == 4
    trainer.train()
    assert trainer.accountant.steps == 2


def test_a_sequence_level_head_is_refused_at_user_level(tmp_path):
    from models import tiny_roberta

    data = [{**e, "user": i % 2} for i, e in enumerate(make_examples(6, VOCAB, causal=False, seed=1))]
    trainer = DPTrainer(model=tiny_roberta(), args=_args(tmp_path, logical_batch_size=2),
                        train_dataset=ListDataset(data),
                        data_collator=PadCollator(1))
    with pytest.raises(PrivacyUnitError, match="one label per token"):
        trainer.train()
    assert trainer.accountant.steps == 0


# ---------------------------------------------------------------------------------- 1: refusals
@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(user_id_column=None), "needs user_id_column"),
        (dict(max_examples_per_user=0), r"max_examples_per_user \(k\) >= 1"),
        (dict(max_examples_per_user=None), r"max_examples_per_user \(k\) >= 1"),
        (dict(poisson_sampling=False), "poisson_sampling=False"),
        (dict(privacy_unit="person"), "privacy_unit must be one of"),
        (dict(privacy_unit="example"), "with privacy_unit='example'"),
    ],
)
def test_bad_unit_declarations_are_refused_with_the_fix(fields, match, tmp_path):
    with pytest.raises(PrivacyUnitError, match=match):
        _args(tmp_path, **fields)


def test_missing_users_or_too_large_a_user_batch_are_refused_at_creation(tmp_path):
    data = [{k: v for k, v in e.items() if k != "user"} for e in _user_data()]
    with pytest.raises(PrivacyUnitError, match="user_id_column='user' is not in example 0"):
        DPTrainer(model=tiny_gpt2(), args=_args(tmp_path), train_dataset=ListDataset(data),
                  data_collator=PadCollator(0))
    import datasets

    table = datasets.Dataset.from_list([{"input_ids": [5, 6, 7], "labels": [5, 6, 7], "author": "a"}])
    with pytest.raises(PrivacyUnitError, match="not a column of the training set"):
        DPTrainer(model=tiny_gpt2(), args=_args(tmp_path), train_dataset=table, data_collator=PadCollator(0))
    with pytest.raises(PrivacyUnitError, match="the logical batch counts users"):
        DPTrainer(model=tiny_gpt2(), args=_args(tmp_path, logical_batch_size=5),
                  train_dataset=ListDataset(_user_data()),
                  data_collator=PadCollator(0))
    data = _user_data()
    data[2] = {**data[2], "user": None}
    with pytest.raises(PrivacyUnitError, match=r"no user for 1 example\(s\), first at row 2"):
        DPTrainer(model=tiny_gpt2(), args=_args(tmp_path), train_dataset=ListDataset(data),
                  data_collator=PadCollator(0))
