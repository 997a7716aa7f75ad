"""What drafter's sampling and search kernels share, so that each kernel reads as its own
arithmetic (imported only where Triton runs; every helper is inlined into its kernel).

A search key: a float32 and its index packed into one int64, so that one max reduction finds the
largest value and, among equal values, the lowest index (torch.topk's and argmax's choice). The
float's bits, read as an int32 with a negative float's magnitude bits flipped, order as the
floats do (-inf lowest, a NaN above +inf as in torch.topk); they fill the key's high 32 bits,
the index reversed (last - i, so that the lower index is the larger) the low ones.

    key = pack_key(x, i, last)                  # x float32 at index i <= last: int64 keys
    x, i = key_float(key), key_index(key, last)
    best = top_chunks(MAXES, NC, K, KP)          # the K chunks with the largest maxima
    ids, vals = top_k(x, cols, ok, shift, K, KP)  # the K largest of x [KP, C] and their columns

Gumbel noise: `gumbel(u)` is noise.gumbel's arithmetic (the same clamp), `gumbel_noise` the
noise of a block of columns, from the tests' uniforms or from Philox (four uniforms a draw).
The expansions (tree_kernels' greedy_kernel and sampled_kernel) search with the keys; the
sampled expansion and the walk's last token draw with gumbel_noise.
"""
import triton
import triton.language as tl

from drafter.decoding.noise import U_MAX, U_MIN

SIGN_FLIP = tl.constexpr(0x7FFFFFFF)  # xor'd into a negative float's bits: int32s order as floats
LOW_BITS = tl.constexpr(32)           # the index's bits, below the float's
LOW = tl.constexpr(1 << 32)           # 2**LOW_BITS: a key is the float's bits times LOW + the index
INDEX_MAX = tl.constexpr(2147483647)  # the largest index a key holds (31 bits: the key's low half)
TAKEN = tl.constexpr(-9223372036854775808)  # int64's minimum, no key lower: a key taken or
#                                             masked is never picked again
GUMBEL_U_MIN = tl.constexpr(U_MIN)    # noise.gumbel's clamp of the uniforms, so that the
GUMBEL_U_MAX = tl.constexpr(U_MAX)    # kernels and the PyTorch forms draw alike


@triton.jit
def pack_key(x, i, last):
    # float32 x at index i (0 <= i <= last <= INDEX_MAX) -> int64 keys: the larger x the larger,
    # among equal x the lower i (the tie-break last - i)
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ SIGN_FLIP, bits).to(tl.int64) * LOW + (last - i)


@triton.jit
def key_index(key, last):
    # pack_key's inverse: the index
    return last - (key - (key >> LOW_BITS) * LOW)


@triton.jit
def key_float(key):
    # pack_key's inverse: the float
    bits = (key >> LOW_BITS).to(tl.int32)
    return tl.where(bits < 0, bits ^ SIGN_FLIP, bits).to(tl.float32, bitcast=True)


@triton.jit
def take(key, top):
    # the keys with `top` (the one just picked) out of the later picks
    return tl.where(key == top, TAKEN, key)


@triton.jit
def top_chunks(MAXES, NC: tl.constexpr, K: tl.constexpr, KP: tl.constexpr):
    # MAXES [NC]: a row's chunk maxima -> the K chunks with the largest, largest first (the
    # lower chunk among equal ones), in a [KP] (past K: 0)
    nc = tl.arange(0, NC)
    key = pack_key(tl.load(MAXES + nc), nc, NC - 1)
    kk = tl.arange(0, KP)
    best = tl.zeros([KP], tl.int64)
    for j in tl.static_range(K):
        top = tl.max(key, 0)
        best = tl.where(kk == j, key_index(top, NC - 1), best)
        key = take(key, top)
    return best


@triton.jit
def top_k(x, cols, ok, shift, K: tl.constexpr, KP: tl.constexpr):
    # x [KP, C] float32 at columns `cols`, where `ok` -> the K largest, largest first (the lower
    # column among equal ones): their columns and their values less `shift`, [KP] each (past K: 0)
    kk = tl.arange(0, KP)
    key = tl.where(ok, pack_key(x, cols, INDEX_MAX), TAKEN)
    ids = tl.zeros([KP], tl.int64)
    vals = tl.zeros([KP], tl.float32)
    for j in tl.static_range(K):
        top = tl.max(tl.max(key, 1), 0)
        v = key_float(top)
        ids = tl.where(kk == j, key_index(top, INDEX_MAX), ids)
        vals = tl.where(kk == j, v - shift, vals)
        key = take(key, top)
    return ids, vals


@triton.jit
def gumbel(u):
    # noise.gumbel
    return -tl.log(-tl.log(tl.minimum(tl.maximum(u, GUMBEL_U_MIN), GUMBEL_U_MAX)))


@triton.jit
def philox4(SEED, off4):
    # four uniforms per Philox offset (off4 [..., M] int32) for four adjacent columns: [..., 4M]
    # in a fixed order (a draw of Philox costs ten rounds; one a column would pay four times)
    u0, u1, u2, u3 = tl.rand4x(tl.load(SEED), off4)
    u = tl.join(tl.join(u0, u1), tl.join(u2, u3))                             # [..., M, 2, 2]
    return u


@triton.jit
def gumbel_noise(NOISE, cols, ok, SEED, off4, HAS_NOISE: tl.constexpr):
    # Gumbel noise of the columns `cols` (where `ok`) of a row: the tests' uniforms (NOISE: the
    # row's), else Philox's from the key at SEED, offsets off4 (cols' shape with a fourth of its
    # last dimension: four columns an offset)
    if HAS_NOISE:
        u = tl.load(NOISE + cols, mask=ok, other=0.5)
    else:
        u = tl.reshape(philox4(SEED, off4.to(tl.int32)), cols.shape)
    return gumbel(u)
