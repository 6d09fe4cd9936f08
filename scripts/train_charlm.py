"""Train the bundled character-level LM (``quantree.workloads.charlm``) on the Python stdlib.

Produces ``src/quantree/workloads/weights/charlm_{rnn}.pt`` (float32 state_dict) and a JSON
record of how it was made, including the command that reproduces it.

Reproducible by construction: the initialization and the data order are seeded, and the
learning-rate schedule (linear warmup, cosine decay over ``--steps``) depends on the step
count only. ``--stop-after N`` ends the run after N steps on the same schedule; ``--minutes``
is a wall-time safety stop that never shapes the schedule. A run cut short by ``--minutes``
records ``--stop-after <steps done>`` in its reproduction command. Bit-equal weights also need
the same torch build, thread count (``--threads``) and CPU instruction set.

Example: ``python scripts/train_charlm.py --rnn lstm --steps 10000``
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shlex
import sys
import time
from collections.abc import Callable
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

SCRIPT = "scripts/train_charlm.py"
# Options that do not change the weights (where they go, when to give up) are left out of
# the reproduction command, apart from --out when it was given.
NOT_REPRODUCED = {"minutes", "stop_after", "out"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rnn", choices=["lstm", "gru"], default="lstm")
    p.add_argument(
        "--steps", type=int, default=10_000, help="optimizer steps: the schedule's length"
    )
    p.add_argument(
        "--stop-after", type=int, default=None, help="stop after this many steps (same schedule)"
    )
    p.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="wall-time safety stop; never changes the schedule",
    )
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
    return p.parse_args(argv)


def lr_at(args: argparse.Namespace, step: int) -> float:
    """Linear warmup, then cosine decay from lr to lr*min_lr_frac over ``args.steps`` steps."""
    if step < args.warmup:
        return float(args.lr * (step + 1) / args.warmup)
    progress = min(step / max(args.steps, 1), 1.0)
    cos = 0.5 * (1.0 + math.cos(math.pi * progress))
    return float(args.lr * (args.min_lr_frac + (1.0 - args.min_lr_frac) * cos))


def reproduce_command(args: argparse.Namespace, steps_done: int) -> str:
    """The command that retrains these weights: every option spelled out, no wall time."""
    words = ["python", SCRIPT]
    for key, value in vars(args).items():
        if key in NOT_REPRODUCED or value is None:
            continue
        words += [f"--{key.replace('_', '-')}", str(value)]
    if args.out is not None:
        words += ["--out", str(args.out)]
    if steps_done < args.steps:
        words += ["--stop-after", str(steps_done)]
    return shlex.join(words)


def train(
    args: argparse.Namespace,
    train_stream: torch.Tensor,
    val_stream: torch.Tensor | None = None,
    checkpoint: Path | None = None,
    log: Callable[[str], None] = print,
) -> tuple[CharLM, dict[str, object]]:
    """Train from scratch; returns the model (eval mode) and the record of the run."""
    torch.set_num_threads(args.threads)  # leave the other cores free
    torch.manual_seed(args.seed)
    model = CharLM(VOCAB_SIZE, rnn=args.rnn)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed)
    offsets = torch.arange(args.seq_len + 1)
    budget_s = args.minutes * 60.0 if args.minutes is not None else None
    last = args.steps if args.stop_after is None else min(args.steps, args.stop_after)

    history: list[dict[str, float]] = []
    start = time.monotonic()
    step = 0
    stopped_by = "steps" if last == args.steps else "stop_after"
    bar = tqdm(total=last, desc=f"charlm-{args.rnn}", mininterval=5.0, disable=last < 100)
    ema_loss = float("nan")
    while step < last:
        if budget_s is not None and time.monotonic() - start >= budget_s:
            stopped_by = "minutes"
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(args, step)

        starts = torch.randint(
            0, len(train_stream) - args.seq_len - 1, (args.batch_size,), generator=gen
        )
        window = train_stream[starts[:, None] + offsets]
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
        if val_stream is not None and step % args.eval_every == 0:
            model.eval()
            vbpc = bits_per_char(model, val_stream, args.seq_len, args.batch_size, args.eval_chars)
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
            log(f"\nstep {step}: train_bpc(ema)={ema_loss:.4f} val_bpc(subset)={vbpc:.4f}")
            if checkpoint is not None:
                torch.save({k: v.float() for k, v in model.state_dict().items()}, checkpoint)
    bar.close()
    model.eval()
    record: dict[str, object] = {
        "rnn": args.rnn,
        "reproduce": reproduce_command(args, step),
        "steps": step,
        "stopped_by": stopped_by,
        "train_seconds": time.monotonic() - start,
        "hyperparameters": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
        },
        "python_version": platform.python_version(),
        "python_implementation": sys.implementation.name,
        "torch_version": torch.__version__,
        "history": history,
    }
    return model, record


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out: Path = args.out if args.out is not None else weights_path(args.rnn)
    out.parent.mkdir(parents=True, exist_ok=True)

    train_stream = load_corpus("train")
    val = load_corpus("validation")
    n_train_files, n_val_files = len(corpus_files("train")), len(corpus_files("validation"))
    print(
        f"train: {len(train_stream):,} chars / {n_train_files} files; "
        f"validation: {len(val):,} chars / {n_val_files} files",
        flush=True,
    )
    model, record = train(args, train_stream, val, out, log=lambda m: print(m, flush=True))
    state = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}
    torch.save(state, out)
    eval_start = time.monotonic()
    val_bpc = bits_per_char(model, val, args.seq_len, args.batch_size)
    record |= {
        "val_bpc": val_bpc,
        "val_eval": {
            "seq_len": args.seq_len,
            "batch_size": args.batch_size,
            "seconds": time.monotonic() - eval_start,
        },
        "corpus": {
            "train_chars": len(train_stream),
            "validation_chars": len(val),
            "train_files": n_train_files,
            "validation_files": n_val_files,
        },
    }
    out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    print(
        f"done: {record['steps']} steps ({record['stopped_by']}) in "
        f"{record['train_seconds']:.0f}s, full validation bpc {val_bpc:.4f}\n"
        f"reproduce: {record['reproduce']}",
        flush=True,
    )


if __name__ == "__main__":
    main()
