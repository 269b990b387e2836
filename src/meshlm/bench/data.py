"""`meshlm bench data [--size-mb 1024] [--workers N] [--json]`: preparation against the tokenizer's own batch encoding.

Reduces: guessing whether streaming through worker processes costs throughput, and whether its
memory really stays flat. Costs: generating the corpus (deleted afterwards) and encoding it all:
about 8 minutes per GB on a 2-core machine, ~1 minute on 16 cores.

meshlm: `prepare_data` on a generated corpus (many text files of Zipf-distributed synthetic
words; `--size-mb`), in a child process: BPE trained on its bounded sample, then every byte
encoded by `--workers` processes; its total time includes hashing, sampling, BPE training and the
final merge. Peak memory: the child's VmHWM (the preparing process) + workers x the largest
worker's VmHWM (meta.json), an upper bound of everything resident at once.
Throughput, paired (`--pairs`, alternating who goes first, as the other benches): on the first
`--reference-mb` of the corpus, meshlm's encoding phase (meta.json's encode_seconds, with that
BPE as a pretrained tokenizer) against the reference: the same tokenizer's `encode_batch_fast`
on the same pieces (16 KB, cut where meshlm cuts them), on all cores through tokenizers' own
thread pool, in 8 MB batches, text already in memory, in a child process (its VmHWM). Holding a
whole GB of Encodings at once, as the code before this did, would need ~50 GB: not attempted.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from meshlm.errors import OneLineErrorParser

_CHILD_PREPARE = """
import json, sys, time
from meshlm.config import DataConfig
from meshlm.train.data import prepare_data
t0 = time.perf_counter()
data = prepare_data(DataConfig(path={path!r}, cache_dir={cache!r}, workers={workers}, tokenizer={tokenizer!r}), {vocab},
                    log=lambda m: print(m, file=sys.stderr, flush=True))
seconds = time.perf_counter() - t0
meta = json.loads((data.cache_dir / "meta.json").read_text())
hwm = int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM:")).split()[1]) * 1024
print(json.dumps({{"seconds": seconds, "meta": meta, "main_peak": hwm, "tokenizer": str(data.tokenizer_path),
                  "worker_peak": meta["worker_peak_bytes"]}}))
"""

_CHILD_REFERENCE = """
import json, os, sys, time
from pathlib import Path
from tokenizers import Tokenizer
from meshlm.train.tokenizer import split_for_encoding
tokenizer = Tokenizer.from_file({tokenizer!r})
files, budget, texts = sorted(Path({path!r}).rglob("*.txt")), {limit}, []
for f in files:
    if budget <= 0:
        break
    texts.append(f.read_text()[:budget])
    budget -= len(texts[-1])
pieces = [p for t in texts for p in split_for_encoding(t)]
n_bytes, tokens, seconds, batch, size = sum(len(t.encode()) for t in texts), 0, 0.0, [], 0
for piece in pieces + [None]:
    if piece is None or size >= 8 << 20:
        t0 = time.perf_counter()
        tokens += sum(len(e.ids) for e in tokenizer.encode_batch_fast(batch, add_special_tokens=False))
        seconds += time.perf_counter() - t0
        batch, size = [], 0
    if piece is not None:
        batch.append(piece)
        size += len(piece)
hwm = int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM:")).split()[1]) * 1024
print(json.dumps({{"seconds": seconds, "bytes": n_bytes, "tokens": tokens, "peak": hwm}}))
"""


def generate_corpus(root: Path, size_mb: int, seed: int = 0, file_mb: int = 1) -> int:
    """Text files of lines drawn from a pool of synthetic sentences over a Zipf vocabulary."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlucmfwypvbgkqjxz"))
    words = ["".join(rng.choice(letters, size=rng.integers(1, 11))) for _ in range(50_000)]
    ranks = np.minimum(rng.zipf(1.2, size=2_000_000), len(words)) - 1
    punctuation = [" ", " ", " ", " ", ", ", ". ", "; ", " (", ") ", ": "]
    lines, at = [], 0
    for _ in range(65_536):
        n = int(rng.integers(4, 24))
        line = "".join(words[r] + punctuation[int(rng.integers(len(punctuation)))] for r in ranks[at:at + n])
        lines.append((line.strip().capitalize() + "\n").encode())
        at = (at + n) % (len(ranks) - 30)
    pool = np.array(lines, dtype=object)
    root.mkdir(parents=True, exist_ok=True)
    written, index = 0, 0
    while written < size_mb << 20:
        target = min(file_mb << 20, (size_mb << 20) - written)
        with open(root / f"part-{index:04d}.txt", "wb") as f:
            done = 0
            while done < target:
                block = b"".join(pool[rng.integers(0, len(pool), 2_000)])
                f.write(block)
                done += len(block)
        written += done
        index += 1
    return written


def _subset(corpus: Path, subset: Path, limit: int) -> Path:
    """A directory of links to the first corpus files, about `limit` bytes: the paired runs' input."""
    subset.mkdir()
    total = 0
    for path in sorted(corpus.iterdir()):
        if total >= limit:
            break
        (subset / path.name).symlink_to(path)
        total += path.stat().st_size
    return subset


