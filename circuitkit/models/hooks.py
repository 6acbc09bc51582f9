"""The hook plumbing every hook in the project uses (attribution, exact patching, pruning).

`HookSet` registers PyTorch forward hooks and removes them all on exit; `first_input` /
`replace_first` read and replace a module's residual input whether the model passes it
positionally or as `hidden_states`; `first_output` / `replace_first_output` do the same for
outputs that are a tensor or a tuple led by one. Where to hook (the z input, the attention and
MLP writes, the Q/K/V sites) is the adapter's to say (`circuitkit.models.families`).
"""

from __future__ import annotations

import torch


class HookSet:
    """Registers forward hooks and removes them all on exit."""

    def __init__(self) -> None:
        self.handles: list = []

    def pre(self, module, fn, with_kwargs: bool = False) -> None:
        self.handles.append(module.register_forward_pre_hook(fn, with_kwargs=with_kwargs))

    def post(self, module, fn) -> None:
        self.handles.append(module.register_forward_hook(fn))

    def __enter__(self) -> HookSet:
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()


def first_input(args, kwargs) -> torch.Tensor:
    """A block's (or norm's) residual input: the first positional argument or `hidden_states`."""
    return args[0] if args else kwargs["hidden_states"]


def replace_first(args, kwargs, value: torch.Tensor):
    """(args, kwargs) with the residual input replaced by `value`, for a `with_kwargs` pre-hook."""
    if args:
        return (value, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": value}


def first_output(output) -> torch.Tensor:
    """A module's main output: the tensor itself, or the first element of the tuple it returns."""
    return output[0] if isinstance(output, tuple) else output


def replace_first_output(output, value: torch.Tensor):
    """The module's output with its main tensor replaced by `value` (tuple structure kept)."""
    return (value, *output[1:]) if isinstance(output, tuple) else value
