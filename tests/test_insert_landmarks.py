"""insert_landmarks: property tests on random left/right-padded batches (against the per-row reference and against
the layout rules themselves), training intervals, sentence placement, and real tokenizer output."""

from collections.abc import Mapping

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lmk_ops
from lmk_ops import reference
from devices import DEVICES

CLS, SEP, PAD = 101, 102, 0


@st.composite
def token_batches(draw):
    """A tokenizer-like batch: [CLS] content [SEP] per row (content may be empty), padded on one side; a row may be
    padding alone, and the ids int64 or int32, the mask int64 or bool."""
    batch, gen = draw(st.integers(1, 6)), torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    lengths = torch.randint(0, draw(st.integers(0, 120)) + 1, (batch,), generator=gen)
    width = int(lengths.max()) + 2
    left = draw(st.booleans())
    only_padding = draw(st.sets(st.integers(0, batch - 1), max_size=batch - 1))
    ids = torch.full((batch, width), PAD)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for b, n in enumerate(lengths.tolist()):
        if b in only_padding:
            continue
        row = torch.cat([torch.tensor([CLS]), torch.randint(1000, 30000, (n,), generator=gen), torch.tensor([SEP])])
        span = slice(width - len(row), width) if left else slice(0, len(row))
        ids[b, span], mask[b, span] = row, 1
    ids = ids.to(draw(st.sampled_from([torch.int64, torch.int32])))
    mask = mask.to(draw(st.sampled_from([torch.int64, torch.bool])))
    options = {
        "landmark_id": draw(st.sampled_from([SEP, 7])),  # reusing SEP, or a dedicated token
        "interval": draw(st.one_of(st.integers(1, 40), st.just("per-row"))),
        "max_length": draw(st.one_of(st.none(), st.integers(3, 150))),
        "keep_trailing": draw(st.booleans()),
        "padding_side": draw(st.sampled_from([None, "left", "right"])),
    }
    if options["interval"] == "per-row":
        options["interval"] = lmk_ops.sample_intervals(batch, (1, 2, 8, 32), generator=gen)
    return ids, mask, options


def content_between_landmarks(ids, flags):
    """Per row: the content-token counts of each chunk (tokens after the leading [CLS], up to each landmark)."""
    chunks, run = [], 0
    for token, is_landmark in zip(ids[1:], flags[1:]):
        if is_landmark:
            chunks.append(run)
            run = 0
        elif token != SEP:
            run += 1
    return chunks, run


@given(case=token_batches())
def test_matches_the_per_row_reference(case):
    ids, mask, options = case
    before = (ids.clone(), mask.clone())
    out = lmk_ops.insert_landmarks(ids, mask, **options)
    ref_ids, ref_mask, ref_landmarks = reference.insert_landmarks(ids, mask, **options)
    assert torch.equal(out.input_ids, ref_ids) and torch.equal(out.attention_mask, ref_mask)
    assert torch.equal(out.landmark_mask, ref_landmarks) and out.input_ids.dtype == ids.dtype
    assert torch.equal(ids, before[0]) and torch.equal(mask, before[1]), "an input was modified"


@given(case=token_batches(), num_leading=st.integers(0, 3), num_trailing=st.integers(0, 3),
       sentences=st.booleans(), seed=st.integers(0, 2**31 - 1), max_length=st.one_of(st.none(), st.integers(1, 12)))
def test_matches_the_per_row_reference_with_any_specials_and_sentence_ends(case, num_leading, num_trailing,
                                                                            sentences, seed, max_length):
    ids, mask, options = case
    gen = torch.Generator().manual_seed(seed)
    options = {**options, "num_leading": num_leading, "num_trailing": num_trailing,
               "max_length": max_length if max_length is not None else options["max_length"]}
    if sentences:
        options["sentence_ends"] = torch.rand(ids.shape, generator=gen) < 0.2
    valid = mask.bool()
    try:
        out = lmk_ops.insert_landmarks(ids, mask, **options)
    except ValueError as error:
        # Refused only where a row's kept specials and one landmark do not fit in max_length.
        lengths = valid.sum(1)
        leading = lengths.clamp(max=num_leading)
        trailing = (lengths - leading).clamp(max=num_trailing) if options["keep_trailing"] else 0 * lengths
        assert "expected max_length >=" in str(error) and bool((leading + trailing + 1 > options["max_length"]).any())
        return
    ref_ids, ref_mask, ref_landmarks = reference.insert_landmarks(ids, mask, **options)
    assert torch.equal(out.input_ids, ref_ids) and torch.equal(out.attention_mask, ref_mask)
    assert torch.equal(out.landmark_mask, ref_landmarks)


