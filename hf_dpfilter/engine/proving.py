"""The proving step: what the first recorded step after attach establishes, and what every later step checks.

Which layer calls are per example is proven, not read from shapes (:mod:`hf_dpfilter.proofs.batch_axis`): the
first recorded step traces the batch axis from the model's batch-first inputs and caches a verdict per module
and call, per signature of the model's inputs (a later step whose inputs have a new signature is traced on
that step:
a forward may merge or mix the batch differently on another shape). The same step refuses parameters and
buffers written by the forward and trainable modules never called; every later step checks that no state was
written, and that each leaf with the ``x + v`` / ``x * v`` rule computed that form, before its backward
(before anything is released).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from hf_dpfilter.distributed.collectives import is_sharded
from hf_dpfilter.engine.checkpointing import inside_backward
from hf_dpfilter.engine.layer_inputs import find_layer_input
from hf_dpfilter.engine.moe import RoutedTokens, experts_verdict, is_experts, split_rows
from hf_dpfilter.engine.rules import UnsupportedLayerError, find_grad_rule, vector_form
from hf_dpfilter.proofs.batch_axis import BATCH, BROADCAST, LOST, MERGED, SHARED, BatchAxisTracer
from hf_dpfilter.proofs.first_step_check import PerExampleCheckError
from hf_dpfilter.proofs.randomness import DROPOUT_TURNED_OFF
from hf_dpfilter.proofs.validators import StateWrittenError
from hf_dpfilter.randomness.example_keys import (
    ROWS_DROPOUT,
    SHARED_DROPOUT,
    KeyedRandomnessError,
    keyed_dispatch_paused,
)


@dataclass
class _Record:
    """One recorded layer call: what its rule needs in the backward, as its batch-axis verdict left it."""

    module: nn.Module
    activations: torch.Tensor
    # Where the output's gradient arrives. Not the output tensor itself: holding it would keep every
    # checkpointed layer's output alive (checkpointing frees them) and would follow in-place changes of it.
    output_edge: torch.autograd.graph.GradientEdge
    output_dtype: torch.dtype
    #: the tensors the forward used for the module's sharded parameters (FSDP2 gathers whole ones), for the
    #: check
    used: dict[str, torch.Tensor] | None = None
    #: why the call's batch axis is not proven (hf_dpfilter.proofs.batch_axis); refused if its output gets
    #: gradient
    unproven: str | None = None
    #: rows of the output per example when the batch was merged into its leading dimension (MERGED), else 0;
    #: the activations are already viewed as (B, rows, ...), the output gradient is viewed so in the backward
    rows_per_example: int = 0
    #: the output itself when it is shared by every example (SHARED), and the tensors the forward used for the
    #: module's parameters (call_model's values, FSDP2's gathered ones): its terms come from shared_outputs
    shared_output: torch.Tensor | None = None
    shared_used: dict[str, torch.Tensor] | None = None


def _same_values(copy: torch.Tensor | None, tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` still holds ``copy``'s values (NaN equal to NaN); True when no copy was kept."""
    if copy is None:
        return True
    if copy.shape != tensor.shape or copy.dtype != tensor.dtype:
        return False
    if copy.is_floating_point() or copy.is_complex():
        return bool(((copy == tensor) | (copy.isnan() & tensor.isnan())).all())
    return bool(torch.equal(copy, tensor))


def _input_signature(args: tuple, kwargs: dict) -> tuple:
    """What the verdicts of a proof hold for: the model's inputs' structure, tensor shapes and dtypes, and
    plain values (a flag can change the forward as a shape can)."""
    leaves, spec = tree_flatten((args, kwargs))
    return spec, tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else (
        t if isinstance(t, (int, float, str, bool, type(None))) else type(t)) for t in leaves)


