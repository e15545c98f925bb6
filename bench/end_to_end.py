"""What lmk_ops gains a user end to end: a training step and inference of a BERT-base-sized encoder built from a
config (random weights, nothing downloaded), bf16 autocast, with mean pooling and LMK pooling, against
sentence-transformers' own Pooling module (for LMK: that module's mean over the landmark mask, which is how one
would write it with sentence-transformers). The training step is an in-batch contrastive loss (the first half of
the batch against the second), AdamW. Step time is the median over timed steps after warm-up (CUDA events on a
GPU); peak memory is torch.cuda.max_memory_allocated over the timed steps.

    python bench/end_to_end.py --device cuda --json RESULTS/end_to_end.json
    python bench/end_to_end.py --device cpu --layers 2 --hidden 64 --batch 8 --seq-len 64 --texts 16  # smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F
# The path every sentence-transformers release keeps (5.x, where a GPU machine may be, and 6.x).
from sentence_transformers.sentence_transformer.modules import Pooling as StPooling
from transformers import BertConfig, BertModel

import lmk_ops
from lmk_ops.bench import call_ms


def poolers(dim: int) -> dict:
    """name -> f(hidden, attention_mask, landmark_mask) -> L2-normalised [B, D] embeddings."""
    st_mean = StPooling(dim, pooling_mode="mean")

    def st(hidden, mask):
        return F.normalize(st_mean({"token_embeddings": hidden, "attention_mask": mask})["sentence_embedding"], dim=-1)

    return {
        "mean/lmk_ops": lambda h, m, lm: lmk_ops.mean_pool(h, m, normalize=True),
        "mean/sentence-transformers": lambda h, m, lm: st(h, m),
        "lmk/lmk_ops": lambda h, m, lm: lmk_ops.landmark_mean(h, lm, normalize=True),
        "lmk/sentence-transformers": lambda h, m, lm: st(h, lm.long()),
    }


def token_batch(batch: int, seq_len: int, vocab: int, device, seed: int):
    """Random texts of 1/4 to all of seq_len tokens, in the LMK layout (a landmark every 32 tokens)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(seq_len // 4, seq_len + 1, (batch,), generator=gen)
    ids = torch.randint(1000, vocab, (batch, seq_len), generator=gen)
    mask = (torch.arange(seq_len) < lengths[:, None]).long()
    ids[:, 0] = 101
    ids[torch.arange(batch), lengths - 1] = 102
    ids = ids * mask
    out = lmk_ops.insert_landmarks(ids, mask, landmark_id=102, interval=32, max_length=seq_len)
    return out.to(device)


def measure(device: str, fn, warmup: int, steps: int) -> tuple[float, float | None]:
    """Median milliseconds of fn over `steps` calls after `warmup`, and the peak GiB allocated during them."""
    for _ in range(warmup):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    ms = statistics.median(call_ms(fn, device) for _ in range(steps))
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    return ms, peak


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--batch", type=int, default=128, help="texts per training step (and per inference batch)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--texts", type=int, default=1024, help="texts encoded by the inference measurement")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available to torch")
    heads = max(1, args.hidden // 64)
    config = BertConfig(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=heads,
                        intermediate_size=4 * args.hidden, max_position_embeddings=max(512, args.seq_len))
    torch.manual_seed(0)
    model = BertModel(config, add_pooling_layer=False).to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    train = token_batch(args.batch, args.seq_len, config.vocab_size, args.device, seed=1)
    texts = [token_batch(args.batch, args.seq_len, config.vocab_size, args.device, seed=2 + i)
             for i in range(max(1, args.texts // args.batch))]
    autocast = torch.autocast(args.device, dtype=torch.bfloat16)
    rows = []
    for name, pool in poolers(args.hidden).items():
        def step():
            with autocast:
                hidden = model(**train.model_inputs()).last_hidden_state
                emb = pool(hidden, train.attention_mask, train.landmark_mask).float()
            half = emb.shape[0] // 2
            logits = emb[:half] @ emb[half:2 * half].T / 0.05
            loss = F.cross_entropy(logits, torch.arange(half, device=logits.device))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        def encode():
            with torch.inference_mode(), autocast:
                for batch in texts:
                    pool(model(**batch.model_inputs()).last_hidden_state, batch.attention_mask, batch.landmark_mask)

        train_ms, train_peak = measure(args.device, step, args.warmup, args.steps)
        infer_ms, infer_peak = measure(args.device, encode, 1, max(1, args.steps // 3))
        rows.append({"pooling": name, "train_step_ms": train_ms, "train_peak_gib": train_peak,
                     "inference_ms": infer_ms, "inference_peak_gib": infer_peak})
        print(f"{name:28} train step {train_ms:9.2f} ms  peak {train_peak or 0:6.2f} GiB   "
              f"inference of {len(texts) * args.batch} texts {infer_ms:9.2f} ms  peak {infer_peak or 0:6.2f} GiB",
              flush=True)
    if args.json:
        machine = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(["python", "bench/end_to_end.py", *(argv or sys.argv[1:])]),
                       "device": args.device, "machine": machine, "torch": torch.__version__,
                       "config": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
