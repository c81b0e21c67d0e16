#!/usr/bin/env python3
"""Independent reference for allgrad-rng's keyed streams (crates/allgrad-rng/src/lib.rs).

Plain Python, no dependencies: the key -> seed mixing (SplitMix64), the ChaCha12 block
function as specified by D. J. Bernstein (64-bit block counter in words 12-13, stream 0 in
words 14-15, as rand_chacha lays it out), two 32-bit words per u64 (low first), Lemire's
bounded integers and Fisher-Yates. Prints the values `tests::pinned_values` holds.

    python3 scripts/reference/ref_keyed_rng.py
"""
M64 = (1 << 64) - 1
M32 = (1 << 32) - 1


def splitmix(z):
    z = (z + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def seed_of(key):
    h = 0x243F6A8885A308D3 ^ len(key)
    for k in key:
        h = splitmix(h ^ splitmix(k))
    words = []
    for i in range(4):
        v = splitmix((h + i) & M64)
        words += [v & M32, v >> 32]  # little-endian bytes = low u32 first
    return words


def rotl(x, n):
    return ((x << n) | (x >> (32 - n))) & M32


def chacha_block(key_words, counter, rounds=12):
    s = [0x61707865, 0x3320646E, 0x79622D32, 0x6B206574] + key_words + [counter & M32, counter >> 32, 0, 0]
    x = list(s)

    def qr(a, b, c, d):
        x[a] = (x[a] + x[b]) & M32; x[d] = rotl(x[d] ^ x[a], 16)
        x[c] = (x[c] + x[d]) & M32; x[b] = rotl(x[b] ^ x[c], 12)
        x[a] = (x[a] + x[b]) & M32; x[d] = rotl(x[d] ^ x[a], 8)
        x[c] = (x[c] + x[d]) & M32; x[b] = rotl(x[b] ^ x[c], 7)

    for _ in range(rounds // 2):
        qr(0, 4, 8, 12); qr(1, 5, 9, 13); qr(2, 6, 10, 14); qr(3, 7, 11, 15)
        qr(0, 5, 10, 15); qr(1, 6, 11, 12); qr(2, 7, 8, 13); qr(3, 4, 9, 14)
    return [(a + b) & M32 for a, b in zip(x, s)]


class Stream:
    def __init__(self, key):
        self.key = seed_of(key)
        self.counter = 0
        self.buf = []

    def u32(self):
        if not self.buf:
            self.buf = chacha_block(self.key, self.counter)
            self.counter += 1
        return self.buf.pop(0)

    def u64(self):
        lo = self.u32()
        return lo | (self.u32() << 32)


def below(rng, n):
    if n <= 1:
        return 0
    threshold = ((1 << 64) - n) % n
    while True:
        m = rng.u64() * n
        if (m & M64) >= threshold:
            return m >> 64


def shuffle(rng, items):
    for i in range(len(items) - 1, 0, -1):
        j = below(rng, i + 1)
        items[i], items[j] = items[j], items[i]


if __name__ == "__main__":
    r = Stream([0])
    print("PINNED_U64 =", [r.u64() for _ in range(3)])
    print("PINNED_BELOW =", below(Stream([7, 1, 2]), 1000))
    v = list(range(10))
    shuffle(Stream([42]), v)
    print("PINNED_SHUFFLE =", v)
