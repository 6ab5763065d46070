"""How one-token passes run over repacked weights: kernels and prefetch, chosen by measurement.

A decode pass streams every weight matrix once, and what is fastest depends on the CPU and on the
thread count, not on its name:
- Kernels. The R16 copies can be read by the path's own kernels (AVX-512 on the avx512 path) or by
  the AVX2 R16 kernels (a core that splits 512-bit operations, or one that is compute-bound at the
  worker's thread count, may stream faster with them); RQLLM_DECODE_KERNELS=gguf skips them for the
  GGUF layout.
- Prefetch. The R16 kernels can ask for each group's units some way ahead, into L1 or L2. On the
  Zen 5 machines the kernels were tuned on, 6 KB ahead into L1 helped; on an AMD EPYC Zen 4 (one
  thread, one-token matmuls from DRAM) that setting streamed Q4_K at 15 GB/s and Q6_K at 7, no
  prefetch at 18 and 11, and into L2 6-24 KB ahead at 21 and 16 (12 KB: Q4_K's best at 23).
So at load the engine times one-token matmuls of the model's own repacked matrices of each weight
type under each candidate (in rounds, after a warm-up that pages them in), with the worker's
threads, and keeps the fastest for that type: what suits the Q6_K output matrix need not suit the
Q4_K or IQ4_XS layers. A type's timing runs over its largest matrices until they add up to
stream_bytes(): 1.5x this CPU's last-level cache (its size read from sysfs), at least 96 MB, so that
they stream from memory as a decode pass does (one 7 MB layer matrix would be timed from the cache).
A type with fewer bytes than that is swept together with other types' matrices, read untimed, so
that its own are evicted between sweeps as in a pass. (A fixed 96 MB sweep ran from the cache on a
Xeon whose last-level cache is 480 MB, at 37-40 GB/s against 16 streaming; there the prefetch into L1
often won, which streams Q4_K at 11.6-12.5 GB/s against 15.5-16.2 for the prefetches into L2, and a
1.5B model decoded at 9.8 tok/s in runs where the peers' decode had not moved.) Results are the same
bit for bit whichever it is; only the speed differs.

RQLLM_DECODE_KERNELS ("r16", "r16-256", "gguf") and RQLLM_DECODE_PREFETCH ("off", "<bytes>" into
L1, "<bytes>:l2") each fix their half of the choice; the other half is still measured.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ENV = "RQLLM_DECODE_PREFETCH"
ENV_KERNELS = "RQLLM_DECODE_KERNELS"
ROUNDS = 5  # with 3, the choice between close candidates flipped from load to load on a busy host
KEEP_WITHIN = 1.25  # after the first round, only candidates this close to its best are timed on
MIN_STREAM_BYTES = 96 << 20  # per type timed, at least: past the last-level cache of most CPUs (32 MB on Zen 4)
LLC_MARGIN = 1.5  # a sweep of 1.5x the last-level cache: its matrices leave it between sweeps
SYSFS_CPU = Path("/sys/devices/system/cpu")
SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}  # sysfs cache sizes: "48K", "491520K"
KERNELS = ("r16", "r16-256", "gguf")  # _kernels.DECODE_MODES
EVERY_TYPE = -1


@dataclass(frozen=True)
class Prefetch:
    distance: int  # bytes ahead; 0 = off
    to_l2: bool = False

    def __str__(self) -> str:
        return "off" if self.distance == 0 else f"{self.distance} B ahead into {'L2' if self.to_l2 else 'L1'}"

    def short(self) -> str:
        if self.distance == 0:
            return "off"
        size = f"{self.distance // 1024}K" if self.distance % 1024 == 0 else f"{self.distance}B"
        return f"{size}-{'L2' if self.to_l2 else 'L1'}"


OFF = Prefetch(0)
TUNED_ZEN5 = Prefetch(6144)  # the kernels' setting before it was measured per machine
PREFETCHES = (OFF, TUNED_ZEN5, Prefetch(6144, True), Prefetch(12288, True), Prefetch(24576, True))


@dataclass(frozen=True)
class Decode:
    """One way to run the one-token passes: which kernels read the weights, and the R16 prefetch."""
    kernels: str
    prefetch: Prefetch = TUNED_ZEN5

    def __str__(self) -> str:
        return "gguf layout" if self.kernels == "gguf" else f"{self.kernels} kernels, prefetch {self.prefetch}"

    def short(self) -> str:
        return "gguf" if self.kernels == "gguf" else f"{self.kernels}/{self.prefetch.short()}"

    def apply(self, t: int = EVERY_TYPE) -> None:
        """Set it for GGML weight type t."""
        from engine.kernels import _kernels as q

        q.set_decode_mode(self.kernels, t)
        q.r16_set_prefetch(self.prefetch.distance, self.prefetch.to_l2, t)


@dataclass(frozen=True)
class DecodeChoice:
    by_type: dict[int, Decode]  # GGML weight type -> its decode; EVERY_TYPE for all of them
    reason: str

    def describe(self) -> str:
        chosen = ", ".join(str(d) if t == EVERY_TYPE else f"{_type_name(t)}: {d}" for t, d in self.by_type.items())
        return f"decode {chosen} ({self.reason})"


def parse(text: str) -> Prefetch:
    """RQLLM_DECODE_PREFETCH's value: "off", "<bytes>" or "<bytes>:l2"."""
    value = text.strip().lower()
    if value in ("off", "0"):
        return OFF
    number, _, where = value.partition(":")
    if number.isdigit() and where in ("", "l1", "l2"):
        return Prefetch(int(number), where == "l2")
    raise ValueError(f"{ENV} must be off, <bytes> or <bytes>:l2, not {text!r}")


