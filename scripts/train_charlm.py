"""Train the bundled character-level LM (``quantree.workloads.charlm``) on the Python stdlib.

Produces ``src/quantree/workloads/weights/charlm_{rnn}.pt`` (float32 state_dict) and a JSON
record of how it was made. The data order is fully seeded; with ``--minutes`` the number of
steps depends on machine speed, so the learning-rate schedule follows whichever budget
(steps or wall time) is closer to exhausted.

Example: ``python scripts/train_charlm.py --rnn lstm --minutes 35``
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from quantree.workloads.charlm import (
    VOCAB_SIZE,
    CharLM,
    bits_per_char,
    corpus_files,
    load_corpus,
    weights_path,
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rnn", choices=["lstm", "gru"], default="lstm")
    p.add_argument("--steps", type=int, default=100_000, help="maximum optimizer steps")
    p.add_argument("--minutes", type=float, default=None, help="wall-time budget for training")
    p.add_argument(
        "--out", type=Path, default=None, help="weights path (.pt); JSON goes next to it"
    )
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-frac", type=float, default=0.05, help="final lr as fraction of --lr")
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--eval-chars", type=int, default=100_000, help="validation subset size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args()


def lr_at(args: argparse.Namespace, step: int, progress: float) -> float:
    """Linear warmup, then cosine decay from lr to lr*min_lr_frac as progress goes 0 -> 1."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    cos = 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return args.lr * (args.min_lr_frac + (1.0 - args.min_lr_frac) * cos)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)  # leave the other cores free
    torch.manual_seed(args.seed)
    out: Path = args.out if args.out is not None else weights_path(args.rnn)
    out.parent.mkdir(parents=True, exist_ok=True)

    train = load_corpus("train")
    val = load_corpus("validation")
    n_train_files, n_val_files = len(corpus_files("train")), len(corpus_files("validation"))
    print(
        f"train: {len(train):,} chars / {n_train_files} files; "
        f"validation: {len(val):,} chars / {n_val_files} files",
        flush=True,
    )

    model = CharLM(VOCAB_SIZE, rnn=args.rnn)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed)
    offsets = torch.arange(args.seq_len + 1)
    budget_s = args.minutes * 60.0 if args.minutes is not None else None

    history: list[dict[str, float]] = []
    start = time.monotonic()
    step = 0
    bar = tqdm(total=args.steps, desc=f"charlm-{args.rnn}", mininterval=5.0)
    ema_loss = float("nan")
    while step < args.steps:
        elapsed = time.monotonic() - start
        if budget_s is not None and elapsed >= budget_s:
            break
        progress = max(step / args.steps, elapsed / budget_s if budget_s else 0.0)
        for group in opt.param_groups:
            group["lr"] = lr_at(args, step, progress)

        starts = torch.randint(0, len(train) - args.seq_len - 1, (args.batch_size,), generator=gen)
        window = train[starts[:, None] + offsets]
        model.train()
        logits = model(window[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), window[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        step += 1

        bpc = loss.item() / math.log(2.0)
        ema_loss = bpc if math.isnan(ema_loss) else 0.98 * ema_loss + 0.02 * bpc
        bar.update(1)
        if step % args.eval_every == 0:
            model.eval()
            vbpc = bits_per_char(model, val, args.seq_len, args.batch_size, args.eval_chars)
            history.append(
                {
                    "step": step,
                    "seconds": time.monotonic() - start,
                    "train_bpc_ema": ema_loss,
                    "val_bpc_subset": vbpc,
                }
            )
            bar.set_postfix(
                train_bpc=f"{ema_loss:.3f}",
                val_bpc=f"{vbpc:.3f}",
                lr=f"{opt.param_groups[0]['lr']:.2e}",
            )
            print(
                f"\nstep {step}: train_bpc(ema)={ema_loss:.4f} val_bpc(subset)={vbpc:.4f}",
                flush=True,
            )
            torch.save({k: v.float() for k, v in model.state_dict().items()}, out)
    bar.close()
    train_seconds = time.monotonic() - start

    model.eval()
    state = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}
    torch.save(state, out)
    eval_start = time.monotonic()
    val_bpc = bits_per_char(model, val, args.seq_len, args.batch_size)
    record = {
        "rnn": args.rnn,
        "val_bpc": val_bpc,
        "val_eval": {
            "seq_len": args.seq_len,
            "batch_size": args.batch_size,
            "seconds": time.monotonic() - eval_start,
        },
        "steps": step,
        "train_seconds": train_seconds,
        "hyperparameters": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
        },
        "corpus": {
            "train_chars": len(train),
            "validation_chars": len(val),
            "train_files": n_train_files,
            "validation_files": n_val_files,
        },
        "python_version": platform.python_version(),
        "python_implementation": sys.implementation.name,
        "torch_version": torch.__version__,
        "history": history,
    }
    out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    print(
        f"done: {step} steps in {train_seconds:.0f}s, full validation bpc {val_bpc:.4f}", flush=True
    )


if __name__ == "__main__":
    main()
