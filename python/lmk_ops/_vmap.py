"""torch.vmap batching rules for the ops (the backward ops' for torch.func.jacrev and torch.vmap over torch.func.grad).

Without them torch.vmap runs each op once per vmapped slice (PyTorch's fallback, which also warns the user to file
an issue with PyTorch). A padded batch of texts vmapped N times is one batch of N * B texts: the rules fold the
vmapped dimension into the ops' own batch dimension, call the op once, and unfold its outputs. A text pools to the
same bits alone or in any batch, so the folded call gives exactly what the slices would. Packed batches
(cu_seqlens), a vmapped query and attention's backward are run slice by slice, as the fallback would, without its
warning.
"""

from __future__ import annotations

import torch

# Per op: the arguments whose first dimension is the batch of texts in the padded layout (hidden, the mask or
# landmarks; a backward op's pooled gradient), and the index of cu_seqlens.
_FOLDABLE = {
    "mean_pool": ((0, 1), 3),
    "max_pool": ((0, 1), 3),
    "landmark_mean": ((0, 1), 3),
    "landmark_gather": ((0, 1), 2),
    "token_pool": ((0, 1), 3),
    "landmark_positions": ((0,), 2),
    "attention_pool": ((0, 1), 5),  # the query (2) is the same for every text
    "mean_pool_backward": ((0, 1), 4),  # the pooled gradient [B, D] and the mask
    "max_pool_backward": ((0, 1), 3),
    "landmark_mean_backward": ((0, 1), 4),
    "landmark_gather_backward": ((0, 1), 3),
    "attention_pool_backward": ((), 8),  # slice by slice: its query gradient sums over the texts
}


def _slice(args, in_dims, j):
    """The arguments of vmapped slice j."""
    return [a if d is None else a.select(d, j) for a, d in zip(args, in_dims)]


def _slice_by_slice(op, batch_size, in_dims, args):
    """op on each vmapped slice, the results stacked along a new first dimension."""
    results = [op(*_slice(args, in_dims, j)) for j in range(batch_size)]
    if isinstance(results[0], torch.Tensor):
        return torch.stack(results), 0
    outputs = tuple(torch.stack(parts) for parts in zip(*results))
    return outputs, (0,) * len(outputs)


def _folded(op, batch_size, in_dims, args, text_args):
    """op on one batch of batch_size * B texts: each text argument's vmapped dimension moved to the front (or the
    argument repeated, where it is not vmapped) and merged with the texts' dimension."""
    text_args = [i for i in text_args if i < len(args)]  # a call may leave the mask out
    texts = next(args[i].shape[1 if in_dims[i] == 0 else 0] for i in text_args if in_dims[i] is not None)
    folded = list(args)
    for i in text_args:
        a, d = args[i], in_dims[i]
        if a is not None:
            a = a.expand(batch_size, *a.shape) if d is None else a.movedim(d, 0)
            folded[i] = a.flatten(0, 1)
    try:
        result = op(*folded)
    except RuntimeError:
        # A bad value is named by its place in the folded batch (row j * B + b); the slices, one by one, name the
        # place in what the user passed, and the message says which slice. (On CUDA the ops' value checks are
        # device-side assertions, which print the folded place and cannot be caught here.)
        for j in range(batch_size):
            try:
                op(*_slice(args, in_dims, j))
            except RuntimeError as error:
                raise RuntimeError(f"{error} (in torch.vmap's slice {j})") from None
        raise

    def unfold(t):  # a per-text output [N * B, ...]; the ops' empty placeholders are the same for every slice
        return (t.unflatten(0, (batch_size, texts)), 0) if t.dim() > 0 and t.shape[0] == batch_size * texts \
            else (t, None)

    if isinstance(result, torch.Tensor):
        return unfold(result)
    outputs, out_dims = zip(*(unfold(t) for t in result))
    return tuple(outputs), tuple(out_dims)


def _rule(op, text_args, cu_seqlens_index):
    def rule(info, in_dims, *args):
        packed = len(args) > cu_seqlens_index and args[cu_seqlens_index] is not None
        others_vmapped = any(d is not None for i, d in enumerate(in_dims) if i not in text_args)
        if packed or others_vmapped:
            return _slice_by_slice(op, info.batch_size, in_dims, args)
        return _folded(op, info.batch_size, in_dims, args, text_args)
    return rule


for _name, (_text_args, _cu_seqlens_index) in _FOLDABLE.items():
    _op = getattr(torch.ops.lmk_ops, _name).default
    torch.library.register_vmap(_op, _rule(_op, _text_args, _cu_seqlens_index))
