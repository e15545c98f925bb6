"""Leaving each text's prompt out of the pooling (include_prompt=False), as sentence-transformers' Pooling does, on
the real MiniLM: padded on either side and flattened, every mode, the landmarks LandmarkTransformer puts into a
prompt, and bad prompt lengths."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lmk_ops  # noqa: E402
from packages import require  # noqa: E402

sentence_transformers = require("sentence_transformers")
from test_flattened import MODEL_PATH, MODES, flattened, padded_fixture  # noqa: E402,F401 (the padded fixture)

PROMPT = 3  # [CLS] and two prompt tokens


def left_padded(features):
    """The same texts padded on the left: each row's valid tokens moved to its end."""
    mask = features["attention_mask"].bool()
    order = torch.argsort((~mask).int() * -1, dim=1, stable=True)  # padding first, the tokens in their order
    return {"token_embeddings": features["token_embeddings"].gather(1, order.unsqueeze(-1).expand_as(
                features["token_embeddings"])),
            "attention_mask": features["attention_mask"].gather(1, order),
            "input_ids": features["input_ids"].gather(1, order)}


def longer_than_prompt(features):
    """The texts with tokens after the prompt (sentence-transformers has no convention for a text without)."""
    keep = features["attention_mask"].sum(1) > PROMPT
    return {key: value[keep] for key, value in features.items()}


def st_pool(mode, features):
    from sentence_transformers.sentence_transformer.modules import Pooling

    pooling = Pooling(features["token_embeddings"].shape[-1], pooling_mode=mode, include_prompt=False)
    return pooling({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in features.items()})[
        "sentence_embedding"]


@pytest.mark.parametrize("layout", ["right", "left", "flattened"])
@pytest.mark.parametrize("prompt_length", ["int", "tensor of one", "tensor per text"])
@pytest.mark.parametrize("st_mode", sorted(MODES))
def test_the_prompt_is_left_out_as_sentence_transformers_leaves_it_out(padded, layout, prompt_length, st_mode):
    from lmk_ops.sentence_transformers import LandmarkPooling

    features = longer_than_prompt(padded)
    features = {"right": features, "left": left_padded(features), "flattened": flattened(features)}[layout]
    batch = features["token_embeddings"].shape[0] if layout != "flattened" else len(features["cu_seq_lens_q"]) - 1
    features["prompt_length"] = {"int": PROMPT, "tensor of one": torch.tensor([PROMPT]),
                                 "tensor per text": torch.full((batch,), PROMPT)}[prompt_length]
    ours = LandmarkPooling(MODES[st_mode], include_prompt=False)({**features})["sentence_embedding"]
    torch.testing.assert_close(ours, st_pool(st_mode, features), atol=1e-6, rtol=1e-5)
    if st_mode != "lasttoken":  # the last token is past the prompt either way
        included = LandmarkPooling(MODES[st_mode])({**features})["sentence_embedding"]
        assert not torch.allclose(ours, included), "the prompt must make a difference here"


@pytest.mark.parametrize("mode", ["mean", "max", "cls", "last", "attention", "mean_sqrt_len_tokens"])
def test_leaving_the_prompt_out_is_pooling_with_the_prompt_masked(padded, mode):
    hidden, mask = padded["token_embeddings"], padded["attention_mask"].bool()
    lengths = torch.tensor([0, 1, 2, 3, 5, 40, 300, 4])  # per text; past some texts' ends
    rank = mask.long().cumsum(1)
    after = mask & (rank > lengths.unsqueeze(1))
    pooling = lmk_ops.nn.Pooling(mode, include_prompt=False,
                                 **({"dim": hidden.shape[-1], "heads": 4} if mode == "attention" else {}))
    if mode == "attention":
        torch.nn.init.normal_(pooling.attention.query)
    with torch.no_grad():
        got = pooling(hidden, {"attention_mask": mask, "prompt_length": lengths})
        want = lmk_ops.nn.Pooling(mode, **({"dim": hidden.shape[-1], "heads": 4} if mode == "attention" else {}))
        if mode == "attention":
            want.attention = pooling.attention
        assert torch.equal(got, want(hidden, {"attention_mask": after}))
    nothing_left = after.sum(1) == 0
    assert nothing_left.any() and torch.equal(got[nothing_left], torch.zeros_like(got[nothing_left]))


def test_weightedmean_keeps_the_weights_of_the_tokens_after_the_prompt(padded):
    hidden, mask = padded["token_embeddings"].double(), padded["attention_mask"].bool()
    lengths = torch.tensor([0, 1, 2, 3, 5, 40, 300, 4])
    got = lmk_ops.nn.Pooling("weightedmean", include_prompt=False)(hidden, {"attention_mask": mask,
                                                                           "prompt_length": lengths})
    rank = (mask.long().cumsum(1) * mask).double()
    weights = rank * (rank > lengths.unsqueeze(1))
    want = (hidden * weights.unsqueeze(-1)).sum(1) / weights.sum(1, keepdim=True).clamp_min(1)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    flat = flattened(padded)
    packed = lmk_ops.nn.Pooling("weightedmean", include_prompt=False)({**flat, "prompt_length": lengths})
    torch.testing.assert_close(packed, got.float(), atol=1e-6, rtol=1e-5)


def test_without_a_prompt_length_nothing_is_left_out(padded):
    pooled = lmk_ops.nn.Pooling("mean", include_prompt=False)(padded["token_embeddings"], padded)
    assert torch.equal(pooled, lmk_ops.nn.Pooling("mean")(padded["token_embeddings"], padded))


