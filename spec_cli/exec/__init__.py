"""The execution layer: shapes, the tree-aware KV cache runner, its batches and masks, and the backends."""

from spec_cli.exec.runner import Forward, Runner
from spec_cli.exec.shapes import Shapes, power_buckets

__all__ = ["Forward", "Runner", "Shapes", "power_buckets"]
