"""Low-precision compute over fp32 master weights on one device, without FSDP: the one-rank training path.

FSDP2 on one rank also gives bf16 compute over fp32 masters, but pays for it in every forward and backward: each
layer's hooks cast and "gather" its parameters, wait on the gather stream, reshard, and cast gradients back, which
cost ~0.2 s of host time per forward/backward on an H100 whatever the row length (issue #43). Here the model keeps
its fp32 master parameters (what the optimizer steps, DCP checkpoints and HF exports see, under their usual names)
and a working copy in the compute dtype, refreshed only when a master changed (once per optimizer step):

* the root's forward pre-hook refreshes the working copy when a master changed (one fused copy): after a step of any
  `torch.optim.Optimizer` that holds one of the masters (a process-wide step hook: fused AdamW updates its parameters
  without moving their version counters, so those alone would leave the working copy at the first step's weights,
  whoever built the optimizer), after a state dict was loaded, or when a master's version counter moved (an in-place
  edit anywhere else),
  then points every module at its working tensor (``module._parameters[name]``; the module tree, names and hooks
  stay as they are, so activation checkpointing recomputes with the same tensors);
* backward leaves gradients on the working tensors in the compute dtype. From the second micro-batch of a step on
  they are added to the masters' gradients as they arrive (post-accumulate-grad hooks); what is left at the end of a
  backward (the first micro-batch's) is cast into the masters' gradients then, when activations are gone, so the
  backward's peak holds bf16 gradients only. Then every module points at its master again. With
  `MixedPrecision.accumulate_in_matmuls` the weight gradients are instead summed in fp32 inside their matmuls
  (`prime_models.parallel.main_grad`).

Numerics equal FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` on one rank: the same bf16
copies of the same masters, floating-point forward inputs cast to the compute dtype at the root, gradients summed in
fp32 as fp32(g1) + g2 + ... (tests/models/test_mixed_precision.py). Parameters added to the model after
`apply_mixed_precision` are not tracked: apply it again.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._pytree import tree_map


@dataclass
class _Slot:
    """One registration of a parameter in a module (a tied parameter has several)."""

    module: nn.Module
    name: str
    master: nn.Parameter
    working: nn.Parameter


class MixedPrecision:
    """The working copy of a model's parameters and the hooks that swap it in and out; see the module docstring."""

    def __init__(self, model: nn.Module, param_dtype: torch.dtype):
        self.model_ref = weakref.ref(model)
        self.param_dtype = param_dtype
        self.slots: list[_Slot] = []
        working_of: dict[int, nn.Parameter] = {}
        for module in model.modules():
            for name, master in module._parameters.items():
                if master is None:
                    continue
                if id(master) not in working_of:
                    dtype = param_dtype if master.is_floating_point() else master.dtype
                    working_of[id(master)] = nn.Parameter(
                        master.detach().to(dtype, copy=True), requires_grad=master.requires_grad
                    )
                self.slots.append(_Slot(module, name, master, working_of[id(master)]))
        unique = {id(s.master): s for s in self.slots}.values()
        self.masters = [s.master for s in unique]
        self.working = [s.working for s in unique]
        self.master_of = {id(s.working): s.master for s in unique}
        self.versions = [m._version for m in self.masters]
        self.master_ids = frozenset(id(m) for m in self.masters)
        self.stale = False
        """The masters changed in a way their version counters do not show (an optimizer step, a loaded state dict)."""
        self.computing = False
        self.callback_queued = False
        self.accumulate_at_end = False
        """Hand gradients to the masters in one fused add when the backward ends instead of one add per gradient as
        it arrives. Set by `prime_models.parallel.cuda_graphs`: a graphed backward produces every gradient at once, so
        adding early frees nothing, and ~300 separate adds a micro-batch are host time the short rows cannot hide."""
        self.main_grad_of: dict[int, torch.Tensor] = {}
        """Master id -> its persistent fp32 gradient, once `accumulate_in_matmuls` ran (empty before)."""
        self.fused_modules: list[tuple[nn.Module, type]] = []
        self.handles = [w.register_post_accumulate_grad_hook(self._accumulate) for w in self.working if w.requires_grad]
        self.handles.append(register_optimizer_step_post_hook(_stale_after_steps_of(weakref.ref(self))))

    @property
    def num_bytes(self) -> int:
        """Device memory of the working copy."""
        return sum(w.numel() * w.element_size() for w in self.working)

    # --- forward ------------------------------------------------------------------------------------------------

    def accumulate_in_matmuls(self) -> None:
        """Sum weight gradients into persistent fp32 buffers inside their matmuls from now on
        (`prime_models.parallel.main_grad`): faster with many micro-batches a step, but the fp32 gradients of the
        whole model stay allocated through every forward and backward. Before the first forward (CUDA graphs capture
        the buffers' addresses); idempotent."""
        from prime_models.parallel.main_grad import fuse_modules

        if self.main_grad_of:
            return
        model = self.model_ref()
        # A gradient the masters already hold is carried over by the next forward (`_start_main_grads`).
        for working, master in zip(self.working, self.masters, strict=True):
            if working.requires_grad:
                self.main_grad_of[id(master)] = working.main_grad = torch.zeros_like(master, dtype=torch.float32)
        self.fused_modules = fuse_modules(model) if model is not None else []

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if not self.computing:
            self._refresh_if_stale()
            if self.main_grad_of and torch.is_grad_enabled():
                self._start_main_grads()
            for s in self.slots:
                s.module._parameters[s.name] = s.working
            self.computing = True
        return tree_map(self._cast_input, args), tree_map(self._cast_input, kwargs)

    def post_forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        # A forward without autograd has no backward to wait for; with autograd the working tensors stay in place
        # until the backward ends (activation checkpointing re-runs the layers' forwards inside it).
        if not torch.is_grad_enabled():
            self.use_masters()
        elif self.main_grad_of:
            # Gradients summed inside matmuls fire no parameter hook: the backward's start queues its end.
            tree_map(self._queue_end_at_backward, output)

    def _queue_end_at_backward(self, x: Any) -> None:
        if isinstance(x, torch.Tensor) and x.requires_grad:
            x.register_hook(lambda grad: self._queue_end_of_backward())

    @torch.no_grad()
    def _start_main_grads(self) -> None:
        # A master without a gradient (after zero_grad) starts a new sum; one given another tensor continues from it.
        to_zero = []
        for master in self.masters:
            main_grad = self.main_grad_of.get(id(master))
            if main_grad is None or master.grad is main_grad:
                continue
            if master.grad is None:
                to_zero.append(main_grad)
            else:
                main_grad.copy_(master.grad)
                master.grad = main_grad
        if to_zero:
            torch._foreach_zero_(to_zero)

    def _cast_input(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != self.param_dtype:
            return x.to(self.param_dtype)
        return x

    def steps_masters(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` holds one of this model's masters."""
        return any(id(p) in self.master_ids for group in optimizer.param_groups for p in group["params"])

    def mark_stale(self) -> None:
        self.stale = True

    @torch.no_grad()
    def _refresh_if_stale(self) -> None:
        versions = [m._version for m in self.masters]
        if self.stale or versions != self.versions:
            torch._foreach_copy_(self.working, [m.detach() for m in self.masters])
            self.versions, self.stale = versions, False

    # --- backward -----------------------------------------------------------------------------------------------

    def _queue_end_of_backward(self) -> None:
        if not self.callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            self.callback_queued = True

    def _accumulate(self, working: nn.Parameter) -> None:
        self._queue_end_of_backward()
        # A gradient summed inside its matmul (`accumulate_in_matmuls`) reaches AccumulateGrad as None.
        if self.accumulate_at_end or working.grad is None:
            return
        master = self.master_of[id(working)]
        into = self.main_grad_of.get(id(master), master.grad)
        if into is not None:
            into.add_(working.grad)
            working.grad = None

    def _end_backward(self) -> None:
        self.callback_queued = False
        into, added = [], []
        for working, master in zip(self.working, self.masters, strict=True):
            main_grad = self.main_grad_of.get(id(master))
            if main_grad is not None and master.grad is not main_grad:
                master.grad = main_grad
            if working.grad is None:
                continue
            if master.grad is None:
                master.grad = working.grad.to(master.dtype)
            else:
                into.append(master.grad)
                added.append(working.grad)
            working.grad = None
        if into:
            torch._foreach_add_(into, added)
        self.use_masters()

    def use_masters(self) -> None:
        """Point every module back at its master parameters (what state dicts, optimizers and exports read)."""
        if self.computing:
            for s in self.slots:
                s.module._parameters[s.name] = s.master
            self.computing = False

    def remove(self) -> None:
        from prime_models.parallel.main_grad import unfuse_modules

        self.use_masters()
        for h in self.handles:
            h.remove()
        unfuse_modules(self.fused_modules)
        for working in self.working:
            working.__dict__.pop("main_grad", None)


def _stale_after_steps_of(mp_ref: weakref.ref[MixedPrecision]) -> Callable[..., None]:
    # Process-wide rather than per optimizer, so an optimizer the caller built (a fused one included) is followed too;
    # a weak reference, so the hook keeps no model alive (`remove` unregisters it).
    def after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        mp = mp_ref()
        if mp is not None and not mp.stale and mp.steps_masters(optimizer):
            mp.mark_stale()

    return after_step


_APPLIED: weakref.WeakKeyDictionary[nn.Module, tuple[MixedPrecision, list]] = weakref.WeakKeyDictionary()


def mixed_precision_of(model: nn.Module) -> MixedPrecision | None:
    """The model's `MixedPrecision`, or None when `apply_mixed_precision` was not applied to it."""
    entry = _APPLIED.get(model)
    return entry[0] if entry is not None else None


def apply_mixed_precision(model: nn.Module, param_dtype: torch.dtype = torch.bfloat16) -> MixedPrecision:
    """Compute `model` in `param_dtype` over its (fp32) parameters as masters, on one device; see the module docstring.

    Applying it again (e.g. after adding parameters) replaces the previous working copy."""
    previous = _APPLIED.pop(model, None)
    if previous is not None:
        previous[0].remove()
        for h in previous[1]:
            h.remove()
    mp = MixedPrecision(model, param_dtype)
    handles = [
        model.register_forward_pre_hook(mp.pre_forward, with_kwargs=True),
        model.register_forward_hook(mp.post_forward),
        # Whatever reads or loads the model's state sees (and fills) the masters, even after a forward whose
        # backward never ran.
        model.register_state_dict_pre_hook(lambda *_: mp.use_masters()),
        model.register_load_state_dict_pre_hook(lambda *_: (mp.use_masters(), mp.mark_stale())),
    ]
    _APPLIED[model] = (mp, handles)
    return mp
