"""`meshlm data prepare` and `meshlm data inspect`: the token cache of a config, without training.

Reduces: surprises at step 0 of a long job: the cache is built once (on one node, before the
job) and its documents, tokens, bytes per token, longest documents and the epochs each corpus
gets over the configured run are visible first. Costs: reading meta.json; building the cache
when it is missing (the same code `meshlm train` runs).
"""

from __future__ import annotations

import json
import sys
import time

from meshlm.config import Config, load_config, resolve

EPOCHS_WARNING = 4  # a corpus repeated this often in one run is probably over-weighted or too small


def config_for_data(config_path: str | None, overrides: list[str]) -> Config:
    """The resolved config, with the world size its parallel.* keys imply (no ranks are started)."""
    cfg = load_config(config_path, overrides)
    p = cfg.parallel
    return resolve(cfg, world_size=max(1, p.dp) * p.tp * p.cp * p.pp)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_prepare(args) -> int:
    from meshlm.train.data import prepare_data

    cfg = config_for_data(args.config, args.overrides)
    start = time.perf_counter()
    data = prepare_data(cfg.data, cfg.model.vocab_size, log=_log)
    parts = data.parts or ((1.0, data),)
    report = {"corpus": data.corpus, "cache_hit": data.cache_hit, "seconds": round(time.perf_counter() - start, 3),
              "corpora": [{"corpus": p.corpus, "weight": w, "cache_dir": str(p.cache_dir), "cache_hit": p.cache_hit,
                           "n_train_tokens": p.n_train_tokens, "n_val_tokens": p.n_val_tokens} for w, p in parts]}
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        for row in report["corpora"]:
            print(f"meshlm: {row['corpus']}: {row['n_train_tokens']:,} train + {row['n_val_tokens']:,} held-out "
                  f"tokens in {row['cache_dir']} ({'already prepared' if row['cache_hit'] else 'prepared'})")
    return 0


def inspect_report(cfg: Config) -> dict:
    from meshlm.train.data import prepare_data

    data = prepare_data(cfg.data, cfg.model.vocab_size, log=_log)
    t = cfg.train
    run_samples = t.steps * t.global_batch_size
    corpora, warnings = [], []
    for weight, part in data.parts or ((1.0, data),):
        meta = json.loads((part.cache_dir / "meta.json").read_text())
        windows = max(1, (part.n_train_tokens - 1) // t.seq_len)
        epochs = run_samples * weight / windows
        n_tokens = part.n_train_tokens + part.n_val_tokens
        corpora.append({
            "corpus": part.corpus, "weight": weight, "cache_dir": str(part.cache_dir),
            "documents": meta["documents"], "text_bytes": meta["text_bytes"],
            "n_train_tokens": part.n_train_tokens, "n_val_tokens": part.n_val_tokens,
            "bytes_per_token": round(meta["text_bytes"] / max(1, n_tokens), 3),
            "longest_documents": [{"name": name, "tokens": tokens} for tokens, name in meta.get("longest_documents", [])],
            "epochs": round(epochs, 3), "tokenizer": meta.get("tokenizer_source", meta["tokenizer"]),
            "vocab_size": meta["vocab_size"], "tokenizer_vocab_size": meta["tokenizer_vocab_size"]})
        if epochs >= EPOCHS_WARNING:
            warnings.append(f"{part.corpus} is seen {epochs:.1f} times in {t.steps} steps of {t.global_batch_size}x"
                            f"{t.seq_len} tokens: the model may memorise it (lower its weight or add text)")
    return {"corpora": corpora, "run_tokens": run_samples * t.seq_len, "warnings": warnings}


def run_inspect(args) -> int:
    report = inspect_report(config_for_data(args.config, args.overrides))
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    for c in report["corpora"]:
        print(f"{c['corpus']} (weight {c['weight']:.3f}) in {c['cache_dir']}\n"
              f"  {c['documents']:,} documents, {c['text_bytes'] / 1e6:,.1f} MB of text, {c['n_train_tokens']:,} train + "
              f"{c['n_val_tokens']:,} held-out tokens, {c['bytes_per_token']:.2f} bytes/token "
              f"(tokenizer {c['tokenizer']}, {c['tokenizer_vocab_size']} of {c['vocab_size']} ids)\n"
              f"  epochs over this run: {c['epochs']:.2f}")
        for doc in c["longest_documents"]:
            print(f"    longest: {doc['tokens']:>10,} tokens  {doc['name']}")
    for line in report["warnings"]:
        print(f"warning: {line}")
    return 0
