"""Gradient hooks on the model: refused by name, when ``train()`` starts and again at every step.

DPTrainer releases one gradient per step, the noisy average of the clipped per-example gradients, assigned to
``p.grad`` just before the base optimizer's update. Nothing else of the gradient may leave the computation,
but autograd reaches the parameters, unclipped, in two places: the engine's first-backward check (the ordinary
gradient of the first micro-batch) and the first-step check (each checked example's gradient alone). The
engine's own backward stops at the layer outputs, whose gradients are per-example information before any
clipping. So:

* a ``Tensor.register_hook`` on a trainable parameter (``wandb.watch(log="gradients")``, gradient histograms,
  a hook of one's own) would see a single example's unclipped gradient, and a hook that changes the gradient
  would be ignored by the clipped sums (they are computed from the layers' inputs and output gradients, not by
  autograd into the parameters);
* a ``register_post_accumulate_grad_hook`` never runs (no backward accumulates into ``p.grad``; the noisy
  gradient is assigned), so whatever it was meant to do would silently not happen;
* a module backward hook (``register_full_backward_hook``, ``register_full_backward_pre_hook``, the older
  ``register_backward_hook``, or their global ``torch.nn.modules.module`` forms) sees the micro-batch's output
  gradients, one row per example, unclipped.

All three are refused by the parameter's or module's name, the kind of hook and the function, with the fix.
The check reads two or three dictionary attributes per parameter and module, no tensor, so it runs before
every step (:func:`refuse_gradient_hooks`): a hook registered by a callback after training started is refused
before that step computes anything, and again after every forward of the run, before its backward (the
trainer's loss functions): a forward hook that registers a gradient hook while the forward runs is refused
before that hook sees a gradient. Forward hooks are not refused: they see the inputs of the forward, which the
process holds anyway (docs/threat_model.md, the trust boundary); one that calls ``register_hook`` on an
activation is not seen (autograd exposes no node's hooks) and stays the user's code inside the boundary.
Machinery that only moves gradients between the processes of the run (DDP, FSDP2 from ``torch.distributed``;
transformers' averaging of replicated trainable parameters under FSDP2) and this library's own hooks are not
refused; under DPTrainer they never see a gradient.

``WANDB_WATCH`` set to ``gradients`` or ``all`` makes transformers' ``WandbCallback`` call
``wandb.watch(model, log=...)``, which registers gradient hooks on every parameter: refused up front when set
in the environment of a private run, whether or not W&B is among the callbacks (a later ``report_to`` could
add it).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from typing import Any

from torch import nn

__all__ = ["GradientHookError", "gradient_hooks", "refuse_gradient_hooks", "refuse_wandb_watch_gradients"]

#: where the hooks of the run's own machinery are defined (function ``__module__`` prefixes)
LIBRARY_MODULES = ("hf_dpfilter.", "torch.distributed.", "torch.nn.parallel.")
#: transformers' post-accumulate averaging of replicated trainable parameters under FSDP2 (never runs under
#: DP)
LIBRARY_QUALNAMES = ("Trainer._sync_replicated_trainable_parameters.<locals>.average_gradient",)
#: WANDB_WATCH values whose wandb.watch registers a gradient hook on every parameter
WATCH_GRADIENTS = ("gradients", "all")


class GradientHookError(RuntimeError):
    """A hook would see an unclipped, un-noised gradient (or would silently never run) under DP training."""


def _function(hook: Any) -> Any:
    while isinstance(hook, functools.partial):
        hook = hook.func
    return getattr(hook, "__func__", hook)


def _describe(hook: Any) -> str:
    function = _function(hook)
    module = getattr(function, "__module__", None) or type(function).__module__
    name = getattr(function, "__qualname__", None) or type(function).__qualname__
    return f"{module}.{name}"


def _is_library(hook: Any) -> bool:
    function = _function(hook)
    module = getattr(function, "__module__", None) or ""
    return module.startswith(LIBRARY_MODULES) or getattr(function, "__qualname__", "") in LIBRARY_QUALNAMES


def _foreign(hooks: Any) -> list[Any]:
    return [hook for hook in (hooks or {}).values() if not _is_library(hook)]


def gradient_hooks(model: nn.Module) -> Iterator[tuple[str, str, Any]]:
    """``(name, kind, hook)`` of every hook that would see a gradient of the model and is not the run's own:
    tensor hooks and post-accumulate hooks on trainable parameters, module backward hooks (local and
    global)."""
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue  # a frozen parameter gets no gradient: its hooks never run
        for hook in _foreign(getattr(param, "_backward_hooks", None)):
            yield name, "Tensor.register_hook", hook
        for hook in _foreign(getattr(param, "_post_accumulate_grad_hooks", None)):
            yield name, "Tensor.register_post_accumulate_grad_hook", hook
    for name, module in model.named_modules():
        # False: the older register_backward_hook
        full = getattr(module, "_is_full_backward_hook", None) is not False
        kind = "Module.register_full_backward_hook" if full else "Module.register_backward_hook"
        for hook in _foreign(getattr(module, "_backward_hooks", None)):
            yield name or "<model>", kind, hook
        for hook in _foreign(getattr(module, "_backward_pre_hooks", None)):
            yield name or "<model>", "Module.register_full_backward_pre_hook", hook
    from torch.nn.modules import module as torch_module

    for hook in _foreign(getattr(torch_module, "_global_backward_hooks", None)):
        yield "<every module>", "register_module_full_backward_hook", hook
    for hook in _foreign(getattr(torch_module, "_global_backward_pre_hooks", None)):
        yield "<every module>", "register_module_full_backward_pre_hook", hook


def _any_hook(model: nn.Module) -> bool:
    """The fast pass of every step: whether any module or parameter holds a backward hook at all (no
    names)."""
    from torch.nn.modules import module as torch_module

    if getattr(torch_module, "_global_backward_hooks", None) or getattr(torch_module,
                                                                        "_global_backward_pre_hooks",
                                                                        None):
        return True
    for module in model.modules():
        if module._backward_hooks or module._backward_pre_hooks:
            return True
        for param in module._parameters.values():
            if param is not None and (param._backward_hooks
                                      or getattr(param, "_post_accumulate_grad_hooks", None)):
                return True
    return False


def refuse_gradient_hooks(model: nn.Module) -> None:
    """Raise :class:`GradientHookError` naming every foreign gradient hook of ``model`` (see the module
    docstring). Nothing is computed: one pass over the modules' and parameters' hook dictionaries (about 1.3
    ms on one CPU core for a 32-layer Llama, 423 modules), the names looked up only when a hook is there."""
    if not _any_hook(model):
        return
    found = list(gradient_hooks(model))
    if not found:
        return
    listed = "; ".join(f"'{name}' ({kind}: {_describe(hook)})" for name, kind, hook in found[:5])
    more = f" and {len(found) - 5} more" if len(found) > 5 else ""
    raise GradientHookError(
        f"Gradient hooks on the model under DP training: {listed}{more}. A parameter's tensor hook would see "
        "a single example's unclipped gradient (the first-step check computes it alone), a module backward "
        "hook the micro-batch's unclipped per-example output gradients, and a post-accumulate hook never "
        "runs (the noisy gradient is assigned, not accumulated); none is noised or accounted. Remove the "
        "hook (handle.remove()); for W&B use WANDB_WATCH=false or WANDB_WATCH=parameters (the released "
        "parameters are public). The noisy update of a step is the change of the parameters, which a "
        "callback's on_step_end can read."
    )


def refuse_wandb_watch_gradients(environ: Any = None) -> None:
    """Refuse ``WANDB_WATCH=gradients|all`` (transformers' WandbCallback then registers gradient hooks on
    every parameter with ``wandb.watch``)."""
    value = (environ if environ is not None else os.environ).get("WANDB_WATCH", "false")
    if str(value).strip().lower() in WATCH_GRADIENTS:
        raise GradientHookError(
            f"WANDB_WATCH={value!r}: transformers' WandbCallback would call wandb.watch(model, "
            f"log={value!r}), "
            "which hooks every parameter's gradient and uploads histograms of the unclipped, un-noised "
            "gradients the checks compute (one example alone). Set WANDB_WATCH=false, or "
            "WANDB_WATCH=parameters to log the released (public) parameters."
        )