def parse_kernels(text: str) -> str:
    value = text.strip().lower()
    if value not in KERNELS:
        raise ValueError(f"{ENV_KERNELS} must be one of {', '.join(KERNELS)}, not {text!r}")
    return value


def candidates(path: str) -> list[Decode]:
    """The ways to run decode on kernel path `path` that are timed at load: the AVX2 R16 kernels are a
    separate candidate only on the avx512 path. The GGUF layout is not timed: reading its matrices would
    map their pages into the worker beside the repacked copy (what the memory guard counts on not
    happening), so it runs only when RQLLM_DECODE_KERNELS=gguf asks for it."""
    kernels = ["r16", "r16-256"] if path == "avx512" else ["r16"]
    return [Decode(k, p) for k in kernels for p in PREFETCHES]


def _narrowed(path: str, environ) -> tuple[list[Decode], list[str]]:
    """The candidates the environment leaves, and the variables that narrowed them."""
    cands, used = candidates(path), []
    if environ.get(ENV_KERNELS) is not None:
        kernels = parse_kernels(environ[ENV_KERNELS])
        if kernels == "r16-256" and path != "avx512":
            kernels = "r16"  # the AVX2 path's R16 kernels are the 256-bit ones
        cands = [c for c in cands if c.kernels == kernels] or [Decode("gguf", OFF)]
        used.append(ENV_KERNELS)
    if environ.get(ENV) is not None:
        prefetch = parse(environ[ENV])
        # a prefetch is for the R16 kernels; with the GGUF layout asked for as well it is moot
        cands = list(dict.fromkeys(Decode(c.kernels, prefetch) for c in cands if c.kernels != "gguf")) or cands
        used.append(ENV)
    return cands, used


Matrix = tuple[np.ndarray, np.ndarray, int, int]  # (GGUF bytes, R16 bytes, rows, cols)


def _type_name(t: int) -> str:
    from engine.gguf_constants import GGMLQuantizationType  # not the gguf package: the engine starts without it

    return GGMLQuantizationType(t).name


def last_level_cache_bytes(sysfs_cpu: Path = SYSFS_CPU) -> int:
    """The largest data or unified cache of cpu0 in sysfs (its last level), in bytes; 0 if unknown."""
    largest = 0
    for index in sorted((sysfs_cpu / "cpu0" / "cache").glob("index*")):
        try:
            kind = (index / "type").read_text().strip()
            size = (index / "size").read_text().strip().upper()
        except OSError:
            continue
        number, unit = (size[:-1], SIZE_UNITS[size[-1]]) if size[-1:] in SIZE_UNITS else (size, 1)
        if kind != "Instruction" and number.isdigit():
            largest = max(largest, int(number) * unit)
    return largest


def stream_bytes(llc: int | None = None) -> int:
    """How many bytes a type's timing sweeps: past the last-level cache, so that they come from memory."""
    llc = last_level_cache_bytes() if llc is None else llc
    return max(MIN_STREAM_BYTES, int(LLC_MARGIN * llc))