@pytest.mark.parametrize("interval", [2, 3, 16])
def test_landmark_transformer_gives_the_prompt_length_with_its_landmarks_and_lmk_leaves_them_out(interval):
    from lmk_ops.sentence_transformers import LandmarkPooling, LandmarkTransformer

    module = LandmarkTransformer(MODEL_PATH, interval=interval)
    prompt = "Represent this sentence for searching relevant passages: "
    texts = ["a short query about cats", "another query, somewhat longer than the first one is", "x"]
    features = module.preprocess(texts, prompt=prompt)
    ids, landmarks = features["input_ids"], features["landmark_mask"].bool()
    length = features["prompt_length"]
    prompt_ids = module.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    for row in range(len(texts)):
        # The prompt span is [CLS], the prompt's tokens and the landmarks of the chunks it fills; no more.
        span = ids[row, :length][~landmarks[row, :length]].tolist()
        assert span == [module.tokenizer.cls_token_id, *prompt_ids]
        assert int(landmarks[row, :length].sum()) == len(prompt_ids) // interval
        assert not landmarks[row, length] and ids[row, length] != prompt_ids[-1]
    with torch.no_grad():
        features = module.forward(features)
        got = LandmarkPooling("lmk", include_prompt=False)({**features})["sentence_embedding"]
        after = landmarks & (torch.arange(ids.shape[1]) >= length)
        assert torch.equal(got, lmk_ops.landmark_mean(features["token_embeddings"], after))
        # sentence-transformers' own Pooling, after LandmarkTransformer, leaves out the same tokens.
        from sentence_transformers.sentence_transformer.modules import Pooling

        theirs = Pooling(features["token_embeddings"].shape[-1], "mean", include_prompt=False)({**features})
        ours = LandmarkPooling("mean", include_prompt=False)({**features})
        torch.testing.assert_close(ours["sentence_embedding"], theirs["sentence_embedding"], atol=1e-6, rtol=1e-5)


def test_include_prompt_is_saved_and_loaded(tmp_path):
    from lmk_ops.sentence_transformers import LandmarkPooling

    LandmarkPooling("mean", include_prompt=False).save(str(tmp_path))
    loaded = LandmarkPooling.load(str(tmp_path))
    assert loaded.include_prompt is False and loaded.pooling.include_prompt is False


@pytest.mark.parametrize("prompt_length", [-1, 1.5, "3", torch.tensor([1.0]), torch.tensor([True]),
                                           torch.tensor([1, 2, 3]), torch.tensor([[1]] * 8), torch.tensor(-2)])
def test_bad_prompt_lengths_are_refused(padded, prompt_length):
    pooling = lmk_ops.nn.Pooling("mean", include_prompt=False)
    with pytest.raises(ValueError, match=r"lmk_ops.nn.Pooling: expected prompt_length"):
        pooling(padded["token_embeddings"], padded, prompt_length=prompt_length)


def test_a_prompt_length_keyword_needs_include_prompt_false(padded):
    with pytest.raises(ValueError, match="lmk_ops.nn.Pooling: expected no prompt_length keyword with include_prompt"):
        lmk_ops.nn.Pooling("mean")(padded["token_embeddings"], padded, prompt_length=2)


def test_include_prompt_must_be_a_bool():
    with pytest.raises(ValueError, match="lmk_ops.nn.Pooling: expected include_prompt as a bool, got 'no'"):
        lmk_ops.nn.Pooling("mean", include_prompt="no")


@pytest.mark.parametrize("mode", ["mean", "weightedmean", "lmk"])
@pytest.mark.parametrize("prompt_length", [2, torch.tensor(1), torch.tensor([0, 1, 3])], ids=["int", "one", "per text"])
def test_leaving_the_prompt_out_compiles_in_one_graph(mode, prompt_length):
    """No graph break (the lengths' check is an op, not a Python branch on their values), and the compiled module
    gives the eager one's bits, padded and packed."""
    torch.manual_seed(0)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, 4:] = 0
    hidden = torch.randn(3, 7, 16)
    packed_hidden, offsets = hidden[mask.bool()], torch.tensor([0, 7, 11, 18], dtype=torch.int32)
    padded = {"attention_mask": mask, "prompt_length": prompt_length, "landmark_mask": mask.bool()}
    packed = {"cu_seqlens": offsets, "prompt_length": prompt_length, "landmark_mask": torch.ones(18, dtype=torch.bool)}
    pooling = lmk_ops.nn.Pooling(mode, include_prompt=False)
    torch._dynamo.reset()
    compiled = torch.compile(lambda h, batch: pooling(h, batch), fullgraph=True)
    assert torch.equal(compiled(hidden, padded), pooling(hidden, padded))
    assert torch.equal(compiled(packed_hidden, packed), pooling(packed_hidden, packed))


def test_a_negative_prompt_length_is_refused_when_compiled_too():
    pooling = lmk_ops.nn.Pooling("mean", include_prompt=False)
    torch._dynamo.reset()
    compiled = torch.compile(lambda h, batch: pooling(h, batch), fullgraph=True)
    with pytest.raises(ValueError, match=r"lmk_ops.nn.Pooling: expected prompt_length >= 0, got \[0, -1, 3\]"):
        compiled(torch.randn(3, 7, 16), {"attention_mask": torch.ones(3, 7, dtype=torch.long),
                                         "prompt_length": torch.tensor([0, -1, 3])})


def test_the_prompt_length_check_passes_opcheck():
    torch.library.opcheck(torch.ops.lmk_ops.nonnegative_prompt_lengths.default, (torch.tensor([0, 2, 5]),))
