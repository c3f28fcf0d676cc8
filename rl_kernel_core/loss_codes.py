"""Integer codes of the loss settings that the Triton kernels and the native sources take.

The native sources declare the same codes in ``native/csrc/codes.h`` (a test checks they agree).
A ``+`` KL variant (``"k3+"``) is its base code with a straight-through gradient flag.
"""

KL_CODES: dict[str, int] = {"k1": 0, "abs": 1, "k2": 2, "k3": 3}
AGG_CODES: dict[str, int] = {
    "token-mean": 0,
    "seq-mean-token-sum": 1,
    "seq-mean-token-mean": 2,
    "seq-mean-token-sum-norm": 3,
    "token-sum": 4,
}
ESTIMATOR_CODES: dict[str, int] = {"grpo": 0, "dr_grpo": 1, "rloo": 2}


def kl_code(kl_type: str) -> tuple[int, bool]:
    """``(base estimator code, straight-through k2 gradient)`` for a canonical ``kl_type``."""
    plus = kl_type.endswith("+")
    return KL_CODES[kl_type[:-1] if plus else kl_type], plus