def _child(script: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    env.pop("TOKENIZERS_PARALLELISM", None)  # the reference uses tokenizers' own thread pool
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"bench child failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(opts) -> dict:
    from meshlm.bench.report import bench_row
    from meshlm.data.encode import default_workers

    workers = opts.workers or default_workers()
    work = Path(tempfile.mkdtemp(prefix="meshlm-bench-data-", dir=opts.dir))
    try:
        t0 = time.perf_counter()
        size = generate_corpus(work / "corpus", opts.size_mb)
        generated_s = time.perf_counter() - t0
        ours = _child(_CHILD_PREPARE.format(path=str(work / "corpus"), cache=str(work / "cache"),
                                            workers=workers, vocab=opts.vocab_size, tokenizer=None))
        subset = _subset(work / "corpus", work / "subset", opts.reference_mb << 20)
        ours_tps, reference_tps, reference = [], [], None
        for pair in range(opts.pairs):  # alternate who goes first: a slow spell hits both sides
            for side in ("meshlm", "reference") if pair % 2 == 0 else ("reference", "meshlm"):
                if side == "meshlm":
                    run = _child(_CHILD_PREPARE.format(path=str(subset), cache=str(work / f"pair{pair}"), workers=workers,
                                                       vocab=opts.vocab_size, tokenizer=ours["tokenizer"]))
                    subset_peak = run["main_peak"] + workers * run["worker_peak"]  # the reference's workload
                    ours_tps.append((run["meta"]["n_train_tokens"] + run["meta"]["n_val_tokens"])
                                    / run["meta"]["encode_seconds"])
                else:
                    reference = _child(_CHILD_REFERENCE.format(tokenizer=ours["tokenizer"], path=str(subset), limit=1 << 62))
                    reference_tps.append(reference["tokens"] / reference["seconds"])
    finally:
        if not opts.keep:
            shutil.rmtree(work, ignore_errors=True)
    meta = ours["meta"]
    tokens = meta["n_train_tokens"] + meta["n_val_tokens"]
    our_peak = ours["main_peak"] + workers * ours["worker_peak"]
    row = bench_row(
        "prepare", 1, f"tokenizers encode_batch_fast ({os.cpu_count()} threads)",
        ours_tps, reference_tps, subset_peak, reference["peak"], workers=workers,
        meshlm_whole_corpus_tokens_per_s=tokens / meta["encode_seconds"], corpus_bytes=meta["text_bytes"], corpus_documents=meta["documents"], tokens=tokens,
        meshlm_encode_mb_per_s=meta["text_bytes"] / 1e6 / meta["encode_seconds"],
        meshlm_total_seconds=ours["seconds"], meshlm_total_mb_per_s=meta["text_bytes"] / 1e6 / ours["seconds"],
        meshlm_main_peak_bytes=ours["main_peak"], meshlm_worker_peak_bytes=ours["worker_peak"],
        meshlm_whole_corpus_peak_bytes=our_peak,
        reference_mb_per_s=reference["bytes"] / 1e6 / reference["seconds"], reference_bytes=reference["bytes"],
        generate_seconds=round(generated_s, 1))
    return {"bench": "data", "rows": [row]}


def main(argv: list[str] | None = None) -> int:
    from meshlm.bench.report import first_sentence

    p = OneLineErrorParser(prog="meshlm bench data", description=first_sentence(__doc__))
    p.add_argument("--size-mb", type=int, default=1024, help="generated corpus size (default 1 GB)")
    p.add_argument("--reference-mb", type=int, default=64, help="corpus prefix of the paired throughput runs")
    p.add_argument("--pairs", type=int, default=3, help="paired runs, meshlm and reference alternating")
    p.add_argument("--workers", type=int, default=0, help="data.workers (0 = the cores)")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--dir", default=None, help="where to generate the corpus and cache (default: the temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the generated corpus and cache")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    opts = p.parse_args(argv)
    if opts.size_mb < 1 or opts.reference_mb < 1 or opts.pairs < 1 or opts.workers < 0:
        print("meshlm bench data: --size-mb, --reference-mb and --pairs must be >= 1, --workers >= 0", file=sys.stderr)
        return 2
    if opts.dir is not None and not Path(opts.dir).expanduser().is_dir():
        print(f"meshlm bench data: error: --dir: {opts.dir} is not a directory", file=sys.stderr)
        return 2
    result = run(opts)
    if opts.json:
        print(json.dumps(result, indent=1))
    else:
        r = result["rows"][0]
        print(f"prepare {r['corpus_bytes'] / 1e6:,.0f} MB ({r['corpus_documents']:,} documents, {r['tokens']:,} tokens) "
              f"on {r['workers']} workers: encoding {r['meshlm_encode_mb_per_s']:.2f} MB/s, all steps "
              f"{r['meshlm_total_seconds']:.0f} s ({r['meshlm_total_mb_per_s']:.2f} MB/s)\n"
              f"paired on {r['reference_bytes'] / 1e6:,.0f} MB: meshlm {r['meshlm_tokens_per_s']:,.0f} tokens/s, "
              f"{r['reference']} {r['reference_tokens_per_s']:,.0f}; ratio {r['tokens_per_s_ratio']:.2f} "
              f"(quartiles {r['tokens_per_s_ratio_quartiles'][0]:.2f}-{r['tokens_per_s_ratio_quartiles'][1]:.2f})\n"
              f"peak memory: meshlm {r['meshlm_peak_bytes'] / 2**20:,.0f} MiB (main {r['meshlm_main_peak_bytes'] / 2**20:,.0f} "
              f"+ {r['workers']} x worker {r['meshlm_worker_peak_bytes'] / 2**20:,.0f}), reference "
              f"{r['reference_peak_bytes'] / 2**20:,.0f} MiB on {r['reference_bytes'] / 1e6:,.0f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