def streamed(matrices: list[Matrix], others: list[tuple[int, Matrix]] = (),
             limit: int | None = None) -> tuple[list[Matrix], list[tuple[int, Matrix]]]:
    """(timed, filler): the largest of a type's matrices until they add up to `limit` (stream_bytes()),
    or all of them; when those fall short, other types' (type, matrix) pairs, largest first, to sweep
    with them untimed, up to the limit or all of them."""
    limit = stream_bytes() if limit is None else limit
    largest_first = ([(None, m) for m in sorted(matrices, key=lambda m: -m[1].nbytes)] +
                     sorted(others, key=lambda um: -um[1][1].nbytes))
    picked, total = [], 0
    for u, m in largest_first:
        if total >= limit:
            break
        picked.append((u, m))
        total += m[1].nbytes
    return [m for u, m in picked if u is None], [(u, m) for u, m in picked if u is not None]


def choose(by_type: dict[int, list[Matrix]], threads: int, environ=None) -> DecodeChoice:
    """Set the decode kernels and prefetch for each weight type and say why. by_type: the model's
    repacked matrices of each GGML type (empty: nothing repacked, nothing to choose)."""
    from engine.kernels import _kernels as q

    environ = os.environ if environ is None else environ
    cands, forced = _narrowed(q.kernel_path(), environ)
    if not by_type:
        choice = DecodeChoice({EVERY_TYPE: Decode("r16", TUNED_ZEN5)}, "nothing repacked")
    elif len(cands) == 1:
        choice = DecodeChoice({EVERY_TYPE: cands[0]}, ", ".join(forced))
    else:
        chosen, rates, limit = {}, [], stream_bytes()
        for t, matrices in sorted(by_type.items(), key=lambda kv: -sum(m[1].nbytes for m in kv[1])):
            others = [(u, m) for u, ms in by_type.items() if u != t for m in ms]
            timed, filler = streamed(matrices, others, limit)
            nbytes = sum(m[1].nbytes for m in timed)
            best = _time_candidates(cands, t, timed, threads, filler)
            chosen[t] = min(cands, key=lambda c: best[c])
            cells = " ".join(f"{c.short()} {nbytes / best[c] / 1e9:.1f}" for c in cands)
            rates.append(f"{_type_name(t)} {nbytes / 1e6:.0f} MB: {cells}")
        by = f"; {', '.join(forced)} set" if forced else ""
        choice = DecodeChoice(chosen, f"measured per type on up to {limit >> 20} MB of its matrices "
                                      f"(and others', read untimed), {threads} threads, GB/s {'; '.join(rates)}{by}")
    for t, decode in choice.by_type.items():
        decode.apply(t)
    return choice


def _time_candidates(cands: list[Decode], t: int, matrices: list[Matrix], threads: int,
                     filler: list[tuple[int, Matrix]] = ()) -> dict[Decode, float]:
    """Each candidate's best seconds for one one-token matmul of each matrix, over ROUNDS rounds; each
    sweep also reads the filler matrices (other types', with their own settings), untimed. Candidates
    over KEEP_WITHIN x the first round's best sit out the other rounds: a sweep past a 480 MB cache
    takes ~50 ms, and timing all ten candidates five times made a 1.5B model's load 6 s instead of 1."""
    from engine.kernels import _kernels as q

    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((1, cols)).astype(np.float32) for _, _, _, cols in matrices]
    fill_xs = [rng.standard_normal((1, cols)).astype(np.float32) for _, (_, _, _, cols) in filler]

    def seconds(c: Decode) -> float:
        c.apply(t)
        total = 0.0
        for (w, r, rows, cols), x in zip(matrices, xs):
            # one call's seconds, no untimed call first: each matrix was last read a whole sweep
            # (>= stream_bytes()) ago, so it comes from memory as in a pass. After an untimed call, a
            # matrix that fits the last-level cache is read from there (Q4_K of a 1.5B model showed
            # 42 GB/s on one Zen 4 thread, 25 in a pass), which favours the fastest-computing kernels.
            total += q.matmul_r16(t, w, r, rows, cols, x, threads, None, 1, warm_up=False)
        for (u, (w, r, rows, cols)), x in zip(filler, fill_xs):  # evicts the timed ones, as a pass would
            q.matmul_r16(u, w, r, rows, cols, x, threads)
        return total

    seconds(cands[0])  # warm-up: pages the matrices in
    times: dict[Decode, list[float]] = {c: [seconds(c)] for c in cands}
    first_best = min(s[0] for s in times.values())
    kept = [c for c in cands if times[c][0] <= KEEP_WITHIN * first_best]
    for _ in range(ROUNDS - 1):
        for c in kept:
            times[c].append(seconds(c))
    return {c: min(s) for c, s in times.items()}
