"""`python -m workers`: `python -m engine` at any tensor-parallel size (`--tp 2` runs rank 1 as a
Ray actor)."""

from engine.cli import main
from workers.executor_factory import make_executor

raise SystemExit(main(executor_factory=make_executor, prog="python -m workers"))
