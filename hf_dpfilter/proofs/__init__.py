"""The proofs of an example's separation: what makes each example's influence on a step its own, declared or
proven.

One room for everything that establishes, before a step is released, that per-example clipping bounds each
privacy unit's influence:

* :mod:`~hf_dpfilter.proofs.validators`: the registry of modules that mix examples or write state from the
  data (refused at attach);
* :mod:`~hf_dpfilter.proofs.batch_axis`: each layer call's batch axis traced from the model's inputs;
* :mod:`~hf_dpfilter.proofs.batch_structure`: which collated keys carry the example axis, probed on the
  collator;
* :mod:`~hf_dpfilter.proofs.collator_draws`: an example alone keeps its batch row's draw of the keys the
  collator draws at random (masked-LM masking), the rest collated alone;
* :mod:`~hf_dpfilter.proofs.row_segments`: every packed batch's segments are its sampled rows, one whole row
  each (a row the data set packed is refused), checked on every collated batch;
* :mod:`~hf_dpfilter.proofs.loss_policy`: which losses are refused, and the contract of the per-example loss
  hook;
* :mod:`~hf_dpfilter.proofs.first_step_check`: the first step checked example by example against each example
  re-collated alone;
* :mod:`~hf_dpfilter.proofs.padding`: padding on every micro-batch: refused without an attention mask, leading
  padding given each example's own positions from the mask (declared per model family) or refused;
* :mod:`~hf_dpfilter.proofs.randomness`: the checks' forwards (training mode, dropout off, the same draws, or
  a refusal);
* :mod:`~hf_dpfilter.proofs.separation`: the one entry the trainer calls per micro-batch before accumulating
  it (the first-step check once, the loss-only re-checks on new shapes and on a random schedule);
* :mod:`~hf_dpfilter.proofs.hooks`: no gradient hook on the model sees a gradient before the noise (refused by
  name at every step).
"""
