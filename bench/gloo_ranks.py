"""What the distributed bench phases share: the models they train on gloo ranks (with their
global batch) and the count of the bytes handed to collectives."""
from __future__ import annotations

from .models import gpt, mlp

FULL_MODELS = {
    "gpt": (lambda: gpt(), 16),
    "mlp": (lambda: mlp(), 128),
    "mlp-deep": (lambda: mlp((784, 512, 512, 512, 10)), 128),
}
TINY_MODELS = {
    "gpt": (lambda: gpt(vocab=32, dim=16, depth=1, heads=2, context=8), 4),
    "mlp": (lambda: mlp((12, 8, 6, 4)), 8),
}


def count_bytes(counter: list) -> None:
    """Add the payload of every all_reduce / all_gather / broadcast to counter[0] while
    counter[1] is set."""
    import torch.distributed as dist
    for name in ("all_reduce", "all_gather", "broadcast", "all_gather_into_tensor"):
        original = getattr(dist, name)

        def wrapper(*args, __original=original, __name=name, **kwargs):
            if counter[1]:
                t = args[1] if __name.startswith("all_gather") else args[0]
                counter[0] += t.numel() * t.element_size()
            return __original(*args, **kwargs)
        setattr(dist, name, wrapper)
