"""Host-side shape helpers shared by the kernels' launch code."""

from __future__ import annotations


def pow2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()
