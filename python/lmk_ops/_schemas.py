"""Every lmk_ops operator's schema, forward and backward, defined once, before the compiled extension registers
its CPU and CUDA kernels under them (and _meta.py, _autograd.py their fake kernels and autograd). Defined here rather
than in C++ because the stable ABI's definition (STABLE_TORCH_LIBRARY) carries tags only from torch 2.12 on, and
every op is pt2_compliant_tag'd for every torch from 2.10."""

from __future__ import annotations

import torch

_TAGS = (torch.Tag.pt2_compliant_tag,)

SCHEMAS = [
    # Packed batches (common/packed.h): with cu_seqlens [B + 1], hidden is [T, D], a mask or landmark mask is [T],
    # landmark positions [B, K] count from each text's start, argmax holds positions from each text's start, and the
    # backward ops return [T, D] (seq_len = T). max_seqlen, a host int, is checked to be at least every text's length
    # (the kernels take a packed batch's texts as runs of rows and need no synchronisation without it).
    # The pooling ops return (out, ..., pooled): with normalize, out is L2-normalised (as F.normalize) and pooled [B, D]
    # holds the vectors before normalising, unrounded in the accumulation type (float32, float64 for float64), for the
    # backward; without normalize, pooled is empty.
    # Their backward ops take the gradient of the pooled vector before normalising (autograd applies the rest); the
    # mean backward ops take it unrounded, in float32, with dtype naming hidden's dtype (default: grad_out's).
    "mean_pool(Tensor hidden, Tensor? mask=None, bool normalize=False, Tensor? cu_seqlens=None, "
    "SymInt? max_seqlen=None) -> (Tensor, Tensor)",
    "mean_pool_backward(Tensor grad_out, Tensor? mask, SymInt seq_len, ScalarType? dtype=None, "
    "Tensor? cu_seqlens=None) -> Tensor",
    # argmax is int32 [B, D], the first position of each maximum, -1 for an empty row.
    "max_pool(Tensor hidden, Tensor? mask=None, bool normalize=False, Tensor? cu_seqlens=None, "
    "SymInt? max_seqlen=None) -> (Tensor, Tensor, Tensor)",
    "max_pool_backward(Tensor grad_out, Tensor argmax, SymInt seq_len, Tensor? cu_seqlens=None) -> Tensor",
    # landmarks: a bool mask [B, L] or int64 positions [B, K] padded with -1 (a repeated position counts each time).
    "landmark_mean(Tensor hidden, Tensor landmarks, bool normalize=False, Tensor? cu_seqlens=None, "
    "SymInt? max_seqlen=None) -> (Tensor, Tensor)",
    "landmark_mean_backward(Tensor grad_out, Tensor landmarks, SymInt seq_len, ScalarType? dtype=None, "
    "Tensor? cu_seqlens=None) -> Tensor",
    # positions: int64 [B, K] padded with -1; returns [B, K, D], zero rows for -1.
    "landmark_gather(Tensor hidden, Tensor positions, Tensor? cu_seqlens=None) -> Tensor",
    "landmark_gather_backward(Tensor grad_out, Tensor positions, SymInt seq_len, Tensor? cu_seqlens=None) -> Tensor",
    # The first (last) valid token of each text, [B, D], and its position [B, 1] (int64, from the text's start, -1
    # for a text with none); the backward is landmark_gather_backward at those positions.
    "token_pool(Tensor hidden, Tensor? mask=None, bool last=False, Tensor? cu_seqlens=None, "
    "SymInt? max_seqlen=None) -> (Tensor, Tensor)",
    # The positions of a bool landmark mask's true entries ([B, L], or [T] with cu_seqlens, counted from each text's
    # start), in order: int64 [B, num_landmarks] padded with -1, and each text's count [B]; a text with more than
    # num_landmarks is refused. With num_landmarks None, only the counts (positions [B, 0]). Errors name `op`.
    "landmark_positions(Tensor landmark_mask, SymInt? num_landmarks, Tensor? cu_seqlens, str op) -> (Tensor, Tensor)",
    # A [B, L] (or packed [T]) attention mask as a fresh bool tensor, its values checked as the pooling ops check them
    # (0/1 for an integer mask), with errors naming `op`: the helpers written in Python (first_token_pool,
    # last_token_pool) call it so that a bad value fails the same way eagerly and inside a compiled graph.
    "valid_mask(Tensor mask, str op) -> Tensor",
    # cu_seqlens of a packed batch of `tokens` rows as fresh int64 offsets, checked as the pooling ops check them
    # (first 0, last T, non-decreasing, each text at most max_seqlen), with errors naming `op`.
    "packed_offsets(Tensor cu_seqlens, SymInt tokens, SymInt? max_seqlen, str op) -> Tensor",
    # query: [D] (one head) or [H, D / H] (H heads, head h scoring and pooling features [h D / H, (h + 1) D / H)).
    # scale defaults to 1 / sqrt(D / H). Returns (out [B, D] in hidden's dtype; stats [B, H, 2] in float64, the
    # softmax statistics {max score, sum of exp(score - max)}, -inf for a text with no valid token; weights
    # [B, H, L] in the accumulation type ([H, T] packed), or empty without return_weights). The backward recomputes
    # the probabilities from stats, works relative to out (the forward's output, which keeps it accurate in float32)
    # and returns (grad_hidden, grad_query).
    "attention_pool(Tensor hidden, Tensor? mask, Tensor query, float? scale=None, bool return_weights=False, "
    "Tensor? cu_seqlens=None, SymInt? max_seqlen=None) -> (Tensor, Tensor, Tensor)",
    # The landmark layout of a padded batch of token ids (lmk_ops.insert_landmarks, which checks the arguments and
    # brings device tensors to the host: the op runs on the CPU only). intervals: int64 [B] per row, or None for
    # interval in every row; padding_side None keeps the input's. Returns (input_ids in their dtype, attention_mask
    # int64, landmark_mask bool), [B, W] with W the longest new row.
    "insert_landmarks(Tensor input_ids, Tensor? attention_mask, Tensor? sentence_ends, Tensor? intervals, "
    "int interval, int landmark_id, int pad_id, int num_leading, int num_trailing, bool keep_trailing, "
    "int? max_length, str? padding_side) -> (Tensor, Tensor, Tensor)",
    "attention_pool_backward(Tensor grad_out, Tensor? grad_weights, Tensor hidden, Tensor? mask, "
    "Tensor query, Tensor out, Tensor stats, float? scale=None, Tensor? cu_seqlens=None, "
    "SymInt? max_seqlen=None) -> (Tensor, Tensor)",
]

# Kept alive for the life of the process: the definitions go with the library object.
LIBRARY = torch.library.Library("lmk_ops", "DEF")
for _schema in SCHEMAS:
    LIBRARY.define(_schema, tags=_TAGS)
