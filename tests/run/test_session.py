"""What a run publishes, and how resumes and processes are accounted (the run).

* The files a default run writes (training_args.bin, the args JSON, trainer_state.json, optimizer.pt,
  privacy_ledger.json, TensorBoard's event files, the model card) hold no DP seed, no generator state, no
  training loss, no exact FLOP or token count and no count of zeroed examples; ``dp_log_nonprivate_metrics``
  publishes the statistics, knowingly.
* Rollback: two branches resumed from one checkpoint draw different noise, and the ledger counts both; a
  ``target_epsilon`` run whose ledger already holds the other branch is refused before training.
* The ledger keeps every earlier entry across resumes (and a fresh run keeps the earlier run's ledger).
* Several processes without one process group are refused before training.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ListDataset, PadCollator, make_examples
from models import VOCAB, tiny_roberta
from transformers import TrainerCallback

from hf_dpfilter import DPTrainer, DPTrainingArguments
from hf_dpfilter.accounting.accountant import compute_epsilon
from hf_dpfilter.distributed.processes import check_one_dp_run, launcher_world_size

N = 16
SEED = 918273645  # a DP seed no file may contain


def _args(out, max_steps: int = 4, **extra) -> DPTrainingArguments:
    base = dict(
        output_dir=str(out), noise_multiplier=0.8, per_sample_max_grad_norm=0.5, logical_batch_size=4,
        per_device_train_batch_size=4, max_steps=max_steps, optim="adamw_torch", learning_rate=0.01,
        lr_scheduler_type="constant", report_to=[], use_cpu=True, save_strategy="steps", save_steps=2,
        logging_steps=1, accountant="rdp", remove_unused_columns=False, dp_seed=SEED, seed=7,
    )
    base.update(extra)
    return DPTrainingArguments(**base)


def _trainer(out, max_steps: int = 4, callbacks=(), cls=DPTrainer, **extra) -> DPTrainer:
    return cls(model=tiny_roberta(), args=_args(out, max_steps, **extra),
               train_dataset=ListDataset(make_examples(N, VOCAB, causal=False, seed=11)),
               data_collator=PadCollator(1), callbacks=list(callbacks))


class _Logger(TrainerCallback):
    """What a ``report_to`` logger receives: the args JSON at the start (TensorBoard's "args" text, W&B's and
    MLflow's config come from the same ``to_dict``) and every log line."""

    def __init__(self) -> None:
        self.args_json, self.sanitized, self.logs = None, None, []

    def on_train_begin(self, args, state, control, **kwargs):
        self.args_json, self.sanitized = args.to_json_string(), args.to_sanitized_dict()

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


# ------------------------------------------------------------------------------ the DP seed in the args
def test_dp_seed_is_in_no_serialisation_of_the_args():
    args = _args("unused")
    assert args.dp_seed == SEED  # kept in memory for the plan
    for text in (args.to_json_string(), json.dumps(args.to_sanitized_dict()), str(args), repr(args)):
        assert str(SEED) not in text and "dp_seed" not in text
    assert "dp_seed" not in args.to_dict()
    assert pickle.loads(pickle.dumps(args)).dp_seed is None  # training_args.bin is a pickle
    assert copy.copy(args).dp_seed is None
    assert copy.deepcopy(args).dp_seed == SEED  # an in-memory copy keeps it


def _walk(obj, path=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk(v, f"{path}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _walk(v, f"{path}[{i}]")
    else:
        yield path, obj


def test_default_run_publishes_no_seed_generator_state_loss_or_exact_counts(tmp_path):
    logger = _Logger()
    trainer = _trainer(tmp_path, callbacks=[logger])
    trainer.train()
    trainer.create_model_card(model_name="tiny")
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    names = {p.name for p in files}
    assert {"training_args.bin", "trainer_state.json", "optimizer.pt", "privacy_ledger.json",
            "README.md"} <= names
    for path in files:  # no file holds the seed in decimal (JSON, model card, logs)
        assert str(SEED).encode() not in path.read_bytes(), path
    # training_args.bin (pushed to the Hub with the model)
    for path in tmp_path.rglob("training_args.bin"):
        assert torch.load(path, weights_only=False).dp_seed is None
    # optimizer.pt (uploaded with hub_strategy="checkpoint"): no seed, no generator state
    for path in tmp_path.rglob("optimizer.pt"):
        state = torch.load(path, weights_only=False)
        assert "seed" not in state["dp"] and "generators" not in state["dp"]
        generator_size = torch.Generator().get_state().numel()
        for where, value in _walk(state):
            assert not (isinstance(value, torch.Tensor) and value.dtype == torch.uint8
                        and value.numel() == generator_size), f"a generator state at {where}"
    # trainer_state.json, the loggers and the model card: no training loss, no FLOP or token count
    for path in tmp_path.rglob("trainer_state.json"):
        state = json.loads(path.read_text())
        assert state["log_history"], "the log lines are still written (epsilon, learning rate)"
        for entry in state["log_history"]:
            assert "loss" not in entry and "train_loss" not in entry, entry
        assert state["total_flos"] == 0 and state["num_input_tokens_seen"] == 0
    assert all("loss" not in line and "train_loss" not in line for line in logger.logs)
    assert any("epsilon" in line for line in logger.logs)
    assert str(SEED) not in logger.args_json and "dp_seed" not in logger.sanitized
    card = (tmp_path / "README.md").read_text()
    assert "Training Loss" not in card
    # the ledger: no count of zeroed examples
    ledger = json.loads((tmp_path / "privacy_ledger.json").read_text())
    assert "nonfinite_examples_zeroed" not in ledger


def test_tensorboard_event_files_hold_no_seed_nor_loss(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _trainer(tmp_path, report_to=["tensorboard"]).train()
    events = list(tmp_path.rglob("*tfevents*"))
    assert events
    for path in events:
        assert str(SEED).encode() not in path.read_bytes()
        accumulator = EventAccumulator(str(path))
        accumulator.Reload()
        assert not [tag for tag in accumulator.Tags()["scalars"] if tag.endswith("loss")]


def test_nonprivate_statistics_only_with_the_opt_in(tmp_path):
    logger = _Logger()
    trainer = _trainer(tmp_path, callbacks=[logger], dp_log_nonprivate_metrics=True,
                       include_num_input_tokens_seen="all")
    out = trainer.train()
    state = json.loads((tmp_path / "checkpoint-4" / "trainer_state.json").read_text())
    assert any("loss" in entry for entry in state["log_history"])
    assert state["total_flos"] > 0 and state["num_input_tokens_seen"] > 0
    assert "train_loss" in out.metrics
    assert "nonfinite_examples_zeroed" in json.loads((tmp_path / "privacy_ledger.json").read_text())
    field = DPTrainingArguments.__dataclass_fields__["dp_log_nonprivate_metrics"]
    assert field.default is False and "NON-PRIVATE" in field.metadata["help"]


def test_include_num_input_tokens_seen_is_refused_without_the_opt_in(tmp_path):
    for value in ("all", "non_padding", True):
        with pytest.raises(ValueError, match="dp_log_nonprivate_metrics"):
            _trainer(tmp_path, include_num_input_tokens_seen=value)


def test_default_train_metrics_hold_no_loss(tmp_path):
    out = _trainer(tmp_path, max_steps=2, save_strategy="no").train()
    assert "train_loss" not in out.metrics  # what scripts save with trainer.save_metrics


# ------------------------------------------------------------------------------ rollback and the ledger
class _NoiseRecording(DPTrainer):
    """Records every noise draw of the DP optimizer."""

    draws: list[torch.Tensor]

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        self.draws = []
        original = optimizer.gaussian_noise

        def recording(shape, std, like):
            noise = original(shape, std, like)
            self.draws.append(noise.detach().clone())
            return noise

        optimizer.gaussian_noise = recording
        return optimizer


def test_two_branches_from_one_checkpoint_draw_fresh_noise_and_the_ledger_counts_both(tmp_path):
    first = _trainer(tmp_path, max_steps=6, cls=_NoiseRecording)
    first.train()
    checkpoint = str(tmp_path / "checkpoint-2")
    branches = []
    for _ in range(2):
        branch = _trainer(tmp_path, max_steps=6, cls=_NoiseRecording)
        branch.train(resume_from_checkpoint=checkpoint)
        branches.append(branch)
    # the noise of step 3 on each branch: fresh, never the first run's nor the other branch's
    step3 = [first.draws[2], branches[0].draws[0], branches[1].draws[0]]
    for i in range(3):
        for j in range(i + 1, 3):
            assert not torch.allclose(step3[i], step3[j]), (i, j)
    ledger = json.loads((tmp_path / "privacy_ledger.json").read_text())
    assert ledger["steps"] == 6 + 4 + 4  # every step released from this output_dir's model
    assert [s["resumed_from_step"] for s in ledger["sessions"]] == [None, 2, 2]
    assert [s["steps_released"] for s in ledger["sessions"]] == [6, 4, 4]
    last = branches[1]
    assert last.privacy_report()["steps"] == 14
    expected = compute_epsilon([(0.8, 0.25, 14)], last.delta, "rdp")
    assert last.current_epsilon() == pytest.approx(expected, rel=1e-9)
    assert ledger["epsilon"] == pytest.approx(expected, rel=1e-9)


def test_ledger_keeps_earlier_entries_on_resume(tmp_path):
    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                control.should_training_stop = True

    _trainer(tmp_path, max_steps=4, callbacks=[Stop()]).train()
    before = json.loads((tmp_path / "privacy_ledger.json").read_text())
    assert before["steps"] == 2 and len(before["sessions"]) == 1
    trainer = _trainer(tmp_path, max_steps=4)
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    after = json.loads((tmp_path / "privacy_ledger.json").read_text())
    assert after["run_id"] == before["run_id"]
    assert after["sessions"][0] == before["sessions"][0]  # the earlier entry, unchanged
    assert after["steps"] == 4 and [s["steps_released"] for s in after["sessions"]] == [2, 2]
    assert after["accountant"]["history"] == trainer.accountant.state_dict()["history"]


def test_resume_counts_a_ledger_of_an_earlier_version(tmp_path):
    """A ledger without run_id (written before this format) met on a resume counts as the run's own
    history."""
    _trainer(tmp_path, max_steps=4).train()
    path = tmp_path / "privacy_ledger.json"
    old = {k: v for k,
           v in json.loads(path.read_text()).items() if k not in ("run_id", "sessions", "earlier_runs")}
    path.write_text(json.dumps(old))
    trainer = _trainer(tmp_path, max_steps=4)
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert trainer.accountant.steps == 4 + 2
    assert json.loads(path.read_text())["steps"] == 6


def test_fresh_run_keeps_the_earlier_runs_ledger(tmp_path):
    _trainer(tmp_path, max_steps=2, save_strategy="no").train()
    earlier = json.loads((tmp_path / "privacy_ledger.json").read_text())
    _trainer(tmp_path, max_steps=3, save_strategy="no").train()
    ledger = json.loads((tmp_path / "privacy_ledger.json").read_text())
    assert ledger["steps"] == 3 and ledger["run_id"] != earlier["run_id"]
    assert [run["run_id"] for run in ledger["earlier_runs"]] == [earlier["run_id"]]
    assert ledger["earlier_runs"][0]["steps"] == 2


def test_a_new_run_in_a_used_output_dir_says_the_earlier_ledger_is_kept(tmp_path, caplog):
    _trainer(tmp_path, max_steps=2, save_strategy="no").train()
    with caplog.at_level("WARNING", logger="hf_dpfilter.run.ledger"):
        _trainer(tmp_path, max_steps=2, save_strategy="no").train()
    said = [r.getMessage() for r in caplog.records if r.name == "hf_dpfilter.run.ledger"]
    assert len(said) == 1 and "already holds the privacy ledger of another run (2 steps)" in said[0], said
    assert "new output_dir per run" in said[0]


def test_train_ends_with_the_privacy_spent(tmp_path, caplog):
    trainer = _trainer(tmp_path, max_steps=2, save_strategy="no")
    with caplog.at_level("WARNING", logger="hf_dpfilter.run.session"):
        trainer.train()
    said = [r.getMessage() for r in caplog.records if "Privacy spent" in r.getMessage()]
    report = trainer.privacy_report()
    assert len(said) == 1, said
    assert f"epsilon = {report['epsilon']:.4g} at delta = {report['delta']:.3g}" in said[0]
    assert "over 2 of 2 planned steps" in said[0] and "add/remove one example" in said[0]


def test_rollback_beyond_the_target_epsilon_is_refused_before_training(tmp_path):
    common = dict(noise_multiplier=None, target_epsilon=4.0, target_delta=1e-3)
    _trainer(tmp_path, max_steps=6, **common).train()
    ledger_before = (tmp_path / "privacy_ledger.json").read_text()
    trainer = _trainer(tmp_path, max_steps=6, **common)
    with pytest.raises(ValueError, match="Cannot resume from the checkpoint at step 2.*privacy ledger"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert trainer.dp_optimizer.dp_steps == 2  # nothing ran
    assert (tmp_path / "privacy_ledger.json").read_text() == ledger_before
    # resuming from the newest checkpoint is fine (nothing left to run, nothing refused)
    _trainer(tmp_path, max_steps=6, **common).train(resume_from_checkpoint=str(tmp_path / "checkpoint-6"))


def test_optimizer_state_dict_holds_no_seed_and_a_load_draws_fresh_noise():
    from hf_dpfilter import make_dp_optimizer

    def optimizer():
        p = torch.nn.Parameter(torch.zeros(64))
        return make_dp_optimizer([p], torch.optim.SGD, lr=1.0, noise_multiplier=1.0, per_sample_max_grad_norm=1.0,
                                 expected_batch_size=1.0, sample_rate=0.1, seed=SEED), p

    def noise_of_one_step(opt, p) -> torch.Tensor:
        before = p.detach().clone()
        opt.accumulate(None, None, batch_size=0)  # an empty batch: the update is minus the noise (lr 1, B 1)
        opt.step()
        return before - p.detach()

    a, pa = optimizer()
    noise_of_one_step(a, pa)
    state = a.state_dict()
    assert "seed" not in state["dp"] and "generators" not in state["dp"]
    noises = []
    for _ in range(2):  # two branches loaded from the same state
        b, pb = optimizer()
        b.load_state_dict(copy.deepcopy(state))
        noises.append(noise_of_one_step(b, pb))
    noises.append(noise_of_one_step(a, pa))  # and the original's continuation
    for i in range(3):
        for j in range(i + 1, 3):
            assert not torch.allclose(noises[i], noises[j]), (i, j)


# ------------------------------------------------------------------------------ processes
@pytest.mark.parametrize("env", [
    {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"},
    {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"},
    {"LOCAL_WORLD_SIZE": "2"},
    {"RANK": "1"},
    {"OMPI_COMM_WORLD_SIZE": "4"},
])
def test_launcher_processes_without_a_process_group_are_refused(env):
    assert launcher_world_size(env) > 1
    with pytest.raises(RuntimeError, match="no torch.distributed process group joins them.*use_cpu=True"):
        check_one_dp_run(1, env=env, group_size=None)
    # torchrun on a machine without a GPU: a group exists, but the Trainer runs as one process
    with pytest.raises(RuntimeError, match="the Trainer runs as 1 process.*use_cpu=True"):
        check_one_dp_run(1, env=env, group_size=launcher_world_size(env))


def test_custom_loop_optimizer_under_a_launcher_without_a_group_is_refused(monkeypatch):
    from hf_dpfilter import make_dp_optimizer

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(RuntimeError, match="separate DP run"):
        make_dp_optimizer([torch.nn.Parameter(torch.zeros(2))], torch.optim.SGD, lr=0.1, noise_multiplier=1.0,
                          per_sample_max_grad_norm=1.0, expected_batch_size=4, sample_rate=0.1)


def test_process_group_must_match_the_trainer_and_the_launcher():
    env = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
    check_one_dp_run(2, env=env, group_size=2)  # one DP run
    check_one_dp_run(1, env={}, group_size=None)  # one process
    with pytest.raises(RuntimeError, match="world size is 1"):
        check_one_dp_run(1, env={}, group_size=2)  # a group of its own, no launcher
    with pytest.raises(RuntimeError, match="started 4 processes"):
        check_one_dp_run(2, env={"WORLD_SIZE": "4"}, group_size=2)


def test_accelerate_simple_launcher_asked_for_several_processes_is_refused():
    # what `accelerate launch --num_processes 2 --config_file accelerate_configs/cpu.yaml` gives the ONE
    # process
    env = {"ACCELERATE_USE_CPU": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    with pytest.raises(RuntimeError, match="started ONE"):
        check_one_dp_run(1, env=env, group_size=None)
    check_one_dp_run(1, env={"ACCELERATE_USE_CPU": "True"}, group_size=None)  # --num_processes 1: fine


_SCRIPT = """
import sys
sys.path[:0] = [{tests!r}, {root!r}]
from helpers import ListDataset, PadCollator, make_examples
from models import VOCAB, tiny_roberta
from hf_dpfilter import DPTrainer, DPTrainingArguments
args = DPTrainingArguments(output_dir=sys.argv[1], noise_multiplier=1.0, logical_batch_size=4, max_steps=1,
                           report_to=[], remove_unused_columns=False, save_strategy="no")
DPTrainer(model=tiny_roberta(), args=args, train_dataset=ListDataset(make_examples(8, VOCAB, causal=False)),
          data_collator=PadCollator(1)).train()
print("TRAINED")
"""


def _script(tmp_path: Path) -> str:
    here = Path(__file__).resolve().parents[1]
    path = tmp_path / "train_once.py"
    path.write_text(_SCRIPT.format(tests=str(here), root=str(here.parent)))
    return str(path)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the case of a machine without a GPU")
def test_torchrun_two_processes_without_use_cpu_is_refused(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
           "127.0.0.1",
           "--master_port", str(port), _script(tmp_path), str(tmp_path / "out")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "TRAINED" not in output
    assert "separate DP run" in output and "use_cpu=True" in output
    assert not (tmp_path / "out" / "privacy_ledger.json").exists()


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the case of a machine without a GPU")
def test_accelerate_launch_two_processes_with_the_cpu_config_is_refused(tmp_path):
    config = Path(__file__).resolve().parents[2] / "accelerate_configs" / "cpu.yaml"
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--config_file",
           str(config),
           _script(tmp_path), str(tmp_path / "out")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "TRAINED" not in output, output[-3000:]
    assert "started ONE" in output


_RESUME_SCRIPT = """
import sys, json, torch
sys.path[:0] = [{tests!r}, {root!r}]
from helpers import ListDataset, PadCollator, make_examples
from models import VOCAB, tiny_roberta
from hf_dpfilter import DPTrainer, DPTrainingArguments
out = sys.argv[1]
def run(resume):
    args = DPTrainingArguments(output_dir=out, noise_multiplier=1.0, logical_batch_size=4, per_device_train_batch_size=2,
                               max_steps=4, save_strategy="steps", save_steps=2, report_to=[], use_cpu=True,
                               remove_unused_columns=False, dp_seed=5, seed=3, accountant="rdp", learning_rate=0.05)
    trainer = DPTrainer(model=tiny_roberta(), args=args, train_dataset=ListDataset(make_examples(16, VOCAB, causal=False)),
                        data_collator=PadCollator(1))
    trainer.train(resume_from_checkpoint=resume)
    return trainer
run(None)
trainer = run(out + "/checkpoint-2")
rank = torch.distributed.get_rank()
torch.save({{"params": [p.detach() for p in trainer.model.parameters()], "steps": trainer.accountant.steps,
            "seed": trainer.dp_optimizer.seed}}, out + f"/rank{{rank}}.pt")
"""


@pytest.mark.slow
def test_two_processes_resume_with_the_same_fresh_noise_on_every_process(tmp_path):
    """After a resume under a gloo process group, every process draws the same fresh noise (the new seed is
    agreed on), so the replicas stay identical, and the ledger counts both branches once."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    here = Path(__file__).resolve().parents[1]
    script = tmp_path / "resume_twice.py"
    script.write_text(_RESUME_SCRIPT.format(tests=str(here), root=str(here.parent)))
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
           "127.0.0.1",
           "--master_port", str(port), str(script), str(tmp_path / "out")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    ranks = [torch.load(tmp_path / "out" / f"rank{r}.pt") for r in range(2)]
    assert ranks[0]["seed"] == ranks[1]["seed"] != 5  # a fresh seed, agreed on by both processes
    for a, b in zip(ranks[0]["params"], ranks[1]["params"]):
        assert torch.equal(a, b)
    assert ranks[0]["steps"] == ranks[1]["steps"] == 4 + 2
    ledger = json.loads((tmp_path / "out" / "privacy_ledger.json").read_text())
    assert ledger["steps"] == 6 and [s["steps_released"] for s in ledger["sessions"]] == [4, 2]
