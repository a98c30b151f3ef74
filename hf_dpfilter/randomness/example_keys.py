"""The randomness inside a step, keyed to each example: dropout masks and collator draws.

Dropout drawn from torch's global generator gives each example the block of the stream that everything drawn
before it leaves: the earlier micro-batches' shapes and order, so adding one example re-deals every later
example's masks, and the stream is fixed by the public ``seed``. Here every draw inside a step is a function
of

* a secret key (:class:`ExampleRandomness`: from the OS CSPRNG with ``secure_rng=True``, else derived from the
  secret DP seed; agreed on by all processes), the logical step, and
* the example's own content (:func:`example_digest` of its raw row, never its position in the data set or the
  batch, which adding an example shifts),

so for every fixed key an example's masks, and hence its clipped gradient, depend on that example alone.

Dropout (:class:`KeyedDropout`, a ``TorchFunctionMode`` active over the engine's forwards and backward): each
call of ``F.dropout`` (``nn.Dropout``, PEFT's ``lora_dropout``, eager attention), ``torch.dropout`` and
``F.scaled_dot_product_attention`` with ``dropout_p > 0`` in training draws its mask element by element from a
counter-based hash of (the row's seed, the call's nonce, the element's index within the row). Indices run from
the start of each axis for right-padded rows and from its end for left-padded ones, so a real token's index is
the same in the batch and alone whatever the padded width. The call's nonce is drawn from the global
generator, which is seeded from the key and the step before every micro-batch: the k-th dropout call of every
micro-batch of a step gets the same nonce, and activation checkpointing and the methods' gradient points,
which replay the global generator's state, replay the same masks. The leading axis of a dropout input must be
the micro-batch's rows: checked at every call (its size), and proven by the engine's batch-axis trace on each
new input signature.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import secrets
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode, _get_current_function_mode, _pop_mode_temporarily

__all__ = [
    "DROPOUT_FUNCTIONS", "ROWS_DROPOUT", "SHARED_DROPOUT", "ExampleRandomness", "KeyedDropout",
    "KeyedRandomnessError", "example_digest", "keyed_dispatch_paused", "keyed_mask",
]

#: a dropout's mask keyed to the rows of its input's leading axis (each row one example's, or several rows
#: one's)
ROWS_DROPOUT = "rows"
#: an nn.Dropout on a tensor that derives from no example: one mask for the whole step's forward
SHARED_DROPOUT = "shared"


class KeyedRandomnessError(RuntimeError):
    """A random draw inside a step that cannot be keyed to one example."""


# ------------------------------------------------------------------------------------------ example digests
_PLAIN = (int, float, bool, str)


def _canonical(value: Any) -> Any:
    """A JSON-able canonical form of a raw row's value (the same bytes for the same content)."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        return {"tensor": str(value.dtype), "shape": list(value.shape), "data": value.reshape(-1).tolist()}
    if isinstance(value, np.ndarray):
        return {"array": str(value.dtype), "shape": list(value.shape), "data": value.reshape(-1).tolist()}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {"dict": [[str(k), _canonical(v)] for k,
                         v in sorted(value.items(), key=lambda kv: str(kv[0]))]}
    if isinstance(value, (list, tuple)):
        if all(type(v) in _PLAIN for v in value):  # a row of token ids or features: no call per element
            return list(value)
        return [_canonical(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return {"repr": type(value).__name__, "value": repr(value)}


def example_digest(row: Any) -> bytes:
    """A 32-byte digest of one example's content (its raw data-set row, or a tensor of its own values).

    Computed from the content only: two processes, two runs and the example alone give the same digest, and no
    other example moves it. Two identical examples share it (they then share their draws, which each example's
    own function of its content allows)."""
    text = json.dumps(_canonical(row), separators=(",", ":"), allow_nan=True)
    return hashlib.blake2b(text.encode(), digest_size=32).digest()


# -------------------------------------------------------------------------------------------- the secret key
class ExampleRandomness:
    """The secret key of the step's per-example randomness (owned by the DP optimizer, never written
    anywhere).

    Args:
        key: 256 secret bits as bytes.
    """

    def __init__(self, key: bytes) -> None:
        self._key = bytes(key)

    @classmethod
    def for_plan(cls, secure: bool, seed: int, agree: Any = None) -> ExampleRandomness:
        """The key of a run: from the OS CSPRNG when ``secure`` (agreed on by all processes through ``agree``,
        a ``Collectives.agree_on_seed``), else derived from the secret DP seed (reproducible debugging)."""
        if secure:
            words = [secrets.randbits(62) for _ in range(4)]
            if agree is not None:
                words = [agree(w) for w in words]
            return cls(b"".join(int(w).to_bytes(8, "little") for w in words))
        return cls(hashlib.sha256(f"hf_dpfilter:{int(seed)}:example-randomness".encode()).digest())

    def __repr__(self) -> str:  # never the key
        return "ExampleRandomness(<secret>)"

    def __reduce__(self) -> Any:
        raise TypeError("ExampleRandomness holds a secret key and is never pickled or saved.")

    def _hash(self, *parts: bytes | str | int) -> int:
        h = hashlib.blake2b(key=self._key, digest_size=8)
        for part in parts:
            data = part if isinstance(part, bytes) else str(part).encode()
            h.update(len(data).to_bytes(4, "little") + data)
        return int.from_bytes(h.digest(), "little") >> 1  # 63 bits: a non-negative int64

    def step_seed(self, step: int, stream: str) -> int:
        """The seed of ``stream`` (``"dropout"``, ``"collator"``) at logical step ``step``, shared by every
        micro-batch and process of the step."""
        return self._hash("step", stream, int(step))

    def row_seed(self, step: int, stream: str, digest: bytes) -> int:
        """The seed of one example (its :func:`example_digest`) in ``stream`` at ``step``."""
        return self._hash("row", stream, int(step), digest)

    def row_seeds(self, step: int, stream: str, digests: Sequence[bytes]) -> torch.Tensor:
        """:meth:`row_seed` of each example, as an int64 tensor."""
        return torch.tensor([self.row_seed(step, stream, d) for d in digests], dtype=torch.int64)


# ------------------------------------------------------------------------------------ counter-based masks
def _signed(value: int, bits: int = 64) -> int:
    value &= (1 << bits) - 1
    return value - (1 << bits) if value >= 1 << (bits - 1) else value


_MIX_1 = _signed(0xBF58476D1CE4E5B9)
_MIX_2 = _signed(0x94D049BB133111EB)
#: 32-bit multipliers of the element hash (lowbias32's); one odd multiplier per axis of a row
_HASH_1, _HASH_2 = _signed(0x7FEB352D, 32), _signed(0x846CA68B, 32)
_AXIS_MULTIPLIERS = tuple(_signed(m, 32) for m in (
    0x9E3779B9, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F, 0x165667B1, 0xD3A2646C, 0xFD7046C5, 0xB55A4F09,
))


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (wrapping products; shifts made logical by masking)."""
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _MIX_1
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * _MIX_2
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def keyed_mask(shape: Sequence[int], row_seeds: torch.Tensor, nonce: int, p: float, from_end: bool,
               device: torch.device) -> torch.Tensor:
    """The keep-mask (bool) of a dropout input of ``shape``: row r's element at index i keeps with probability
    ``1 - p`` (to 2^-24), drawn from a hash of (``row_seeds[r]``, ``nonce``, i) alone.

    The row's 64-bit seed and the call's nonce are mixed per row (splitmix64); each element then costs a
    32-bit hash of the row's word plus a linear function of its index (seven passes over the tensor: the mask
    is about twice the cost of torch's own dropout mask on CPU).

    Args:
        shape: the input's shape; its leading axis holds the rows.
        row_seeds: one int64 seed per row.
        nonce: the call's draw (the same for every row).
        p: the drop probability.
        from_end: index every non-leading axis from its end (left-padded rows).
        device: where the mask is built.
    """
    rows, *rest = (int(s) for s in shape)
    if len(rest) > len(_AXIS_MULTIPLIERS):
        raise KeyedRandomnessError(f"A dropout input of {len(shape)} dimensions: at most "
                                   f"{len(_AXIS_MULTIPLIERS) + 1} are keyed.")
    offset = torch.zeros((), dtype=torch.int32, device=device)
    for axis, (size, multiplier) in enumerate(zip(rest, _AXIS_MULTIPLIERS)):
        index = torch.arange(size, dtype=torch.int32, device=device)
        if from_end:
            index = size - 1 - index
        view = [1] * len(rest)
        view[axis] = size
        offset = offset + (index * multiplier).view(view)
    words = _mix(row_seeds.to(dtype=torch.int64) ^ _signed(nonce)) & 0xFFFFFFFF
    words = ((words ^ (1 << 31)) - (1 << 31)).to(device=device, dtype=torch.int32)  # the low 32 bits, signed
    h = (words * _HASH_1).view([rows] + [1] * len(rest)) + offset * _HASH_1
    h.bitwise_xor_((h >> 15) & 0x1FFFF)
    h.mul_(_HASH_2)
    h.bitwise_xor_(-(1 << 31))  # unsigned order as signed order
    threshold = int(round(float(p) * (1 << 24))) << 8
    return h >= threshold - (1 << 31)


# ---------------------------------------------------------------------------------------------- dropout
#: functions whose random draws are keyed here
DROPOUT_FUNCTIONS = (F.dropout, torch.dropout, F.scaled_dot_product_attention)
#: random functions of another kind of dropout (whole channels, SELU's alpha dropout): refused when they draw
_REFUSED_DROPOUT = (F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
                    torch.alpha_dropout, torch.feature_alpha_dropout, torch.feature_dropout)


def _argument(args: tuple, kwargs: dict, index: int, name: str, default: Any) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else default


class KeyedDropout(TorchFunctionMode):
    """Keys every dropout draw of the block to the example of its row (see the module docstring).

    Args:
        row_seeds: one int64 seed per row of the micro-batch (None: no row may draw: a refusal names ``why``).
        padding_side: ``"right"`` or ``"left"``: the side the rows are padded on.
        why: the reason no row can be keyed (named in the refusal when a dropout draws).
    """

    def __init__(self, row_seeds: torch.Tensor | None, padding_side: str = "right", why: str = "",
                 engine: Any = None) -> None:
        super().__init__()
        self.row_seeds = row_seeds
        self.from_end = padding_side == "left"
        self.why = why
        #: the engine whose proof says how each nn.Dropout's mask is keyed (``dropout_verdicts``)
        self.engine = engine
        #: the nn.Dropout modules running (innermost last)
        self.dropout_modules: list[torch.nn.Module] = []
        #: how many dropout calls drew a keyed mask in the block
        self.keyed_calls = 0

    def _verdict(self) -> str:
        """How the running dropout call's mask is keyed: as the engine's proof says for the running nn.Dropout
        (while a proof traces this forward, from the tag it just recorded), else by rows."""
        module = self.dropout_modules[-1] if self.dropout_modules else None
        engine = self.engine
        tracer = getattr(engine, "_tracer", None)
        if tracer is not None and tracer.dropout_inputs:
            tag, traced_module = tracer.dropout_inputs[-1]
            if tag is None and traced_module is module and module is not None:
                return SHARED_DROPOUT
            return ROWS_DROPOUT
        if module is None:
            # a functional call: by rows (a proof refuses one whose input is not batch-first)
            return ROWS_DROPOUT
        verdicts = getattr(engine, "dropout_verdicts", None)
        if verdicts is None:
            return ROWS_DROPOUT  # no engine (a test of the mode alone): by rows, the size checked
        if module not in verdicts:
            raise KeyedRandomnessError(
                f"The dropout {type(module).__name__} drew a mask in a training forward that no proving step "
                "saw it in, so how its mask is keyed (to each example's rows, or one mask for a tensor free "
                "of the batch) is not proven. Fix: set that dropout to 0 for private training.")
        return verdicts[module]

    def _nonce(self) -> int:
        # from the global generator, seeded per micro-batch from the step: replayed by checkpointing and
        # points
        return int(torch.randint(0, 2**62, (1,)).item())

    def _mask(self, shape: torch.Size, device: torch.device, p: float, what: str) -> torch.Tensor:
        if what == "dropout" and self._verdict() == SHARED_DROPOUT:
            # a tensor free of the batch (proven): one mask, from the step's nonce alone, whatever the
            # examples
            self.keyed_calls += 1
            one = torch.zeros(1, dtype=torch.int64)
            return keyed_mask((1, *shape), one, self._nonce(), p, False, device).reshape(shape)
        if self.row_seeds is None:
            raise KeyedRandomnessError(
                f"The training forward draws {what} with p={p}, which cannot be keyed to the examples here: "
                f"{self.why}. Each example's dropout masks must be its own (drawn from the shared stream, "
                "adding one example would re-deal the others' masks). Fix: set the model's dropout to 0 for "
                "private training (e.g. config.hidden_dropout_prob=0, attention_dropout=0, "
                "LoraConfig(lora_dropout=0)).")
        rows = int(self.row_seeds.shape[0])
        if len(shape) < 1 or rows == 0 or int(shape[0]) % rows != 0:
            raise KeyedRandomnessError(
                f"The training forward draws {what} on a tensor of shape {tuple(shape)} whose leading axis "
                f"is not the micro-batch's {rows} rows, so its mask cannot be keyed to each example. Fix: "
                "set that dropout to 0 for private training.")
        self.keyed_calls += 1
        # the rows merged with the axes after them (OPT's (B*T, d)): row r's k entries are example r // k's,
        # as the engine's batch-axis trace proves for the input's signature (MERGED)
        merged = int(shape[0]) // rows
        view = (rows, merged, *shape[1:]) if merged > 1 else tuple(shape)
        return keyed_mask(view, self.row_seeds, self._nonce(), p, self.from_end, device).reshape(shape)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.dropout or func is torch.dropout:
            x = args[0] if args else kwargs["input"]
            if func is F.dropout:
                p = float(_argument(args, kwargs, 1, "p", 0.5))
                training = bool(_argument(args, kwargs, 2, "training", True))
                inplace = bool(_argument(args, kwargs, 3, "inplace", False))
            else:
                p = float(_argument(args, kwargs, 1, "p", 0.5))
                training = bool(_argument(args, kwargs, 2, "train", True))
                inplace = False
            if not training or p == 0.0:
                return func(*args, **kwargs)
            if p >= 1.0:
                return x.mul_(0.0) if inplace else x * 0.0
            # the mask scaled in place first: one product with x forward and one backward, as torch's own
            scaled = self._mask(x.shape, x.device, p, "dropout").to(x.dtype).mul_(1.0 / (1.0 - p))
            return x.mul_(scaled) if inplace else x * scaled
        if func is F.scaled_dot_product_attention:
            p = float(_argument(args, kwargs, 4, "dropout_p", 0.0))
            if p == 0.0:
                return func(*args, **kwargs)
            return self._attention(p, args, kwargs)
        if func in _REFUSED_DROPOUT:
            p = float(_argument(args, kwargs, 1, "p", 0.5))
            training = bool(_argument(args, kwargs, 2, "training" if func.__module__ != "torch" else "train",
                                      True))
            if training and p != 0.0:
                raise KeyedRandomnessError(
                    f"The training forward calls {getattr(func, '__name__', func)} with p={p}: channel and "
                    "alpha dropout are not keyed to the examples. Fix: set that dropout to 0 for private "
                    "training.")
        return func(*args, **kwargs)

    def _attention(self, p: float, args: tuple, kwargs: dict) -> torch.Tensor:
        """SDPA with its dropout keyed: the math kernel given the keyed mask of the attention weights."""
        query, key, value = (_argument(args, kwargs, i, n, None) for i,
                             n in enumerate(("query", "key", "value")))
        attn_mask = _argument(args, kwargs, 3, "attn_mask", None)
        is_causal = bool(_argument(args, kwargs, 5, "is_causal", False))
        scale = _argument(args, kwargs, 6, "scale", None)
        enable_gqa = bool(_argument(args, kwargs, 7, "enable_gqa", False))
        if isinstance(attn_mask, torch.Tensor) and attn_mask.dtype == torch.bool:
            # the public kernel turns a boolean mask into an additive one before its math path; the aten math
            # kernel called here would read it as 0/1 values
            attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                attn_mask.logical_not(), float("-inf"))
        shape = (*query.shape[:-1], key.shape[-2])  # (B, heads, L_q, L_k)
        keep = self._mask(torch.Size(shape), query.device, p, "attention dropout")
        out, _ = torch.ops.aten._scaled_dot_product_attention_math(
            query, key, value, attn_mask, p, is_causal, keep, scale=scale, enable_gqa=enable_gqa)
        return out


def keyed_dispatch_paused(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``fn`` (an engine computation on recorded tensors: no random draw, no forward of a module) with the
    keyed-dropout mode off while it is the only function mode.

    Under a ``TorchFunctionMode`` every tensor operation and attribute read goes through Python (about 2.5 us
    each); the engine's bookkeeping makes thousands of them per forward, which would be most of keyed
    dropout's cost. Nothing there draws: :func:`keyed_step` refuses a model forward or an nn.Dropout that
    runs while its mode is off, so a paused region can never draw an unkeyed mask. Under another mode (a
    proof's tracer, a user's) ``fn`` runs as it is.
    """

    @functools.wraps(fn)
    def paused(*args: Any, **kwargs: Any) -> Any:
        if torch._C._len_torch_function_stack() != 1 or not isinstance(_get_current_function_mode(),
                                                                        KeyedDropout):
            return fn(*args, **kwargs)
        with _pop_mode_temporarily():
            return fn(*args, **kwargs)

    return paused


def _paused_error(what: str) -> KeyedRandomnessError:
    return KeyedRandomnessError(
        f"{what} ran inside a keyed step while its keyed-dropout mode was paused (a computation marked "
        "keyed_dispatch_paused called a module), so its dropout would draw from the shared stream. Run "
        "forwards outside keyed_dispatch_paused.")


def active_keyed_mode() -> KeyedDropout | None:
    """The innermost :class:`KeyedDropout` on torch's function-mode stack (None when none is active). Autograd
    runs a backward without the forward's function modes, so a checkpointed layer's recomputation re-enters
    the mode its original forward ran under (hf_dpfilter.engine.checkpointing)."""
    from torch.overrides import _get_current_function_mode_stack

    return next((m for m in reversed(_get_current_function_mode_stack()) if isinstance(m, KeyedDropout)),
                None)


@contextlib.contextmanager
def keyed_step(seed: int, row_seeds: torch.Tensor | None, padding_side: str = "right", why: str = "",
               devices: Sequence[int] = (), engine: Any = None) -> Iterator[KeyedDropout]:
    """Run the block (a micro-batch's forwards and backward) with its dropout keyed to its rows.

    The global generator (CPU and ``devices``) is forked and seeded with ``seed`` (the step's, the same for
    every micro-batch) at the block's start and at each forward of ``model``, so the block draws nothing from
    the run's stream and each dropout call's nonce is its place in the forward; restored afterwards.

    Args:
        seed: the step's dropout seed (:meth:`ExampleRandomness.step_seed`).
        row_seeds: one seed per row (:meth:`ExampleRandomness.row_seeds`), or None when the rows cannot be
            keyed.
        padding_side: the side the rows are padded on.
        why: why the rows cannot be keyed (``row_seeds`` None).
        devices: the CUDA devices whose generators are forked too.
        engine: the clipping engine: its model's every forward restarts from ``seed``, and its proof says how
            each nn.Dropout's mask is keyed.
    """
    mode = KeyedDropout(row_seeds, padding_side, why, engine)
    model = getattr(engine, "model", None)

    # every forward of the model starts from the step's seed: the k-th dropout call of any forward of the step
    # (a proving forward, a method's gradient point, another micro-batch) draws the same nonce
    def restart(*_: Any) -> None:
        if active_keyed_mode() is not mode:
            raise _paused_error("the model's forward")
        torch.manual_seed(seed)

    def enter(module: torch.nn.Module, *_: Any) -> None:
        if active_keyed_mode() is mode:
            mode.dropout_modules.append(module)
            return
        if torch._C._current_graph_task_id() != -1:
            # a recomputation inside the backward that the engine's checkpoint wrapper did not run: its
            # dropout would draw from the shared stream
            raise KeyedRandomnessError(
                "A dropout was recomputed inside the backward by a gradient checkpoint that the engine does "
                "not know (not transformers' gradient checkpointing), so its mask would not be the example's "
                "own. Use model.gradient_checkpointing_enable("
                "gradient_checkpointing_kwargs={'use_reentrant': False}), or set the dropout to 0 for "
                "private training.")
        raise _paused_error(f"the dropout {type(module).__name__}")

    def leave(module: torch.nn.Module, *_: Any) -> None:
        if mode.dropout_modules and mode.dropout_modules[-1] is module:
            mode.dropout_modules.pop()

    handles = []
    if model is not None:
        handles.append(model.register_forward_pre_hook(restart))
        for module in model.modules():
            if isinstance(module, torch.nn.modules.dropout._DropoutNd):
                handles.append(module.register_forward_pre_hook(enter))
                handles.append(module.register_forward_hook(leave, always_call=True))
    try:
        with torch.random.fork_rng(devices=list(devices)):
            torch.manual_seed(seed)
            with mode:
                yield mode
    finally:
        for handle in handles:
            handle.remove()
