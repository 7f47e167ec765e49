"""K-FAC's recipe for torch.distributed.checkpoint (DCP): a state dict to load a saved
`KFACPreconditioner` into."""
from __future__ import annotations


def kfac_checkpoint_template(preconditioner) -> dict:
    """`preconditioner.state_dict()` (a KFACPreconditioner) with a tensor for every layer's
    factors, to `torch.distributed.checkpoint.load` into: a fresh preconditioner has None there
    (no statistics yet), and DCP loads a saved tensor only into a tensor. Then
    `preconditioner.load_state_dict(template)`. Save after the first factor update, so that every
    layer's factors are tensors in the checkpoint too."""
    sd = preconditioner.state_dict()
    for name, entry in sd.get("layers", {}).items():
        st = preconditioner._state[name]
        for key, own in (("A", st.A), ("G", st.G)):
            if entry[key] is None:
                entry[key] = (own[0] if own.shape[0] == 1 else own).detach().clone()
    return sd