class _ProvingStep:
    """The proving step of :class:`~hf_dpfilter.engine.recorder.GhostClippingEngine` (a mixin of it)."""

    @contextlib.contextmanager
    def _proving_step(self) -> Iterator[None]:
        """Hold the option-frozen modules in eval mode; on the first recorded step after attach, also prove.

        Proving runs the block under :class:`~hf_dpfilter.proofs.batch_axis.BatchAxisTracer` (each layer
        call's batch axis traced from the model's inputs, cached per module and call for later steps), checks
        that every trainable parameter's module was recorded, and that no parameter or buffer was written (in
        place or replaced) by the forward: all before the backward, so before anything is released.
        """
        self.hold_eval_modes()
        self._call_counts = {}
        self._signatures: list[tuple] = []  # of the block's forwards while a proof runs
        # this block's, for the losses' check (_check_loss_axis)
        self._proof_tracer: BatchAxisTracer | None = None
        self._form_checks: list[tuple[nn.Module, torch.Tensor]] = []
        if self._axis_verdicts is not None and not self._reprove:
            # Later steps: a forward may write state only on some steps (e.g. a dynamic RoPE replacing its
            # inv_freq once a batch is long enough), so every step compares identities and version counters,
            # and the buffers' values (a write through `.data` moves no version counter), before its backward,
            # i.e. before anything of the step is released. Buffers are small next to the parameters. The
            # verdicts are those proven for the step's input shapes; inputs of shapes no step had are traced
            # now (_select_verdicts): a forward can merge or mix the batch differently on another shape.
            snapshot = self._state_snapshot(self._check_parameters)
            self._late_proof, self._may_prove_late = None, True
            try:
                yield
            except RuntimeError as error:
                if self._late_proof is not None and self._expanded_in_proof:  # as in a first proof, below
                    raise self._expansion_failed_error(error) from error
                raise
            finally:
                late, self._late_proof, self._may_prove_late = self._late_proof, None, False
                if late is not None:
                    self._tracer = None
                    late[0].__exit__(None, None, None)
                    for handle in late[1]:
                        handle.remove()
            self._check_vector_forms()
            if late is not None:
                self._conclude_proof(late[0], snapshot, self._check_parameters)
            elif self._recorded_modules and not self._state_surely_unchanged(snapshot):
                self._check_state_unchanged(snapshot, self._check_parameters)  # finds and names the change
            return
        self._reprove = False
        with_parameters = self._check_parameters = not self._under_fsdp()
        snapshot = self._state_snapshot(with_parameters)
        tracer, handles = self._start_proof()
        try:
            with tracer:
                yield
        except RuntimeError as error:
            # a torch error after an expansion of ours: name the module, not torch
            if self._expanded_in_proof:
                raise self._expansion_failed_error(error) from error
            raise
        finally:
            self._tracer = None
            for handle in handles:
                handle.remove()
        self._check_vector_forms()
        self._conclude_proof(tracer, snapshot, with_parameters)

    def _queue_vector_form(self, module: nn.Module, source: torch.Tensor | None,
                           output: torch.Tensor) -> None:
        """A leaf whose rule is ``x + v`` or ``x * v`` (rules.py: recognised on a probe, once per class):
        whether this call computed that form on its real input, bit for bit, as a flag checked after the
        forward (:meth:`_check_vector_forms`, one synchronisation per step): a forward that branches on the
        values, the dtype or the shape, or an instance that computes another form than its class's first, is
        refused."""
        form = vector_form(module)
        if form is None or source is None:
            return
        with torch.no_grad():
            expected = form(source)
            same = expected.shape == output.shape and expected.dtype == output.dtype
            flag = ((expected == output) | (expected.isnan() & output.isnan())).all() if same else None
        self._form_checks.append((module, flag))

    def _check_vector_forms(self) -> None:
        checks, self._form_checks = self._form_checks, []
        flags = [flag for _, flag in checks if flag is not None]
        if len(flags) == len(checks) and (not flags
                                          or bool(torch.stack([f.to(flags[0].device) for f in flags]).all())):
            return
        wrong = [module for module, flag in checks if flag is None or not bool(flag)]
        if wrong:
            names = ", ".join(dict.fromkeys(f"'{self._module_name(m)}' ({type(m).__name__})" for m in wrong))
            raise UnsupportedLayerError(
                f"Module {names} computed x + v (or x * v) on the engine's probe, which gave it that form's "
                "per-example gradient rule, but not on this batch (a branch on the values, the dtype or the "
                "shape, or another form than its class's first instance): its per-example gradient would be "
                "wrong. Freeze it (requires_grad_(False)) or register a rule with "
                "hf_dpfilter.register_grad_rule. Nothing was released."
            )

    def _start_proof(self) -> tuple[BatchAxisTracer, list]:
        """The tracer of a proving forward and the hooks that follow its module calls."""
        # packed rows: the model's inputs are rows (the layout maps them to examples)
        tracer = BatchAxisTracer(self._packing.rows if self._packing is not None else self._batch_size)
        self._tracer, self._new_verdicts, self._trace_depth = tracer, {}, 0
        # the running module calls, with the host reads at entry
        self._entries: list[tuple[nn.Module, int]] = []
        tracer.current_module = lambda: self._entries[-1][0] if self._entries else None
        self._outside_uses: dict[nn.Parameter, str] = {}
        tracer.watched = {id(p): (p, lambda p=p: self._check_delegated_use(p)) for p in self._delegated}
        self._forward_ran = False
        self._expanded_in_proof = []
        handles = []
        for module in self.model.modules():
            handles.append(module.register_forward_pre_hook(self._trace_entry, prepend=True,
                                                            with_kwargs=True))
            handles.append(module.register_forward_hook(self._trace_exit, always_call=True))
        return tracer, handles

    def _select_verdicts(self, module: nn.Module, args: tuple, kwargs: dict, signature: tuple) -> None:
        """At the model's first forward of a later step: the verdicts proven for inputs of these shapes (and
        these other arguments), or, for shapes no step had, a proof of this step's own (traced from here,
        concluded at the end of the block, before the backward). A later forward of the block with a signature
        that the proof did not see in its block finds no verdict: its trainable calls are refused and the next
        step proves again."""
        if self._model_forwards > 1:
            if signature not in self._proven_block:
                self._axis_verdicts = {}
            return
        proven = self._proven_by_signature.get(signature)
        if proven is not None:
            self._axis_verdicts, self._proven_forwards, self._proven_block = proven
            return
        self._late_proof = self._start_proof()
        self._late_proof[0].__enter__()
        self._signatures.append(signature)
        self._trace_entry(module, args, kwargs)  # the hooks just added run from the next call on

    def _check_loss_axis(self, per_example_loss: torch.Tensor) -> None:
        """After a proof, before its backward: per-example losses computed in the block whose batch axis the
        trace lost mix the examples (``loss + loss.mean()``, a model output combined with a batch statistic
        after its last trainable layer), so each example's gradient would carry the others': refused. Packed
        rows map rows to examples by the layout (not traced), and losses computed outside the block carry no
        tag: not checked."""
        tracer, self._proof_tracer = self._proof_tracer, None
        if tracer is None or self._packing is not None or (tracer.batch_size or 0) < 2:
            return  # (one example alone cannot be mixed with another: its pairings are with itself)
        tag = tracer.tag_of(per_example_loss)
        if tag is not None and tag != (0, 1):
            raise PerExampleCheckError(
                "The per-example losses of the proving step derive from the batch but lost its batch axis: "
                "an operation between the model's inputs and the losses couples examples (a statistic over "
                "the batch, a pairing of examples such as in-batch negatives), so one example's gradient "
                "would depend on the others. Fix: compute each example's loss from its own outputs only. "
                "Nothing was released."
            )

    def _conclude_proof(self, tracer: BatchAxisTracer, snapshot: dict, with_parameters: bool) -> None:
        """The checks of a proving block after its forwards (before the backward), then its verdicts kept."""
        self._proof_tracer = tracer
        if not self._recorded_modules:
            if self._forward_ran:
                # the model ran but none of its trainable modules did (e.g. LoRA through target_parameters,
                # whose lora_A/lora_B weights are used by a parametrization): name them rather than "nothing
                # recorded"
                self._check_every_trainable_module_recorded()
            return  # nothing ran (an empty micro-batch): prove on the next step
        self._check_state_unchanged(snapshot, with_parameters)
        if self._outside_uses:
            raise UnsupportedLayerError("\n".join(self._outside_uses.values()))
        if tracer.misused:
            names = sorted({self._module_name(m) for m in self.model.modules()
                            if id(m) in {k[0] for k in tracer.misused}})
            raise RuntimeError(
                f"The broadcast output of {', '.join(repr(n) for n in names)} (called on ids of shape (1, "
                "T), whose output the engine expands to one copy per example) is used along the batch axis "
                "(indexed, reduced or flattened over the examples), so its expanded gradient would not be "
                "per example. Fix: freeze it (requires_grad_(False)), or call it on ids shaped (B, T) and "
                "use its output per example. Nothing was released."
            )
        self._check_every_trainable_module_recorded()
        self._conclude_dropout_verdicts(tracer)
        if (tracer.batch_size or 0) > 1:
            # With one example every tensor of leading size 1 looks batch-first (an explicit (1, T)
            # position_ids input too), so the verdicts would not tell broadcast from batch: prove again on a
            # larger batch.
            self._axis_verdicts = self._new_verdicts
            self._proven_forwards = self._model_forwards
            self._proven_block = frozenset(self._signatures)
            if self._signatures and not tracer.value_dependent:
                # most signatures prove the same verdicts: one dict kept for them all (memory: one per kind)
                kept = {id(v[0]): v[0] for v in self._proven_by_signature.values()}.values()
                self._axis_verdicts = next((v for v in kept if v == self._new_verdicts), self._new_verdicts)
                self._proven_by_signature[self._signatures[0]] = (
                    self._axis_verdicts, self._model_forwards, self._proven_block)
            self._reprove = tracer.value_dependent  # proven from this batch's values: trace the next step too
            # a checking forward with dropout off: its dropout calls were not seen; the next forward proves
            # them
            self._reprove = self._reprove or DROPOUT_TURNED_OFF.get()

    def _conclude_dropout_verdicts(self, tracer: BatchAxisTracer) -> None:
        """Each dropout of the proven forward keyed to the rows of its input's leading axis (its batch axis,
        or the batch merged with the axes after it), or, for an ``nn.Dropout`` on a tensor that derives from
        no example (DeBERTa's relative-position table), one mask for all; the verdict kept per module
        (:attr:`dropout_verdicts`, read by hf_dpfilter.randomness.example_keys). Anything else is refused."""
        for tag, module in tracer.dropout_inputs:
            if tag is not None and tag[0] == 0:
                verdict = ROWS_DROPOUT
            elif tag is None and isinstance(module, nn.modules.dropout._DropoutNd):
                verdict = SHARED_DROPOUT
            elif (tracer.batch_size or 0) < 2:
                continue  # one example alone: its tags do not tell (proven again on a larger batch)
            else:
                name = self._module_name(module) if module is not None else "<a functional call>"
                raise KeyedRandomnessError(
                    f"A dropout of the training forward ({name!r}) draws its mask over a tensor whose "
                    "leading axis the batch-axis trace did not find to be the examples (moved, lost, or free "
                    "of the batch outside an nn.Dropout), so its mask cannot be keyed to each example: drawn "
                    "from a shared stream, adding one example would re-deal the others' masks. Fix: set that "
                    "dropout to 0 for private training. Nothing was released."
                )
            if isinstance(module, nn.modules.dropout._DropoutNd):
                previous = self.dropout_verdicts.setdefault(module, verdict)
                if previous != verdict:
                    raise KeyedRandomnessError(
                        f"The dropout {self._module_name(module)!r} drew its mask over the examples' rows on "
                        "one input signature and over a tensor free of the batch on another: its mask cannot "
                        "be keyed by one rule. Fix: set that dropout to 0 for private training. Nothing was "
                        "released.")

    def _expansion_failed_error(self, error: RuntimeError) -> UnsupportedLayerError:
        names = ", ".join(dict.fromkeys(f"'{self._module_name(m)}' ({type(m).__name__})"
                                        for m in self._expanded_in_proof))
        return UnsupportedLayerError(
            f"The forward failed after the engine expanded the batch-free output of {names} (called on a "
            "tensor that does not derive from the batch, output of leading size 1) to one copy per example, "
            "so that its gradient stays per example: the model's code then uses that output by its own "
            f"shape, which the expanded copy breaks (torch said: {str(error).splitlines()[0][:200]}). Its "
            "per-example gradient is not known to the engine. Fix: freeze the module (requires_grad_(False) "
            "on its parameters). Nothing was released."
        )

    def _trace_entry(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """The outermost module call of a traced forward: tag its batch inputs (see BatchAxisTracer)."""
        tracer = self._tracer
        self._forward_ran = True
        if tracer is not None and self._trace_depth == 0:
            if tracer.batch_size is None:
                from torch.utils._pytree import tree_flatten

                leaves = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
                          and t.dim() >= 1]
                if leaves:
                    tracer.batch_size = leaves[0].shape[0]
                    if self._batch_size is None:
                        self._batch_size = tracer.batch_size
            if not tracer.tag_batch_inputs(args, kwargs) and tracer.batch_size is not None:
                raise RuntimeError(
                    f"None of the tensors given to {type(module).__name__} has a leading dimension of "
                    f"{tracer.batch_size}, the recorded batch size: per-example clipping needs batch-first "
                    "tensors (the batch axis of every layer is traced from them). Pass batch_size to "
                    "engine.record() equal to the number of examples, and give the model its inputs "
                    "batch-first."
                )
        self._trace_depth += 1
        if tracer is not None:
            self._entries.append((module, tracer.host_reads))

    def _trace_exit(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._trace_depth = max(0, self._trace_depth - 1)
        if self._tracer is not None and is_experts(module) and isinstance(output, torch.Tensor):
            # frozen experts too: their output keeps the tokens' axis only when proven row-wise (moe), as
            # trainable ones do; otherwise it stays lost (the in-place index_add_ along it), and what it feeds
            # is refused
            experts_verdict(self._tracer, module, args, output)
        if self._tracer is not None and self._entries and self._entries[-1][0] is module:
            self._entries.pop()

    def _delegate(self, module: nn.Module, own: list[tuple[str, nn.Parameter]]) -> bool:
        """Whether each of ``module``'s own trainable parameters is also a parameter of a sub-module with a
        rule (BERT's ``cls.predictions.bias`` is ``cls.predictions.decoder.bias``, RoBERTa's ``lm_head.bias``
        too): the sub-modules' rules then give its per-example gradient, provided every use runs inside them
        (checked on the proving forward, see ``_check_delegated_use``)."""
        owners = {}
        for _, param in own:
            owners[param] = [sub for sub in module.modules() if sub is not module
                             and find_grad_rule(sub) is not None
                             and any(p is param for p in sub.parameters(recurse=False))]
            if not owners[param]:
                return False
        self._delegated.update({param: (module, subs) for param, subs in owners.items()})
        return True

    def _check_delegated_use(self, param: nn.Parameter) -> None:
        """A use of a parameter that its own module leaves to a sub-module's rule (a tied output bias: BERT's
        ``cls.predictions.bias`` is ``cls.predictions.decoder.bias``): the rule covers the use only inside
        that sub-module's forward; any other use is refused by name after the proving forward."""
        outer, inner = self._delegated[param]
        if self._entries and any(self._entries[-1][0] is m for m in inner):
            return
        name = self.parameter_name(param)
        running = self._module_name(self._entries[-1][0]) if self._entries else "<outside any module>"
        self._outside_uses.setdefault(param, (
            f"Trainable parameter '{name}' belongs to module '{self._module_name(outer)}' "
            f"({type(outer).__name__}), which has no per-example gradient rule; the rule of its sub-module "
            f"'{self._module_name(inner[0])}' covers it only inside that sub-module's forward, and it is "
            f"also used in '{running}'. Freeze it (requires_grad_(False)) or register a rule with "
            f"hf_dpfilter.register_grad_rule({type(outer).__name__}). Nothing was released."))

    def _call_verdict(self, module: nn.Module, source: torch.Tensor | None, output: torch.Tensor,
                      inputs: tuple = ()) -> str:
        """BATCH, BROADCAST, MERGED (the batch is the major part of a leading token axis, as after
        ``x.view(-1, d)``), SHARED (an output derived from no batch tensor), or why this call's batch axis is
        not proven (hf_dpfilter.proofs.batch_axis, hf_dpfilter.engine.moe)."""
        self._queue_vector_form(module, source, output)
        key = id(module)
        index = self._call_counts.get(key, 0)
        self._call_counts[key] = index + 1
        tracer = self._tracer
        if tracer is not None:
            tag = tracer.tag_of(source if source is not None else output)
            axis = tracer.axis(source if source is not None else output)
            entry_reads = next((reads for m, reads in reversed(self._entries) if m is module),
                               tracer.host_reads)
            if is_experts(module):  # the routing's token axis and the forward's row-wise form, see moe
                verdict = experts_verdict(tracer, module, inputs, output)
            elif tracer.tag_of(output) is None and not (axis is None and output.dim() >= 1
                                                        and output.shape[0] == 1):
                # the output derives from no batch tensor (the (1, T) broadcast case keeps its cheaper path)
                verdict = SHARED if tracer.host_reads == entry_reads else (
                    "carries no batch axis, and its forward read values of the batch into Python (int(x), "
                    ".item(), .tolist(), ...): its output may depend on the examples' data in a way the "
                    "trace cannot follow"
                )
            elif axis == 0:
                # a subclass of a layer with a rule (the base class's rule) whose forward mixes the rows:
                # refused
                verdict = BATCH if source is None or tracer.tag_of(output) == tag else (
                    "is per example, but its output does not keep those rows per example (the layer's "
                    "forward mixes rows of the batch)"
                )
            elif tag is not None and tag[0] == 0 and tag[1] > 1:
                # the batch merged with the dimensions after it, by traced views; the layer must keep those
                # rows
                verdict = MERGED if source is None or tracer.tag_of(output) == tag else (
                    "merged the batch into its leading dimension, but its output does not keep those rows "
                    "per example (the layer mixes rows of the merged dimension)"
                )
            elif axis is None and output.dim() >= 1 and output.shape[0] == 1:
                verdict = BROADCAST
            elif axis is None:
                verdict = (
                    "does not derive from the batch inputs (e.g. a positional table called on "
                    "torch.arange(T), a relative position bias, an adapter applied to a weight matrix)"
                )
            elif axis == LOST:
                verdict = ("derives from the batch but lost its batch axis (flattened, reduced or mixed "
                           "across examples)")
            else:
                verdict = f"has its batch axis at dimension {axis}, not the leading one"
            self._new_verdicts.setdefault(key, []).append(verdict)
            return verdict
        verdicts = (self._axis_verdicts or {}).get(key)
        if verdicts and (index < len(verdicts) or (len(set(verdicts)) == 1 and self._repeats_proven_calls(
                len(verdicts), index))):
            return verdicts[min(index, len(verdicts) - 1)]
        self._reprove = True  # a call the first step did not see: prove the batch axes again next step
        return "was not seen by the step that proved the batch axes (run the same forward in every step)"

    def _declared_input(self, module: nn.Module, args: tuple, kwargs: dict,
                        output: torch.Tensor) -> torch.Tensor:
        """The declared input of ``module``'s rule (:mod:`hf_dpfilter.engine.layer_inputs`); on the proving
        step, checked to reproduce the layer's output, so a forward that computes something else is refused by
        name."""
        declared = find_layer_input(module)
        source = declared.select(module, args, kwargs)
        if self._tracer is not None:
            with torch.no_grad():
                expected = declared.reproduces(module, source)
            if expected.shape != output.shape or not torch.equal(expected, output.detach()):
                raise UnsupportedLayerError(
                    f"Module '{self._module_name(module)}' ({type(module).__name__}) has a declared input "
                    "(hf_dpfilter.engine.layer_inputs) from which its rule assumes it computes its output, "
                    "but its forward computed something else (another transformers version?): its "
                    "per-example gradient would be wrong. Freeze it (requires_grad_(False) on its "
                    "parameters). Nothing was released."
                )
        return source

    def _apply_verdict(
        self, module: nn.Module, source: torch.Tensor | None, output: torch.Tensor,
        activations: torch.Tensor | RoutedTokens | None, batch: int, verdict: str,
    ) -> tuple[torch.Tensor, torch.Tensor | RoutedTokens | None, str | None, int]:
        """What the forward hook records for this call, from its batch-axis verdict (:meth:`_call_verdict`,
        any but SHARED, which the hook records itself): ``(output, activations, unproven, rows_per_example)``.

        BROADCAST expands the output (and input) to the batch; MERGED views the input as ``(B, k, ...)`` (row
        r of the merged dimension is example r // k, proven by the tracer; the backward views the output
        gradient the same way), after checking that the output has the input's rows (a row-wise layer; an
        experts call's routing is viewed alike, :mod:`hf_dpfilter.engine.moe`); anything else unproven is kept
        with its reason, and refused by the backward if gradient reaches its output.
        """
        if verdict == BROADCAST and output.shape[0] == 1:
            if batch > 1:
                # Broadcast inputs (position ids of shape (1, T)): expand so the gradient stays per example.
                output = output.expand(batch, *output.shape[1:])
                if activations is not None:
                    activations = activations.expand(batch, *activations.shape[1:])
                if self._tracer is not None:  # proven per example only if every use broadcasts it
                    self._tracer.mark_broadcast(output, (id(module), self._call_counts[id(module)] - 1))
                    self._expanded_in_proof.append(module)  # named if the forward then fails (_proving_step)
            return output, activations, None, 0
        if verdict == MERGED:
            packed = self._packing is not None and self._packing.over_rows(1) is None  # examples share rows
            if packed and not isinstance(activations, RoutedTokens):  # experts: moe refuses
                from hf_dpfilter.data.packing import PackingError

                # The regrouping per packed example knows one token axis; which axes the batch was merged with
                # (OPT's tokens, BLOOM's heads) is not recorded, and guessing it from a size is what we never
                # do.
                raise PackingError(
                    f"Module '{self._module_name(module)}' ({type(module).__name__}) is called on the batch "
                    "merged with other axes (OPT's (B*T, d), BLOOM's (B*H, T, D)), which is not supported on "
                    "packed rows. Use a padding collator (one example per row) for this model (DPSFTConfig: "
                    "packing=False, padding_free=False)."
                )
            rows = output.shape[0] // batch if output.dim() >= 1 else 0
            if rows >= 1 and output.shape[0] == batch * rows and (source is None
                                                                  or source.shape[0] == output.shape[0]):
                if isinstance(activations, RoutedTokens):
                    activations = split_rows(activations, batch, self._packing)
                elif activations is not None:
                    activations = self._once_per_input(
                        activations, ("merged", rows),
                        lambda: activations.reshape(batch, rows, *activations.shape[1:])
                    )
                return output, activations, None, rows
            return output, activations, (
                "merged the batch into its leading dimension in the proving step, but now has "
                f"{output.shape[0]} output rows for {batch} examples (not a whole number per example, or not "
                "its input's rows)"
            ), 0
        if verdict != BATCH:
            return output, activations, verdict if verdict != BROADCAST else (
                "has an output of leading size other than 1 where the first step proved a broadcast"), 0
        if output.shape[0] != batch:
            raise RuntimeError(
                f"Module '{self._module_name(module)}' ({type(module).__name__}) produced an output with "
                f"leading dimension {output.shape[0]} from a batch-first input while recording a batch of "
                f"{batch} examples: "
                "its output is not computed row by row from its input (e.g. a positional embedding that only "
                "reads the shape of input_ids), so its per-example gradient is unknown. Per-example clipping "
                "needs batch-first tensors: freeze the module (requires_grad_(False)), or pass batch_size to "
                "engine.record() if the model's inputs are not batch-first."
            )
        return output, activations, None, 0

    def _count_model_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._recording and torch.is_grad_enabled() and not inside_backward():
            self._model_forwards += 1
            signature = _input_signature(args, kwargs)
            if self._tracer is not None:  # a proof: the signatures its verdicts hold for
                self._signatures.append(signature)
            elif self._may_prove_late:
                self._select_verdicts(module, args, kwargs, signature)

    def _repeats_proven_calls(self, proven_calls: int, index: int) -> bool:
        """Whether call ``index`` of a module proven with ``proven_calls`` same-verdict calls is one of the
        same calls in a repeated forward (DiSK/PMLF/DIFF2 run the model at several parameter points; a DIFF2
        restart step runs it once) rather than an extra call within a forward: a table called on the batch ids
        in the proving step and later also on ``torch.arange(T)`` (T == B by chance) must not inherit the
        verdict."""
        proven, now = self._proven_forwards, self._model_forwards
        if not proven or not now or proven_calls % proven:
            return True  # the model's own forward was not seen (a loss_fn calling submodules): as proven
        return index < proven_calls // proven * now

    def _unproven_batch_axis_error(self, record: _Record) -> RuntimeError:
        name = self._module_name(record.module)
        params = ", ".join(self._module_params.get(record.module, {}))
        activations = record.activations
        if isinstance(record.module,
                nn.Embedding) or (isinstance(activations, torch.Tensor)
                                  and not activations.is_floating_point()):
            # a table on ids
            fix = "call it on ids derived from the batch, shaped (B, T), or broadcast as (1, T)"
        else:  # a layer on hidden states (Linear, LayerNorm, ...): what keeps its rows per example
            fix = (
                "call it on a tensor whose rows stay per example: views that merge the batch with the "
                "dimensions after it ((B, T, d) -> (B*T, d), (B, H, T, D) -> (B*H, T, D)) are traced and "
                "accepted; a view that moves another dimension before the batch, puts two examples' values "
                "in one row, or a reduction or normalisation over the examples is not"
            )
        return RuntimeError(
            f"Module '{name}' ({type(record.module).__name__}, trainable: {params}) was called on a tensor "
            f"that {record.unproven}: its output has no per-example batch axis, so its gradient cannot be "
            "split by example (clipping it as if it had one would let one example move the others' "
            f"contributions). Fix: freeze it (requires_grad_(False) on its parameters), or {fix}. Nothing "
            "was released."
        )

    def _module_name(self, module: nn.Module) -> str:
        for name, candidate in self.model.named_modules(remove_duplicate=False):
            if candidate is module:
                return name or "<root>"
        return type(module).__name__

    @keyed_dispatch_paused
    def _state_snapshot(self, parameters: bool) -> dict[str, tuple[torch.Tensor, int, torch.Tensor | None]]:
        """Every buffer (and parameter if asked) with its version counter; buffers also with a copy of their
        values, since native kernels write some of them without counting a version (BatchNorm's running_mean
        and running_var), and so does a write through ``.data``. Buffers are small next to the parameters."""
        out = {name: (t, t._version, t.detach().clone()) for name, t in self.model.named_buffers()}
        for name, (module, expected) in getattr(self, "_rewritten_buffers", {}).items():
            if name in out:  # rewritten by design (LongRoPE): no version compared; it must hold `expected`
                out[name] = (out[name][0], None, getattr(module, expected).detach().clone())
        if parameters:
            out.update({name: (t, t._version, None) for name, t in self.model.named_parameters()})
        return out

    @keyed_dispatch_paused
    def _state_surely_unchanged(self,
                                before: dict[str, tuple[torch.Tensor, int, torch.Tensor | None]]) -> bool:
        """The check of every later step in one device synchronisation per device: True when no tensor was
        replaced, no version moved and every buffer holds its values (False: look closer)."""
        after = dict(self.model.named_buffers())
        if self._check_parameters:
            after.update(self.model.named_parameters())
        if after.keys() != before.keys():
            return False
        equal: dict[torch.device, list[torch.Tensor]] = {}
        for name, (tensor, version, copy) in before.items():
            if after[name] is not tensor or (version is not None and tensor._version != version):
                return False
            if copy is not None:
                if copy.shape != tensor.shape or copy.dtype != tensor.dtype:
                    return False
                same = ((copy == tensor) | (copy.isnan() & tensor.isnan()) if copy.is_floating_point()
                        else copy == tensor)
                equal.setdefault(tensor.device, []).append(same.all())
        return all(bool(torch.stack(flags).all()) for flags in equal.values())

    def _under_fsdp(self) -> bool:
        """FSDP2 swaps each module's sharded parameters for gathered ones around its forward (and the DP
        optimizer's multi-point path writes the shards inside the block): its parameters are not compared."""
        try:
            from torch.distributed.fsdp import FSDPModule
        except ImportError:  # pragma: no cover
            return False
        return any(is_sharded(p) for p in self.model.parameters()) or any(
            isinstance(m, FSDPModule) for m in self.model.modules())

    def _check_state_unchanged(
        self, before: dict[str, tuple[torch.Tensor, int, torch.Tensor | None]], parameters: bool
    ) -> None:
        after = self._state_snapshot(parameters)
        changed = []
        for name in sorted(set(before) | set(after)):
            if name not in before or name not in after:
                changed.append((name, "was added" if name not in before else "was removed"))
            elif after[name][0] is not before[name][0]:
                changed.append((name, "was replaced by a new tensor"))
            elif after[name][1] != before[name][1] or not _same_values(before[name][2], after[name][0]):
                changed.append((name, "was written in place"))
        if changed:
            raise StateWrittenError(
                [(name, name.rpartition(".")[0] or "<root>", how) for name, how in changed]
            )

    def _check_every_trainable_module_recorded(self) -> None:
        missing = [
            param for param, owners in self._owners.items()
            # a module that ran without autograd gets the more specific CheckpointingError from the backward
            if not any(id(module) in self._recorded_modules | self._ran_without_autograd for module,
                       _ in owners)
            and param not in self._shared_tables  # read directly, declared (hf_dpfilter.engine.shared_tables)
        ]
        if missing:
            lines = "\n".join(
                f"- '{self.parameter_name(p)}' (module '{self._module_name(self._owners[p][0][0])}')"
                for p in missing
            )
            raise UnsupportedLayerError(
                "Trainable parameters whose module was never called in the first recorded forward: their "
                "gradient (if any) reaches them through a path the per-example hooks do not see (a weight "
                "used outside its module's forward, e.g. PEANuT's peanut_A or VeLoRA's lora_A), or they are "
                f"unused and would silently never train.\n{lines}\nFix: freeze them (requires_grad_(False)), "
                "or call each through its module's forward. Nothing was released."
            )
