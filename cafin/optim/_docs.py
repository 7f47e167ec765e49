"""Descriptions of the arguments that several members share, written once and spliced into their
docstrings, as torch.optim does with `_foreach_doc` and `_capturable_doc`.

Each fragment is one `Args:` entry: its first line goes where the member's docstring puts it (at
8 spaces), its continuation lines are indented 12 spaces. A member adds what is its own on
continuation lines after the fragment.
"""

_params_doc = r"""params (iterable): the parameters to optimise, or dicts defining param
            groups (each holds "params" and may set the per-group arguments)"""

_optional_params_doc = _params_doc.replace("(iterable)", "(iterable, optional)", 1)

_backend_doc = r"""backend (str, optional): "fused" (cafin's C++/CUDA kernels) or
            "reference" (plain PyTorch, the same update, which the fused one is tested
            against) (default: "fused")"""

_process_group_doc = r"""process_group (ProcessGroup, optional): when torch.distributed is
            initialised, the group the curvature is averaged over; passing one while it is
            not initialised is a ValueError (default: None: the whole world, or the FSDP2
            mesh the parameters are sharded on)"""

_grad_scaler_doc = r"""grad_scaler (torch.amp.GradScaler, optional): the GradScaler in use,
            needed only when the gradients are unscaled before the step
            (``scaler.unscale_(opt)``, e.g. to clip them), so that the curvature statistics,
            taken from scaled gradients, can still be unscaled; without it such a step
            raises a RuntimeError (default: None)"""

_published_bugs_doc = r"""published_bugs (bool, optional): True reproduces the bugs of the
            published code that cafin fixes, for the published numbers (default: False:
            they are fixed)"""
