"""The fixed orthogonal rotation a ``-rot`` quantizer applies to every token before quantizing.

Real keys carry a few channels tens of times larger than the rest; a per-token scale then
spends the whole code range on them. An orthogonal ``R`` spreads each channel over all of them
(QuaRot, TurboQuant), and costs nothing in attention: ``q . k = (R q) . (R k)``, so the query is
rotated once instead of every key, and ``sum_i p_i v_i = R^T sum_i p_i (R v_i)``, so the output is
rotated back once instead of every value.

``R = (H ⊗ C) diag(s) / sqrt(head_dim)`` with ``head_dim = 2^a * m`` (m odd): ``H`` the Sylvester
Hadamard matrix of order ``2^a`` (entries ±1), ``C`` the discrete Hartley matrix of order ``m``
(``cos + sin``; none of its entries is zero for odd ``m``, so every input channel reaches every
output channel) scaled to be orthonormal, and ``s`` fixed signs drawn from sha256. For a power
of two it is the randomized Hadamard transform. The matrix is part of the stored format: a
cache's codes are only readable with the same ``R``, so it depends on ``head_dim`` alone and is
built the same way on every host and every run.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt

_SIGN_SEED = b"easykv rotation v1"


@functools.lru_cache(maxsize=64)
def rotation_matrix(dim: int) -> npt.NDArray[np.float32]:
    """``R`` (``(dim, dim)`` float32, orthogonal; see the module doc). ``y = R x`` is the rotated
    token; on row-major arrays ``y = x @ R.T`` and ``x = y @ R``."""
    if dim < 1:
        raise ValueError(f"a rotation needs head_dim >= 1, got {dim}")
    two = dim & -dim  # the largest power of two dividing dim
    odd = dim // two
    hadamard = np.ones((1, 1))
    while hadamard.shape[0] < two:
        hadamard = np.block([[hadamard, hadamard], [hadamard, -hadamard]])
    angles = 2 * np.pi * np.outer(np.arange(odd), np.arange(odd)) / odd
    hartley = np.cos(angles) + np.sin(angles)
    matrix = np.kron(hadamard, hartley) / np.sqrt(dim)
    rotation: npt.NDArray[np.float32] = (matrix * _signs(dim)[None, :]).astype(np.float32)
    return rotation


def _signs(dim: int) -> np.ndarray:
    """``dim`` fixed ±1, from sha256 of the seed, ``dim`` and a block counter (the same bits on
    every platform and numpy version)."""
    bits = bytearray()
    block = 0
    while 8 * len(bits) < dim:
        bits += hashlib.sha256(_SIGN_SEED + f" {dim} {block}".encode()).digest()
        block += 1
    unpacked = np.unpackbits(np.frombuffer(bytes(bits), np.uint8))[:dim]
    return np.where(unpacked == 1, -1.0, 1.0)


@dataclasses.dataclass(frozen=True)
class Rotation:
    """The rotation of tokens of ``dim`` values (hashable: static configuration of a jit)."""

    dim: int

    @property
    def matrix(self) -> np.ndarray:
        return rotation_matrix(self.dim)

    def apply(self, x: jax.Array) -> jax.Array:
        """``R x`` for every token ``x`` ``(..., dim)``, in float32."""
        return self._times(x, self.matrix.T)

    def undo(self, y: jax.Array) -> jax.Array:
        """``R^T y`` (the inverse) for every ``y`` ``(..., dim)``, in float32."""
        return self._times(y, self.matrix)

    def undo_leading(self, y: jax.Array, dims: int) -> jax.Array:
        """The first ``dims`` values of ``R^T y``: a latent cache's value read from a rotated key."""
        return self._times(y, self.matrix[:, :dims])

    def _times(self, x: jax.Array, matrix: np.ndarray) -> jax.Array:
        if x.shape[-1] != self.dim:
            raise ValueError(f"rotation of head_dim {self.dim} applied to values of shape {x.shape}")
        # HIGHEST: on TPU/GPU the default precision multiplies f32 in bf16 (or tf32), which would
        # add an error larger than int8's to every token.
        return jnp.matmul(x.astype(jnp.float32), jnp.asarray(matrix), precision=jax.lax.Precision.HIGHEST)
