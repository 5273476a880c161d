"""The offload tier's flags, for both CLIs (engine/cli.py, router/cli.py)."""

from __future__ import annotations

import argparse
from typing import Callable

from engine import choices


def add_offload_flags(parser: argparse.ArgumentParser, default: Callable[[str], object]) -> None:
    """`default(field)`: the caller's one source of defaults (EngineArgs, or AppConfig, which
    takes EngineArgs')."""
    parser.add_argument(
        "--kv-offload-bytes",
        type=int,
        default=default("kv_offload_bytes"),
        help="offload tier per replica: evicted KV blocks kept and loaded back on a prefix hit (0: off)",
    )
    parser.add_argument(
        "--kv-offload-medium",
        default=default("kv_offload_medium"),
        choices=list(choices.KV_OFFLOAD_MEDIA),
        help="disk: a memory-mapped file per rank; host: host memory (pinned on CUDA)",
    )
    parser.add_argument("--kv-offload-dir", default=default("kv_offload_dir"), help="the disk tier's directory")
