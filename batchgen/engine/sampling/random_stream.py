"""A counter-based random stream: the noise of a draw is a hash of (row seed, output index, token id).

Nothing is stored between steps. The Gumbel noise that decides the draw of a row's output token
number `position` at vocabulary index `j` is

    key          = splitmix64(splitmix64(seed) ^ (position * GOLDEN64))       per row and position
    bits         = lowbias32(lowbias32(perm(j) ^ key_lo) ^ key_hi)            per token id
    u            = (top 23 bits of `bits` + 0.5) / 2**23                       in [2**-24, 1 - 2**-24]
    gumbel       = -log(-log(u))

and the token drawn is argmax over the kept tokens of (logit / temperature + gumbel): the Gumbel-max
trick, the same thing as the exponential race argmax(p / Exp(1)). So a row's draws depend on its
seed and its own output index only: never on which rows share its batch, on the batch's order, or on
how many steps the engine ran before, and a continued row draws what an uninterrupted run would.

Why this generator (not Philox, not torch.Generator): the hash is a few integer ops that torch runs
on any device on a whole [rows, tokens] block at once, it can be evaluated on a few hundred chosen
token ids as cheaply as on the whole vocabulary (the sampler hashes only its candidate window), and
it needs no state in checkpoints. splitmix64 (Steele et al.) turns the 64-bit (seed, position) pair
into a key; lowbias32 (C. Wellons' 32-bit finalizer, a full-avalanche bijection) mixes token ids
with it in int32, which costs half of an int64 hash over a block. Two rounds with the two key halves
keep streams of different keys unrelated. Uniforms have 23 bits: the largest is below 1 in float32,
so the noise is finite and bounded (GUMBEL_MIN, GUMBEL_MAX).
"""

from __future__ import annotations

import math

import torch

from batchgen.engine.kernels.gumbel_noise import gumbel_noise

GOLDEN64 = 0x9E3779B97F4A7C15
MASK64 = (1 << 64) - 1
UNIFORM_BITS = 23
# the noise's bounds with UNIFORM_BITS-bit uniforms: u in [2**-24, 1 - 2**-24]
GUMBEL_MAX = -math.log(-math.log1p(-2.0 ** -(UNIFORM_BITS + 1)))  # 16.64
GUMBEL_MIN = -math.log(-math.log(2.0 ** -(UNIFORM_BITS + 1)))  # -2.81

_LOW32 = 0xFFFFFFFF
PERM_SALT = 0x2545F491


def _signed(value: int, bits: int) -> int:
    """Two's complement: the same bits as a signed integer (torch has no uint64 arithmetic)."""
    value &= (1 << bits) - 1
    return value - (1 << bits) if value >> (bits - 1) else value


def splitmix64_int(z: int) -> int:
    """splitmix64's output function on a Python int (the tests' and docs' reference)."""
    z = (z + GOLDEN64) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def lowbias32_int(x: int) -> int:
    x &= _LOW32
    x ^= x >> 16
    x = (x * 0x21F0AAAD) & _LOW32
    x ^= x >> 15
    x = (x * 0x735A2D97) & _LOW32
    return x ^ (x >> 15)


def _srl(x: torch.Tensor, shift: int, bits: int) -> torch.Tensor:
    """Logical right shift of a signed tensor (torch's >> is arithmetic)."""
    return (x >> shift) & ((1 << (bits - shift)) - 1)


def _splitmix64(z: torch.Tensor) -> torch.Tensor:
    # z: int64, any shape; wraps modulo 2**64 as the unsigned original
    z = z + _signed(GOLDEN64, 64)
    z = (z ^ _srl(z, 30, 64)) * _signed(0xBF58476D1CE4E5B9, 64)
    z = (z ^ _srl(z, 27, 64)) * _signed(0x94D049BB133111EB, 64)
    return z ^ _srl(z, 31, 64)


def _lowbias32_(x: torch.Tensor) -> torch.Tensor:
    # x: int32, changed in place (the window's blocks are the biggest tensors of a sampling step)
    x ^= _srl(x, 16, 32)
    x *= 0x21F0AAAD
    x ^= _srl(x, 15, 32)
    x *= 0x735A2D97
    x ^= _srl(x, 15, 32)
    return x


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two 32-bit halves of each row's key for its draw at output index `positions`.

    seeds, positions: [rows] int64 (seeds as signed int64 bits); returns ([rows, 1], [rows, 1]) int32."""
    key = _splitmix64(_splitmix64(seeds) ^ (positions * _signed(GOLDEN64, 64)))
    lo = (key & _LOW32).to(torch.int32)  # the cast keeps the low 32 bits
    hi = (_srl(key, 32, 64)).to(torch.int32)
    return lo[:, None], hi[:, None]


_PERMS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _token_perm(vocab_size: int, device: torch.device) -> torch.Tensor:
    """perm(j) = lowbias32(j ^ salt) for every token id and for j = vocab_size (the sampler's tail
    pseudo-token): a bijection computed once per vocabulary."""
    perm = _PERMS.get((device, vocab_size))
    if perm is None:
        perm = _lowbias32_(torch.arange(vocab_size + 1, dtype=torch.int32, device=device) ^ _signed(PERM_SALT, 32))
        _PERMS[(device, vocab_size)] = perm
    return perm


def gumbel(key_lo: torch.Tensor, key_hi: torch.Tensor, token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The Gumbel noise of each row's draw at the given token ids.

    key_lo, key_hi: [rows, 1] int32 from `row_keys`; token_ids: [rows, n] int64 (or [n] for the same
    ids in every row), at most vocab_size; returns [rows, n] float32."""
    noise = gumbel_noise(key_lo, key_hi, token_ids, PERM_SALT, UNIFORM_BITS)  # the CPU kernel
    return gumbel_torch(key_lo, key_hi, token_ids, vocab_size) if noise is None else noise


def gumbel_torch(key_lo: torch.Tensor, key_hi: torch.Tensor, token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`gumbel` in torch ops, for any device."""
    bits = _token_perm(vocab_size, token_ids.device)[token_ids] ^ key_lo
    bits = _lowbias32_(_lowbias32_(bits) ^ key_hi)
    u = _srl(bits, 32 - UNIFORM_BITS, 32).to(torch.float32).add_(0.5).mul_(2.0 ** -UNIFORM_BITS)
    return u.log_().neg_().log_().neg_()


def gumbel_reference(seed: int, position: int, token_id: int) -> float:
    """The same noise in plain Python, one value at a time (for tests and for the docs)."""
    key = splitmix64_int(splitmix64_int(seed & MASK64) ^ ((position * GOLDEN64) & MASK64))
    perm = lowbias32_int(token_id ^ PERM_SALT)
    bits = lowbias32_int(lowbias32_int(perm ^ (key & _LOW32)) ^ (key >> 32))
    u = ((bits >> (32 - UNIFORM_BITS)) + 0.5) * 2.0 ** -UNIFORM_BITS
    return -math.log(-math.log(u))
