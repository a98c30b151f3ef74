"""The clipping engine: per-example gradients in compact (ghost) form, from one backward.

The engine computes; it never clips. Clipping, noise and accounting belong to the DP optimizer, which drives
the engine (one call per micro-batch)::

    engine, optimizer, _ = make_private(plan, model, base=torch.optim.AdamW, lr=1e-3)  # hf_dpfilter.factory
    optimizer.accumulate(engine, loss_fn, batch_size)     # forward(s), backward, clip per example, sum
    optimizer.step()                                      # noise once, account, base optimizer step

How it works. Forward hooks on every module that owns a trainable parameter save the module's input ``A``
and keep a handle on its output ``Z``. :meth:`per_example_gradients` then runs **one** backward,
``torch.autograd.grad(sum_i loss_i, [Z ...])``, which computes the output gradients ``B`` and skips every
weight-gradient GEMM (autograd only computes what the requested inputs need). Because the loss of example i
depends only on example i, ``B[i]`` is example i's own output gradient. Each layer's registered rule
(:mod:`hf_dpfilter.engine.rules`) turns ``(A, B)`` into per-example gradient terms, from which the engine gets

* per-example norms, per layer and per batch by the cheaper of the ghost identity
  ``||sum_t b_t a_t^T||^2 = sum_{t,s} (a_t.a_s)(b_t.b_s)`` (cost ~T^2 (p+d)) and materializing ``B_i^T A_i``
  (cost ~T p d), accumulated in fp32 (fp64 for fp64 models);
* the weighted sum ``sum_i c_i g_i`` for any coefficients (clip factors, or 1 for the unclipped sum that
  DiceSGD needs) directly from ``A`` and ``B`` (book-keeping: no second backward).

A module called several times in one recorded forward (several parameter points for DiSK/DP-PMLF/DIFF2,
or weight sharing) contributes the sum of its calls: the calls are concatenated along the token axis,
so the *combination* is what gets clipped. Tied parameters (GPT-2's ``wte``/``lm_head``) get the exact
cross term between the embedding and the output-layer use.

Which layer calls are per example is proven, not read from shapes (:mod:`hf_dpfilter.proofs.batch_axis`): the
first recorded step after attach traces the batch axis from the model's batch-first inputs through every torch
function, and caches a verdict per module and call. A call on a tensor that does not derive from the batch but
whose output has leading size 1 (BERT's and GPT-2's position ids, broadcast as ``(1, T)``) would return a
gradient summed over the batch; the forward hook expands such outputs to ``(B, T, d)`` (a view; it changes no
values) so their gradient stays per example. Any other call without a proven batch axis
(``pos_emb(arange(T))``, T5's relative attention bias) is refused by name as soon as the backward shows it
carries gradient. The same first step refuses parameters and buffers written by the forward and trainable
modules never called; modules that mix examples or write state are refused earlier, at attach
(:mod:`hf_dpfilter.proofs.validators`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from hf_dpfilter.data.packing import PackedLayout, regroup_record
from hf_dpfilter.distributed.collectives import is_sharded
from hf_dpfilter.engine.checkpointing import (
    REENTRANT_REFUSED,
    CheckpointAtRecordedValues,
    CheckpointingError,
    CheckpointReplay,
    inside_backward,
)
from hf_dpfilter.engine.layer_inputs import find_layer_input
from hf_dpfilter.engine.moe import RoutedTokens, is_experts, recorded_output
from hf_dpfilter.engine.per_example import PerExampleGradients
from hf_dpfilter.engine.points import Float64Point
from hf_dpfilter.engine.precision import (
    AUTOCAST_MATMUL_LAYERS,
    LOW_PRECISION,
    accumulation_dtype,
    term_dtype,
)
from hf_dpfilter.engine.proving import _ProvingStep, _Record
from hf_dpfilter.engine.rules import Term, UnsupportedLayerError, find_grad_rule
from hf_dpfilter.engine.shared_outputs import shared_output_terms
from hf_dpfilter.engine.shared_tables import declared_tables
from hf_dpfilter.proofs import longrope
from hf_dpfilter.proofs.batch_axis import BROADCAST, SHARED, BatchAxisTracer
from hf_dpfilter.proofs.validators import (
    ModuleValidationError,
    ValidationOptions,
    find_module_problems,
    hold_eval_modes,
)
from hf_dpfilter.randomness.example_keys import keyed_dispatch_paused

__all__ = ["GhostClippingEngine", "UnsupportedLayerError"]


_OWNED_BY_THE_OPTIMIZER = (
    "The clipping engine no longer clips: the DP optimizer is the only owner of the clipping norm, the noise "
    "and the accounting, so the noise can never be sized for a different C than the one the sum was clipped "
    "at. Build the pair from one plan (engine, optimizer, _ = make_private(plan, model, base=...), from "
    "hf_dpfilter.factory) or create GhostClippingEngine(model) without a norm, and call "
    "optimizer.accumulate(engine, loss_fn, batch_size) once per micro-batch, then optimizer.step() "
    "(docs/privacy.md, 'Without the Trainer')."
)


class GhostClippingEngine(CheckpointReplay, _ProvingStep):
    """Attaches per-example gradient hooks to ``model`` (see module docstring). It computes, it never clips.

    Args:
        model: the model whose trainable parameters are trained privately. Attach after PEFT wrapping and
            after moving the model to its device; the engine never wraps or patches the model.
        verify_first_backward: on the first backward, also compute the ordinary (unclipped) gradient with
            autograd and check that the engine's unclipped sum matches it for every trainable parameter.
            This catches parameters that receive gradient through a path the hooks do not see.
        stack_layers: stack same-shape layers into one batched product for the norms and clipped sums (fewer
            kernel launches, a bounded transient copy; see :class:`PerExampleGradients`). None: on CUDA only.
        batchnorm_eval: accept frozen BatchNorms (no trainable parameter, or affine=False) and hold them in
            eval mode, with their stored statistics, in every recorded step (:meth:`hold_eval_modes`). Without
            it every BatchNorm is refused (:mod:`hf_dpfilter.proofs.validators`); a trainable BatchNorm is
            refused either way.
    """

    def __init__(
        self,
        model: nn.Module,
        *args: Any,
        verify_first_backward: bool = True,
        stack_layers: bool | None = None,
        batchnorm_eval: bool = False,
        **kwargs: Any,
    ) -> None:
        removed = [name for name in ("max_grad_norm", "clipping_fn") if name in kwargs]
        if args or removed:
            raise TypeError(f"GhostClippingEngine({', '.join(removed) or 'a clipping norm'}=...): "
                            f"{_OWNED_BY_THE_OPTIMIZER}")
        if kwargs:
            raise TypeError(f"GhostClippingEngine got unexpected arguments {sorted(kwargs)}.")
        self.model = model
        self.verify_first_backward = verify_first_backward
        self._records: list[_Record] = []
        self._recording = False
        self._recorded_modules: set[int] = set()  # ids of the modules recorded since record() began
        self._ran_without_autograd: set[int] = set()  # ... and of those that ran under no_grad there
        self._active_values: dict[str, torch.Tensor] | None = None  # call_model's values, during its forward
        self._recorded_at_other_values = False
        self._replaying_values = 0
        #: fp16 loss scaling: the backward runs on ``loss_scale * sum_i loss_i`` (a power of two, public; set
        #: by the DP optimizer from its :class:`~hf_dpfilter.trainers.loss_scaling.DPLossScaler`) and the
        #: per-example gradients divide it out exactly (:class:`PerExampleGradients`)
        self.loss_scale = 1.0
        self._pending_scale = 1.0
        self._in_own_backward = False
        self._batch_size: int | None = None
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._owners: dict[nn.Parameter, list[tuple[nn.Module, str]]] = {}
        self._param_names: dict[nn.Parameter, str] = {}
        self._module_params: dict[nn.Module, dict[str, nn.Parameter]] = {}
        self._sharded_modules: set[nn.Module] = set()
        #: parameters a module without a rule leaves to the rules of sub-modules owning them too (tied biases)
        self._delegated: dict[nn.Parameter, tuple[nn.Module, list[nn.Module]]] = {}
        self._pending_terms: dict[nn.Parameter, list[Term]] = {}
        self._recorded_inputs: dict[tuple, tuple[weakref.ref, torch.Tensor]] = {}
        self.stack_layers = stack_layers
        self._pending_reference: dict[nn.Parameter, torch.Tensor] | None = None
        self._pending_low_precision = False
        self._pending_dtype = torch.float32
        self._packing: PackedLayout | None = None  # declared by packed() for packed rows
        self.validation_options = ValidationOptions(batchnorm_eval=batchnorm_eval)
        # Batch-axis verdicts per module id and call index, proven on the first recorded step (None: not yet).
        self._axis_verdicts: dict[int, list[str]] | None = None
        self._new_verdicts: dict[int, list[str]] = {}
        self._call_counts: dict[int, int] = {}
        self._reprove = False  # a later step made a call the proving step did not see: prove again
        self._tracer: BatchAxisTracer | None = None
        #: nn.Dropout module -> how its mask is keyed, as proven (engine/proving.py,
        #: hf_dpfilter.randomness.example_keys)
        self.dropout_verdicts: dict[nn.Module, str] = {}
        self._trace_depth = 0
        self._check_parameters = True  # whether the state checks compare parameters (not under FSDP2)
        self._forward_ran = False  # a module of the model ran in the proving step
        self._model_forwards = 0  # the model's forwards in the current record() block
        self._proven_forwards = 0  # ... in the block that proved the verdicts
        self.attach()

    # ----------------------------------------------------------------------------------------- set-up
    def attach(self) -> None:
        """Validate every module, find every trainable parameter's module, check it has a rule, register
        hooks."""
        self.detach()
        # Every module, frozen ones too (hf_dpfilter.proofs.validators): one error listing each problem and
        # its fix.
        problems = find_module_problems(self.model, self.validation_options)
        if problems:
            raise ModuleValidationError(problems)
        self._axis_verdicts = None  # the hooked modules may have changed: prove the batch axes again
        self._proven_by_signature: dict[tuple, tuple] = {}  # the verdicts per input signature (proving.py)
        self._may_prove_late, self._late_proof, self._signatures, self._proven_block = (False, None, [],
                                                                                        frozenset())
        self._shares, self._shared_tables = declared_tables(self.model)  # hf_dpfilter.engine.shared_tables
        self._owners = {}
        self._param_names = {}
        self._module_params = {}
        self._sharded_modules = set()
        self._delegated = {}
        for name, param in self.model.named_parameters(remove_duplicate=False):
            if param.requires_grad:
                self._param_names.setdefault(param, name)
        for param, name in self._param_names.items():
            if param.dtype in (torch.float16, torch.bfloat16):
                raise TypeError(
                    f"Trainable parameter '{name}' is {param.dtype}. hf_dpfilter keeps trainable parameters "
                    "in fp32 and accumulates norms and clipped sums in fp32: load the model in float32 and "
                    "use bf16 autocast (bf16=True), or fp16 autocast with the DP loss scaler (fp16=True), "
                    "for mixed precision."
                )
        hooked: list[nn.Module] = []
        for module_name, module in self.model.named_modules(remove_duplicate=False):
            own = [(n, p) for n, p in module.named_parameters(recurse=False) if p.requires_grad]
            if not own:
                continue
            rule = find_grad_rule(module)
            if rule is None and self._delegate(module, own):
                continue
            if rule is None:
                param_name, _ = own[0]
                full = f"{module_name}.{param_name}" if module_name else param_name
                raise UnsupportedLayerError(
                    f"Trainable parameter '{full}' belongs to module '{module_name or '<root>'}' of type "
                    f"{type(module).__module__}.{type(module).__name__}, which has no per-example gradient "
                    "rule. Freeze it (param.requires_grad_(False)) or register a rule with "
                    f"hf_dpfilter.register_grad_rule({type(module).__name__})."
                )
            for param_name, param in own:
                self._owners.setdefault(param, []).append((module, param_name))
            # The module's parameters as attached: under FSDP2 the module holds other (gathered) tensors while
            # it runs, so the terms of a recorded call are keyed by these, the optimizer's parameters.
            self._module_params[module] = dict(own)
            if any(is_sharded(param) for _, param in own):
                self._sharded_modules.add(module)
            if all(module is not m for m in hooked):
                hooked.append(module)
                # Before FSDP2's own post-forward hook on a sharded unit, which swaps the gathered parameters
                # back to the shards: the first-backward check needs the tensors the forward used.
                declared = find_layer_input(module)  # a layer whose rule reads another input than its first
                self._handles.append(
                    module.register_forward_hook(self._forward_hook, prepend=module in self._sharded_modules)
                    if declared is None else module.register_forward_hook(
                        self._declared_input_hook, prepend=module in self._sharded_modules, with_kwargs=True)
                )
                if type(module) in AUTOCAST_MATMUL_LAYERS:
                    self._handles.append(module.register_forward_pre_hook(self._autocast_pre_hook))
        if not self._owners:
            raise ValueError("The model has no trainable parameters: nothing to train privately.")
        # the model's forwards inside record(): the verdicts proven for one forward extend to repeated
        # forwards (several parameter points), never to more calls within one forward (see _call_verdict)
        self._handles.append(self.model.register_forward_pre_hook(self._count_model_forward,
                                                                  with_kwargs=True))
        self._attach_longrope()

    def _attach_longrope(self) -> None:
        """LongRoPE rotary embeddings (accepted by the validators, :mod:`hf_dpfilter.proofs.longrope`): each
        recorded forward of one is checked to stay within its original length, and the ``inv_freq`` its update
        rewrites (bumping its version even with the values it holds) is compared after each step with the
        short-factor frequencies, those the checked positions make it use."""
        #: full buffer name -> (the module, the name of its buffer holding the expected values)
        self._rewritten_buffers: dict[str, tuple[nn.Module, str]] = {}
        for module_name, module in self.model.named_modules():
            pairs = longrope.longrope_buffers(module)
            if pairs is None:
                continue
            prefix = f"{module_name}." if module_name else ""
            for rewritten, expected in pairs:
                self._rewritten_buffers[prefix + rewritten] = (module, expected)

            def check(hooked: nn.Module, args: tuple, kwargs: dict, name: str = module_name) -> None:
                if self._recording:  # training forwards only: evaluation may use the long factor
                    longrope.check_positions(name, hooked, args, kwargs)

            def retag(hooked: nn.Module, args: tuple, kwargs: dict, output: Any,
                      rewritten: tuple[str, ...] = tuple(r for r, _ in pairs)) -> None:
                # The update's max over position_ids tags inv_freq (and so cos/sin) as mixing the
                # examples; the check above proved it picked the short-factor buffer, a constant: inv_freq
                # derives from no example, and cos/sin follow position_ids elementwise, as the tracer would
                # tag them then.
                tracer = self._tracer
                if tracer is None or not self._recording:
                    return
                for buffer in rewritten:
                    tracer.untag(getattr(hooked, buffer))
                position_ids = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
                for out in output if isinstance(output, tuple) else (output,):
                    if isinstance(out, torch.Tensor):
                        tracer.copy_tag(position_ids, out)

            self._handles.append(module.register_forward_pre_hook(check, with_kwargs=True))
            self._handles.append(module.register_forward_hook(retag, with_kwargs=True))

    def hold_eval_modes(self) -> None:
        """Put the modules the options hold in eval mode back there (``batchnorm_eval``); call after
        ``model.train()`` (the DPTrainer does, and so does :meth:`record`)."""
        hold_eval_modes(self.model, self.validation_options)

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for module in self.model.modules():
            function = module.__dict__.get("_gradient_checkpointing_func")
            if isinstance(function, CheckpointAtRecordedValues) and function.engine is self:
                module._gradient_checkpointing_func = function.checkpoint

    @property
    def trainable_parameters(self) -> list[nn.Parameter]:
        return list(self._owners)

    def parameter_name(self, param: nn.Parameter) -> str:
        return self._param_names.get(param, "<unnamed>")

    # --------------------------------------------------------------------------------------- recording
    @keyed_dispatch_paused
    def _declared_input_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor):
        """The forward hook of a layer with a declared input (:mod:`hf_dpfilter.engine.layer_inputs`)."""
        return self._forward_hook(module, args, output, kwargs)

    @keyed_dispatch_paused
    def _forward_hook(self, module: nn.Module, inputs: tuple, output: torch.Tensor,
                      kwargs: dict | None = None):
        if not torch.is_grad_enabled():
            if self._recording:
                self._ran_without_autograd.add(id(module))
            return None
        returned, output = output, recorded_output(module, output)  # a router records its logits
        if not isinstance(output, torch.Tensor) or not output.requires_grad:
            return None
        if inside_backward():
            # A checkpointed layer recomputed by the backward: already recorded by its original forward.
            if self._in_own_backward:
                self._check_recomputation(module)
            return None
        if not self._recording:
            return None
        if kwargs is not None:
            source = self._declared_input(module, inputs, kwargs, output)
        else:
            source = inputs[0] if inputs and isinstance(inputs[0], torch.Tensor) else None
        dtype = None
        if (
            source is not None
            and output.dtype in LOW_PRECISION
            and source.is_floating_point()
            and source.dtype != output.dtype
        ):
            # The layer computed in bf16/fp16 (autocast): it multiplied the input rounded to that dtype, which
            # is exactly this cast. Keeping the rounded copy instead of the wider input halves what we hold
            # and makes the per-example gradient the one the layer's own backward computes with.
            dtype = output.dtype
        # Layers fed the same input (query, key and value projections) get the same tensor object, so the
        # engine sees that they share it (PerExampleGradients fuses them) and keeps one bf16 copy, not three.
        activations = None if source is None else self._recorded_input(source, dtype)
        if is_experts(module) and activations is not None:  # the routing too (hf_dpfilter.engine.moe)
            activations = RoutedTokens(activations, inputs[1].detach(), inputs[2].detach())
        batch = self._batch_size
        if self._packing is not None:  # packed rows: the recorded tensors' leading axis is rows, not examples
            batch = self._packing.rows
        elif batch is None:
            batch = output.shape[0]
            self._batch_size = batch
        verdict = self._call_verdict(module, source, output, inputs)
        # one output for every example: per-example terms from shared_outputs; in a model with a declared
        # shared table even a (1, ...) broadcast stays unexpanded, as the model reshapes it by its own shape
        # (shared_tables)
        if verdict == SHARED or (self._shares and verdict == BROADCAST):
            used = {name: getattr(module, name) for name in self._module_params[module]}  # as the forward ran
            self._records.append(_Record(module, None, torch.autograd.graph.get_gradient_edge(output),
                                         output.dtype,
                                         shared_output=output, shared_used=used))
            self._recorded_modules.add(id(module))
            return None  # the output is left as it is
        output, activations, unproven, rows = self._apply_verdict(module, source, output, activations, batch,
                                                                  verdict)
        used = None
        if module in self._sharded_modules and self.verify_first_backward:
            used = {name: getattr(module, name) for name in self._module_params[module]}
        self._records.append(
            _Record(
                module=module,
                activations=activations,
                output_edge=torch.autograd.graph.get_gradient_edge(output),
                output_dtype=output.dtype,
                used=used,
                unproven=unproven,
                rows_per_example=rows,
            )
        )
        self._recorded_modules.add(id(module))
        return output if isinstance(returned, torch.Tensor) else None  # a router's tuple is left as it is

    @keyed_dispatch_paused
    def _autocast_pre_hook(self, module: nn.Module, args: tuple) -> tuple | None:
        """Under autocast, hand a Linear/Conv1D its input already cast to the autocast dtype, once per input.

        Autocast would make this very cast inside the layer (the GEMM runs in bf16/fp16), so the layer
        computes the same values; but the cast is then a tensor the forward hook can keep instead of making
        its own copy, autograd saves that same tensor for the layer's backward, and layers reading one input
        (query, key, value) share it. Without this, every such layer's input would be held twice while
        recording.
        """
        if not self._recording or not args or not torch.is_grad_enabled() or inside_backward():
            return None
        source = args[0]
        if not isinstance(source, torch.Tensor) or source.dtype != torch.float32:
            return None  # autocast casts only fp32 inputs
        device_type = source.device.type
        if not torch.is_autocast_enabled(device_type):
            return None
        dtype = torch.get_autocast_dtype(device_type)
        if dtype not in LOW_PRECISION:
            return None
        # differentiable: the gradient reaches the fp32 input as autocast's own cast would
        return (self._once_per_input(source, ("cast", dtype), lambda: source.to(dtype)), *args[1:])

    def _recorded_input(self, source: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
        """``source.detach()`` (cast to ``dtype`` if given), made once per input tensor and version while
        recording."""
        return self._once_per_input(
            source, ("record", dtype), lambda: source.detach() if dtype is None else source.detach().to(dtype)
        )

    def _once_per_input(self, source: torch.Tensor, kind: tuple,
                        make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``make()``, computed once per (input tensor, version, kind) while recording: layers reading one
        input then get one tensor object (one copy in memory, and the engine can see that they share it)."""
        key = (id(source), source._version, kind)
        cached = self._recorded_inputs.get(key)
        # a weak reference: the entry must not keep a wider input alive, and a dead one (whose id another
        # tensor may now have) never matches
        if cached is not None and cached[0]() is source:
            return cached[1]
        made = make()
        self._recorded_inputs[key] = (weakref.ref(source), made)
        return made

    @contextlib.contextmanager
    def record(self, batch_size: int | None = None) -> Iterator[None]:
        """Record the forward passes run inside the block (one or several, e.g. at several parameter
        points)."""
        self._adopt_checkpointing()
        self._records = []
        self._recorded_modules = set()
        self._ran_without_autograd = set()
        self._recorded_at_other_values = False
        self._pending_terms = {}
        self._recorded_inputs = {}
        self._pending_reference = None
        self._pending_low_precision = False
        self._batch_size = batch_size
        self._recording = True
        self._model_forwards = 0
        try:
            with self._proving_step():  # first step: batch axes traced, no state written (see _proving_step)
                yield
        finally:
            self._recording = False

    @contextlib.contextmanager
    def packed(self, layout: PackedLayout | None) -> Iterator[None]:
        """Declare that the batches recorded inside the block are packed rows with this layout (None: not
        packed).

        The recorded tensors then have rows as their leading axis, the per-example losses one entry per
        example of the layout, and each layer's activations and output gradients are regrouped per example
        before its rule (:mod:`hf_dpfilter.data.packing`), so every example gets its own gradient and its own
        clip.
        """
        previous, self._packing = self._packing, layout
        try:
            yield
        finally:
            self._packing = previous

    # ---------------------------------------------------------------- proven structure (first step)

    def clear(self) -> None:
        self._records = []
        self._recorded_inputs = {}

    def call_model(self, param_values: dict[nn.Parameter, torch.Tensor] | None, *args: Any,
                   **kwargs: Any) -> Any:
        """``model(*args, **kwargs)`` at other values of some trainable parameters (None: the current ones).

        The ``loss_fn`` that :meth:`DPOptimizer.accumulate` calls receives such values for methods that
        evaluate several parameter points (DiSK, DP-PMLF, DIFF2); a functional call, the model is untouched.
        """
        if not param_values:
            return self.model(*args, **kwargs)
        values = {self.parameter_name(p): v for p, v in param_values.items()}
        if isinstance(param_values, Float64Point) or any(
                v.dtype == torch.float64 and p.dtype != torch.float64 for p, v in param_values.items()):
            # A point given in float64 (or a Float64Point: float64 trainable parameters on a float32 base too)
            # runs the whole model in float64 (frozen parameters and floating buffers too): DIFF2's difference
            # rounds, whose per-example difference g(x) - g(x') cancels, so that its terms carry no float32
            # rounding (which depends on the batch's composition through the kernels' blocking) amplified by
            # ||g|| / ||g(x) - g(x')||. First names only: functional_call ties the other names of tied weights
            # (tie_weights=True).
            for name, tensor in [*self.model.named_parameters(), *self.model.named_buffers()]:
                if name not in values and tensor.is_floating_point() and tensor.dtype != torch.float64:
                    values[name] = tensor.double() if tensor.requires_grad else tensor.detach().double()
        if self._recording:
            self._recorded_at_other_values = True
        previous, self._active_values = self._active_values, values  # for checkpointed layers' recomputation
        try:
            return torch.func.functional_call(self.model, values, args=args, kwargs=kwargs, strict=False)
        finally:
            self._active_values = previous

    # ---------------------------------------------------------------------------------------- backward
    def per_example_gradients(self, per_example_loss: torch.Tensor,
                              precise: bool = False) -> PerExampleGradients:
        """One backward of ``sum_i loss_i`` to the recorded layer outputs; returns the compact per-example
        grads.

        ``precise=True``: float64 terms and proven norm bounds, for combinations with cancellation (see
        :class:`PerExampleGradients`).
        """
        self.backward_recorded(per_example_loss)
        return self.recorded_gradients(precise=precise)

    @keyed_dispatch_paused
    def backward_recorded(self, per_example_loss: torch.Tensor) -> None:
        """One backward of ``sum_i loss_i`` to the layer outputs recorded since the last call; keeps their
        terms.

        Several calls (one per forward) add up to what one backward of the summed losses gives: the terms of
        every call are kept until :meth:`recorded_gradients`. The DP optimizer uses this under FSDP2, where
        each parameter point is written into the shards and needs its own forward and backward.
        """
        if per_example_loss.dim() != 1:
            raise ValueError(
                f"per_example_loss must have shape (batch,), got {tuple(per_example_loss.shape)}: reduce "
                "each example's loss over its own tokens only (see hf_dpfilter.losses.tasks)."
            )
        # (given: as the block computed it, unscaled)
        batch, given = per_example_loss.shape[0], per_example_loss
        if self._batch_size is not None and batch != self._batch_size:
            raise ValueError(f"per_example_loss has {batch} entries but the recorded batch has "
                             f"{self._batch_size}.")
        self._batch_size = batch
        records, self._records = self._records, []
        self._recorded_inputs = {}  # the records hold what they need; the inputs themselves may go
        if not records:
            raise RuntimeError(
                "Nothing was recorded: run the forward pass inside `with engine.record():` (with autograd "
                "on; reentrant gradient checkpointing runs it without, see CheckpointingError)."
            )
        hidden = self._ran_without_autograd - self._recorded_modules
        if hidden:
            names = sorted({n for n, m in self.model.named_modules() if id(m) in hidden})
            raise CheckpointingError(
                "Modules with trainable parameters ran without autograd inside engine.record() "
                f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}): their gradients would be "
                "invisible to per-example clipping. Reentrant gradient checkpointing does this; "
                f"{REENTRANT_REFUSED} If these layers are meant to get no gradient, freeze their parameters."
            )
        self._pending_dtype = accumulation_dtype(per_example_loss.dtype)
        self._pending_scale = float(self.loss_scale)
        if self._pending_scale != 1.0:  # fp16: output gradients that would underflow are lifted (exact: 2^k)
            # every term, shared ones too, is of S * g_i
            per_example_loss = per_example_loss * self._pending_scale
        shared = [(self._module_params[r.module], r.shared_used, r.shared_output) for r in records
                  if r.shared_output is not None]
        if shared or self._shared_tables:  # before the backward below frees the graph
            for param, terms in shared_output_terms(per_example_loss, shared,
                                                    list(self._shared_tables)).items():
                self._pending_terms.setdefault(param, []).extend(terms)
        total = per_example_loss.sum()
        self._in_own_backward = True
        try:
            if self.verify_first_backward:
                self._pending_low_precision |= any(r.output_dtype in (torch.float16, torch.bfloat16)
                                                   for r in records)
                self._add_reference(total, records)
            output_grads = torch.autograd.grad(total, [r.output_edge for r in records], allow_unused=True)
        finally:
            self._in_own_backward = False
        # packed rows: layers sharing an input share its regrouped copy
        regrouped: dict[int, torch.Tensor] = {}
        for record, grad_output in zip(records, output_grads):
            if grad_output is None or record.shared_output is not None:
                continue
            if record.unproven is not None:
                raise self._unproven_batch_axis_error(record)
            if record.rows_per_example:  # (B * k, ...) -> (B, k, ...): row r is example r // k (proven)
                grad_output = grad_output.reshape(-1, record.rows_per_example, *grad_output.shape[1:])
            rule = find_grad_rule(record.module)
            module_params = self._module_params[record.module]
            activations = record.activations
            # a merged call regroups by whole rows (proving refused packed rows)
            if self._packing is not None:
                layout = self._packing.over_rows(record.rows_per_example) if record.rows_per_example else None
                activations, grad_output = regroup_record(
                    layout or self._packing, lambda m=record.module: self._module_name(m), activations,
                    grad_output, regrouped
                )
            for param_name, term in rule(record.module, activations, grad_output).items():
                self._pending_terms.setdefault(module_params[param_name], []).append(term)
        self._check_loss_axis(given)  # after a proof: the losses keep the batch axis (proving.py)

    def _add_reference(self, total: torch.Tensor, records: list[_Record]) -> None:
        """Add autograd's ordinary gradient of ``total`` to the reference of the first-backward check.

        A sharded parameter (FSDP2) is not in the autograd graph: the forward used a gathered whole tensor,
        recorded by the hook, so the reference is the gradient with respect to that tensor.
        """
        params = self.trainable_parameters
        used: dict[nn.Parameter, torch.Tensor] = {}
        for record in records:
            for name, tensor in (record.used or {}).items():
                used.setdefault(self._module_params[record.module][name], tensor)
        targets = [used.get(p, p) for p in params]
        grads = torch.autograd.grad(total, targets, retain_graph=True, allow_unused=True)
        reference = self._pending_reference if self._pending_reference is not None else {}
        for param, grad in zip(params, grads):
            if grad is None:
                continue
            grad = grad.full_tensor() if is_sharded(grad) else grad
            if self._pending_scale != 1.0:  # compared with the unscaled per-example sum (2^k: exact)
                grad = grad / self._pending_scale
            reference[param] = grad if param not in reference else reference[param] + grad
        self._pending_reference = reference

    @keyed_dispatch_paused
    def recorded_gradients(self, precise: bool = False) -> PerExampleGradients:
        """The per-example gradients of every backward since the last call (see :meth:`backward_recorded`)."""
        terms, self._pending_terms = self._pending_terms, {}
        if self._batch_size is None:
            raise RuntimeError("No backward was run: call backward_recorded() after the recorded forward.")
        # Parameters whose gradient the forward itself computes in float32 inside a float64 model (Gemma's
        # RMSNorm multiplies in float32): autograd's gradient is then only float32-accurate, and so is the
        # check.
        float32_terms = {param for param,
                         ts in terms.items() if any(term_dtype(t) == torch.float32 for t in ts)}
        grads = PerExampleGradients(
            terms, self._batch_size, self._pending_dtype, precise=precise, stack_layers=self.stack_layers,
            loss_scale=self._pending_scale,
        )
        if self.verify_first_backward:
            reference = self._pending_reference or {}
            self._verify(grads, tuple(reference.get(p) for p in self.trainable_parameters),
                         self._pending_low_precision,
                         float32_terms)
            self.verify_first_backward = False
        self._pending_reference = None
        self._pending_low_precision = False
        return grads

    def _verify(
        self,
        grads: PerExampleGradients,
        reference: tuple[torch.Tensor | None, ...],
        low_precision: bool = False,
        float32_terms: set[nn.Parameter] | None = None,
    ) -> None:
        ours = grads.weighted_sum(torch.ones(grads.batch_size))
        # Some gradients are zero in exact arithmetic (attention key biases: softmax is shift-invariant) and
        # only rounding noise in practice, so the tolerance has a floor relative to the whole gradient.
        total = sum(float(r.double().norm()) ** 2 for r in reference if r is not None) ** 0.5
        for param, ref in zip(self.trainable_parameters, reference):
            ref = torch.zeros(param.shape, dtype=param.dtype, device=param.device) if ref is None else ref
            mine = ours.get(param)
            mine = torch.zeros(param.shape, dtype=ref.dtype, device=ref.device) if mine is None else mine
            err = (mine.to(ref.dtype) - ref).norm().item()
            scale = ref.norm().item()
            # autograd's own gradient is computed in bf16 under autocast: compare at that precision.
            tol = 5e-2 if low_precision else (1e-3 if ref.dtype != torch.float64 else 1e-8)
            if ref.dtype == torch.float64 and float32_terms and param in float32_terms:
                tol = max(tol, 1e-5)
            if err > tol * scale + tol * 1e-4 * total + 1e-12:
                raise RuntimeError(
                    f"Per-example gradients of '{self.parameter_name(param)}' do not add up to its ordinary "
                    f"gradient (relative error {err / max(scale, 1e-30):.2e}): the parameter receives "
                    "gradient through a path the hooks do not see (used outside its module's forward, or an "
                    "in-place change of a layer output). Freeze it or register a grad rule for the module "
                    "that uses it."
                )

    def clip_and_accumulate(self, *args: Any, **kwargs: Any) -> None:
        """Removed: the optimizer clips (``optimizer.accumulate(engine, loss_fn, batch_size)``)."""
        raise RuntimeError(f"engine.clip_and_accumulate(...) was removed. {_OWNED_BY_THE_OPTIMIZER}")
