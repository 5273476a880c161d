"""Train a tier classifier from labelled requests:

    python -m router.tiering train --data labelled.jsonl --pools small,large --out tier.json

Each JSONL line is an OpenAI request body (`prompt` or `messages`, `max_tokens`, `tools`,
`response_format`...) with `"label"`: the smallest pool whose answer was good enough. Prompt
lengths are counted with `--model`'s tokenizer (default: the embedded model's), as the router
counts them with the tier's first pool's. A seeded share of the lines (`--holdout`) is kept out of
training and scored; the file is what `tier_routing.<alias>.classifier` names."""

from __future__ import annotations

import argparse
import json
import random
import sys

import torch

from router.tiering.classifier import accuracy, train
from router.tiering.features import request_features


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m router.tiering")
    sub = ap.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="fit a classifier on labelled requests and save it")
    t.add_argument("--data", required=True, help="JSONL: one request body with a `label` per line")
    t.add_argument("--pools", required=True, help="the tier's pools, smallest first: small,large")
    t.add_argument("--out", required=True, help="where the classifier's JSON goes")
    t.add_argument("--model", default=None, help="model directory whose tokenizer counts prompt tokens")
    t.add_argument("--holdout", type=float, default=0.2, help="share of lines scored, not trained on")
    t.add_argument("--steps", type=int, default=300)
    t.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    from transformers import AutoTokenizer

    from engine.model.loader import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(args.model))
    pools = [p for p in args.pools.split(",") if p]
    rows = []
    with open(args.data) as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            body = json.loads(line)
            if body.get("label") not in pools:
                print(f"{args.data}:{n}: label {body.get('label')!r} is not one of {pools}", file=sys.stderr)
                return 2
            rows.append((request_features(body, lambda s: len(tokenizer(s).input_ids)), body["label"]))
    random.Random(args.seed).shuffle(rows)
    cut = int(len(rows) * (1 - args.holdout))
    fit, held = rows[:cut], rows[cut:]
    model = train(fit, pools, steps=args.steps, seed=args.seed)
    model.save(args.out)
    counts = {p: sum(label == p for _, label in rows) for p in pools}
    print(f"{len(rows)} requests {counts}; trained on {len(fit)}: accuracy {accuracy(model, fit):.3f}", end="")
    print(f"; held out {len(held)}: accuracy {accuracy(model, held):.3f}" if held else "")
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