@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 5), seq_len=st.integers(0, 40),
       ids_dtype=st.sampled_from([torch.int64, torch.int32, torch.int16, torch.uint8]),
       mask_dtype=st.sampled_from([torch.int64, torch.bool, torch.uint8]), share=st.floats(0, 1),
       pad_id=st.sampled_from([0, 3]), padding_side=st.sampled_from([None, "left", "right"]))
def test_matches_the_per_row_reference_on_masks_with_holes(seed, batch, seq_len, ids_dtype, mask_dtype, share, pad_id,
                                                           padding_side):
    """Any 0/1 mask, not just one span per row (the valid tokens are taken in order), and ids of any integer dtype."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 200, (batch, seq_len), generator=gen).to(ids_dtype)
    mask = (torch.rand(batch, seq_len, generator=gen) < share).to(mask_dtype)
    options = {"landmark_id": 150, "interval": 3, "pad_id": pad_id, "padding_side": padding_side}
    out = lmk_ops.insert_landmarks(ids, mask, **options)
    ref_ids, ref_mask, ref_landmarks = reference.insert_landmarks(ids, mask, **options)
    assert torch.equal(out.input_ids, ref_ids) and out.input_ids.dtype == ids_dtype
    assert torch.equal(out.attention_mask, ref_mask) and torch.equal(out.landmark_mask, ref_landmarks)


@given(case=token_batches())
def test_layout_rules(case):
    ids, mask, options = case
    out = lmk_ops.insert_landmarks(ids, mask, **options)
    full_lengths = lmk_ops.insert_landmarks(ids, mask, **{**options, "max_length": None}).attention_mask.sum(1)
    interval = options["interval"]
    max_length = options["max_length"]
    assert out.landmark_mask.dtype == torch.bool and out.attention_mask.dtype == torch.long
    # Padding untouched: pad id, no landmark, mask 0; and one contiguous run of tokens on the chosen side.
    padding = out.attention_mask == 0
    assert (out.input_ids[padding] == PAD).all() and not out.landmark_mask[padding].any()
    if options["padding_side"] == "left":
        assert (out.attention_mask.diff(dim=1) >= 0).all()
    elif options["padding_side"] == "right":
        assert (out.attention_mask.diff(dim=1) <= 0).all()
    for b in range(ids.shape[0]):
        row_in = ids[b][mask[b].bool()].tolist()
        row = out.input_ids[b][out.attention_mask[b].bool()].tolist()
        flags = out.landmark_mask[b][out.attention_mask[b].bool()].tolist()
        if not row_in:
            assert not row, "a row of padding alone stays empty (it pools to zeros)"
            continue
        every = int(interval[b]) if isinstance(interval, torch.Tensor) else interval
        content = row_in[1:-1]
        assert max_length is None or len(row) <= max_length
        assert row[0] == CLS and not flags[0], "the leading [CLS] stays in front and is not a landmark"
        assert sum(flags) >= 1, "every text keeps at least one landmark"
        assert all(row[i] == options["landmark_id"] for i in range(len(row)) if flags[i])
        if options["keep_trailing"]:
            assert row[-1] == SEP and not flags[-1], "a kept [SEP] is never a landmark, even when it is the landmark id"
        kept = [t for t, f in zip(row[1:], flags[1:]) if not f and not (options["keep_trailing"] and t == SEP)]
        truncated = max_length is not None and int(full_lengths[b]) > max_length
        # Content order is preserved (a prefix of it when truncated; the last kept token may have become the
        # landmark if none survived).
        assert kept == content[: len(kept)]
        chunks, tail = content_between_landmarks(row, flags)
        if not content:
            assert row[:2] == [CLS, options["landmark_id"]] and flags[1], "an empty text is [CLS][LMK]"
        elif not truncated:
            assert all(c == every for c in chunks[:-1]) and 1 <= chunks[-1] <= every and tail == 0, \
                "one landmark after every full chunk and after the last one"
        else:
            assert all(c == every for c in chunks[:-1]) and chunks[-1] <= every


def test_left_and_right_padding_give_the_same_rows():
    ids = torch.tensor([[CLS, 5, 6, 7, SEP, PAD, PAD], [CLS, 5, 6, 7, 8, 9, SEP]])
    right = lmk_ops.insert_landmarks(ids, (ids != PAD).long(), landmark_id=SEP, interval=2)
    left_ids = torch.stack([ids[0].roll(2), ids[1]])
    left = lmk_ops.insert_landmarks(left_ids, (left_ids != PAD).long(), landmark_id=SEP, interval=2)
    assert right.input_ids.tolist() == [[CLS, 5, 6, SEP, 7, SEP, PAD, PAD, PAD], [CLS, 5, 6, SEP, 7, 8, SEP, 9, SEP]]
    assert torch.equal(left.input_ids[0], right.input_ids[0].roll(3))
    assert torch.equal(left.input_ids[1], right.input_ids[1])
    assert right.landmark_mask.sum(1).tolist() == [2, 3]


def test_truncation_without_a_surviving_landmark_makes_the_last_position_one():
    ids = torch.tensor([[CLS] + list(range(1000, 1040)) + [SEP]])
    out = lmk_ops.insert_landmarks(ids, landmark_id=7, interval=32, max_length=10)
    assert out.input_ids.tolist() == [[CLS, *range(1000, 1008), 7]]
    assert out.landmark_mask.tolist() == [[False] * 9 + [True]]
    out = lmk_ops.insert_landmarks(ids, landmark_id=7, interval=32, max_length=10, keep_trailing=True)
    assert out.input_ids.tolist() == [[CLS, *range(1000, 1007), 7, SEP]]
    with pytest.raises(ValueError, match=r"^lmk_ops\.insert_landmarks: expected max_length >= 1 leading \+ 1 trailing"):
        lmk_ops.insert_landmarks(ids, landmark_id=7, max_length=2, keep_trailing=True)
    # keep_trailing takes the yes/no forms the ops' flags take: an int 0/1 or a NumPy bool.
    for flag in (1, np.bool_(True)):
        again = lmk_ops.insert_landmarks(ids, landmark_id=7, interval=32, max_length=10, keep_trailing=flag)
        assert again.input_ids.tolist() == out.input_ids.tolist()


def test_sentence_placement():
    ids = torch.tensor([[CLS, 11, 12, 13, 14, 15, 16, SEP]])
    ends = torch.zeros_like(ids, dtype=torch.bool)
    ends[0, [2, 3]] = True  # sentences end after tokens 12 and 13; the last one is closed anyway
    out = lmk_ops.insert_landmarks(ids, landmark_id=7, sentence_ends=ends)
    assert out.input_ids.tolist() == [[CLS, 11, 12, 7, 13, 7, 14, 15, 16, 7]]


def test_training_intervals_are_reproducible_and_used_per_row():
    draw = lambda seed: lmk_ops.sample_intervals(64, generator=torch.Generator().manual_seed(seed))  # noqa: E731
    assert torch.equal(draw(3), draw(3)) and not torch.equal(draw(3), draw(4))
    assert set(draw(3).tolist()) <= {32, 64, 128, 256}
    ids = torch.tensor([[CLS] + list(range(1000, 1300)) + [SEP]] * 2)
    out = lmk_ops.insert_landmarks(ids, landmark_id=7, interval=torch.tensor([32, 128]))
    assert out.landmark_mask.sum(1).tolist() == [10, 3]


@pytest.mark.parametrize("bad,pattern", [
    ({"interval": 0}, r"expected interval as an int in \[1, 2\*\*63\)"),
    ({"interval": torch.tensor([4])}, r"expected per-row intervals as a \[B\] = \[2\] tensor, got shape \[1\]"),
    ({"interval": torch.tensor([4, 0])}, r"expected per-row intervals >= 1, got 0 at \[1\]"),
    ({"attention_mask": torch.ones(2, 3, dtype=torch.long)}, r"expected attention_mask of shape \[2, 4\]"),
    ({"attention_mask": torch.ones(2, 4)},
     r"expected attention_mask as a bool or integer 0/1 tensor, got torch.float32"),
    ({"attention_mask": torch.full((2, 4), 2)}, r"expected attention_mask values 0 or 1, got 2 at \[0, 0\]"),
    ({"sentence_ends": torch.tensor([[0, 0, 1, 0], [0, -1, 0, 0]])},
     r"expected sentence_ends values 0 or 1, got -1 at \[1, 1\]"),
    ({"padding_side": "middle"}, r"expected padding_side 'left', 'right' or None"),
])
def test_bad_arguments(bad, pattern):
    kwargs = {"landmark_id": 7, **bad}
    with pytest.raises(ValueError, match=rf"^lmk_ops\.insert_landmarks: {pattern}"):
        lmk_ops.insert_landmarks(torch.ones(2, 4, dtype=torch.long), kwargs.pop("attention_mask", None), **kwargs)


def test_batches_move_to_another_device_keeping_their_dtypes():
    batch = lmk_ops.insert_landmarks(torch.tensor([[CLS, 11, 12, 13, SEP], [CLS, 14, SEP, PAD, PAD]]),
                                     torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]), landmark_id=7, interval=2)
    for original in (batch, batch.packed()):  # the packed batch had no .to() at all
        moved = original.to("meta")
        assert type(moved) is type(original)
        for key in original.keys():
            before, after = getattr(original, key), getattr(moved, key)
            if isinstance(before, torch.Tensor):
                assert after.device.type == "meta" and after.dtype == before.dtype and after.shape == before.shape
            else:
                assert after == before  # max_seqlen, a host int
        with pytest.raises(TypeError, match=rf"^lmk_ops\.{type(original).__name__}\.to: expected a device, got the "
                                            r"dtype torch\.float16"):
            original.to(torch.float16)


def test_batches_read_as_mappings_of_their_fields_as_a_batch_encoding_does():
    """`"landmark_mask" in batch` raised TypeError, `list(batch)` too, and a missing key was an AttributeError."""
    batch = lmk_ops.insert_landmarks(torch.tensor([[CLS, 11, 12, SEP]]), landmark_id=7, interval=1)
    for b, keys in ((batch, ["input_ids", "attention_mask", "landmark_mask"]),
                    (batch.packed(), ["input_ids", "position_ids", "cu_seqlens", "max_seqlen", "landmark_mask"])):
        assert isinstance(b, Mapping) and list(b) == list(b.keys()) == keys and len(b) == len(keys)
        assert "landmark_mask" in b and "labels" not in b and b.get("labels") is None
        assert all(b[k] is getattr(b, k) for k in keys) and dict(**b).keys() == dict(b.items()).keys()
        with pytest.raises(KeyError):
            b["labels"]


@given(st.integers(0, 2**31 - 1), st.booleans())
def test_sentence_end_flags_mark_the_last_token_starting_before_each_end(seed, in_order):
    from lmk_ops import hf

    gen = torch.Generator().manual_seed(seed)
    batch, seq_len = 3, int(torch.randint(1, 40, (1,), generator=gen))
    starts = torch.randint(0, 3, (batch, seq_len), generator=gen).cumsum(1) if in_order else torch.randint(
        0, 60, (batch, seq_len), generator=gen)
    offsets = torch.stack([starts, starts + torch.randint(0, 4, (batch, seq_len), generator=gen)], -1)  # 0: special
    mask = (torch.rand(batch, seq_len, generator=gen) < 0.8).long()
    ends = [sorted(set(torch.randint(0, 80, (int(torch.randint(0, 6, (1,), generator=gen)),), generator=gen).tolist()))
            for _ in range(batch)]
    want = torch.zeros(batch, seq_len, dtype=torch.bool)
    for b in range(batch):
        for end in ends[b]:
            before = [j for j in range(seq_len) if mask[b, j] and offsets[b, j, 1] > offsets[b, j, 0]
                      and offsets[b, j, 0] < end]
            if before:
                want[b, before[-1]] = True
    assert torch.equal(hf._sentence_end_flags(offsets, mask, ends), want)


@pytest.mark.parametrize("device", DEVICES)
def test_inputs_on_a_device_give_the_same_batch_on_that_device(device):
    """The op runs on the host: device inputs go over and the batch comes back, the same as from the CPU."""
    ids = torch.tensor([[CLS, 11, 12, 13, 14, SEP, PAD], [PAD, PAD, CLS, 15, 16, 17, SEP]])
    mask = (ids != PAD).long()
    ends = torch.zeros_like(ids, dtype=torch.bool)
    ends[0, 2] = True
    for options in ({"interval": 2}, {"interval": torch.tensor([1, 3])}, {"sentence_ends": ends},
                    {"interval": 2, "max_length": 4, "keep_trailing": True}):
        on_host = lmk_ops.insert_landmarks(ids, mask, landmark_id=7, **options)
        moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in options.items()}
        there = lmk_ops.insert_landmarks(ids.to(device), mask.to(device), landmark_id=7, **moved)
        for key in on_host.keys():
            assert there[key].device == ids.to(device).device and torch.equal(there[key].cpu(), on_host[key])


def test_extreme_integer_arguments_are_taken_as_they_are():
    """An interval, max_length or special-token count near 2**63 means "one chunk", "no cut", "all specials"."""
    ids = torch.tensor([[CLS, 11, 12, 13, SEP], [CLS, 14, SEP, PAD, PAD]])
    mask = (ids != PAD).long()
    huge = 2**63 - 1
    one_chunk = lmk_ops.insert_landmarks(ids, mask, landmark_id=7, interval=huge, max_length=huge)
    assert one_chunk.input_ids.tolist() == [[CLS, 11, 12, 13, 7], [CLS, 14, 7, PAD, PAD]]
    per_row = lmk_ops.insert_landmarks(ids, mask, landmark_id=7, interval=torch.tensor([huge, 1]))
    assert per_row.input_ids.tolist() == [[CLS, 11, 12, 13, 7], [CLS, 14, 7, PAD, PAD]]
    all_leading = lmk_ops.insert_landmarks(ids, mask, landmark_id=7, num_leading=huge)
    assert all_leading.input_ids.tolist() == [[CLS, 11, 12, 13, SEP, 7], [CLS, 14, SEP, 7, PAD, PAD]]


def test_the_op_checks_what_it_is_called_with_directly():
    """torch.ops.lmk_ops.insert_landmarks trusts nothing that would read outside its inputs or divide by zero."""
    op = torch.ops.lmk_ops.insert_landmarks
    ids = torch.tensor([[CLS, 11, 12, SEP]])
    usual = (ids, None, None, None, 2, 7, 0, 1, 1, False, None, None)
    call = lambda *changed: op(*changed, *usual[len(changed):])  # noqa: E731
    for args, pattern in [
        ((ids.float(),), r"expected input_ids as an integer CPU tensor \[B, L\], got Float"),
        ((ids, torch.ones(1, 3, dtype=torch.long)), r"expected attention_mask of shape \[B, L\] = \[1, 4\]"),
        ((ids, None, torch.ones(1, 4)), r"expected sentence_ends of dtype bool or an integer dtype"),
        ((ids, None, None, torch.tensor([0])), r"expected per-row intervals >= 1, got 0 at \[0\]"),
        ((ids, None, None, torch.tensor([1, 2])),
         r"expected per-row intervals as an integer CPU tensor \[B\] = \[1\]"),
        ((ids, None, None, None, 0),
         r"expected num_leading >= 0, num_trailing >= 0, interval >= 1 and max_length >= 1, got 1, 1, 0 and 1"),
        ((ids, None, None, None, 2, 7, 0, -1), r"expected num_leading >= 0, .* got -1, 1, 2 and 1"),
        ((ids, None, None, None, 2, 7, 0, 1, 1, False, None, "up"), r"expected padding_side 'left', 'right' or None"),
    ]:
        with pytest.raises(RuntimeError, match=rf"^lmk_ops\.insert_landmarks: {pattern}"):
            call(*args)


def test_traces_whole_under_torch_compile():
    """One op with a data-dependent width (an unbacked size in the graph): fullgraph compiles it."""
    ids = torch.tensor([[CLS, 11, 12, 13, SEP, PAD], [CLS, 14, SEP, PAD, PAD, PAD]])
    mask = (ids != PAD).long()

    def insert(ids, mask, interval, max_length=None):
        batch = lmk_ops.insert_landmarks(ids, mask, landmark_id=7, interval=interval, max_length=max_length)
        return batch.input_ids, batch.attention_mask, batch.landmark_mask

    torch._dynamo.reset()
    # An int interval, and per-row intervals (training mode: the op checks the values, so nothing reads them in
    # Python).
    for args in ((ids, mask, 2, 5), (ids, mask, torch.tensor([1, 2]))):
        for compiled, eager in zip(torch.compile(insert, fullgraph=True)(*args), insert(*args)):
            assert torch.equal(compiled, eager)


def test_opcheck_insert_landmarks():
    """Schema, fake kernel (the width is a data-dependent size) and the dispatcher's checks."""
    ids = torch.tensor([[CLS, 5, 6, 7, SEP, PAD], [CLS, 5, SEP, PAD, PAD, PAD]])
    for args in ((ids, (ids != PAD).long(), None, torch.tensor([1, 2]), 1, 7, 0, 1, 1, False, None, None),
                 (ids.int(), None, ids == 6, None, 2, 7, 0, 1, 1, True, 5, "left")):
        torch.library.opcheck(torch.ops.lmk_ops.insert_landmarks.default, args)
